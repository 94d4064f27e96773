"""Where each run of a sweep stands: its folder's status.json and what SLURM (sacct) says about its job.

    python -m slurm.status delta                    # table: run id, folder state, job id, sacct state, steps, error
    python -m slurm.status delta --preset tiny      # the runs of the tiny version of the sweep
    python -m slurm.status delta --json             # one JSON object per run

Folder states: running | done | failed | cancelled, or ``-`` (not started; ``queued`` when a job was submitted).
The job id comes from the folder's slurm.json (written by slurm.submit) or status.json; the sacct column is
``n/a`` where SLURM accounting cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.config import ConfigError
from experiments.rundir import RunDir
from slurm import queue
from slurm.submit import RUNS_ROOT, job_of, read_record
from sweeps import expand


def _steps(rd: RunDir) -> int:
    try:
        with open(rd.metrics_path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


def rows(sweep: str | Path, preset: str | None = None, out_root: str | Path | None = None) -> list[dict]:
    """One dict per run: run_id, arm, state, job, sacct, steps, attempts, error."""
    root = Path(out_root) if out_root else RUNS_ROOT
    specs = expand(sweep, preset=preset)
    out = []
    for s in specs:
        rd = RunDir(root / s.sweep / s.run_id)
        st = rd.status() or {}
        state = st.get("state") or ("queued" if read_record(rd.path) else "-")
        error = (st.get("error") or "").splitlines()[-1:] if state != "done" else []
        out.append(
            {
                "run_id": s.run_id,
                "arm": s.meta["arm"],
                "state": state,
                "job": job_of(rd.path),
                "steps": _steps(rd),
                "attempts": st.get("attempts", 0),
                "error": error[0] if error else "",
            }
        )
    jobs = [r["job"] for r in out if r["job"]]
    try:
        states = queue.sacct_states(jobs) if jobs else {}
    except queue.QueueError:
        states = None
    for r in out:
        r["sacct"] = "n/a" if states is None else states.get(r["job"], "-") if r["job"] else "-"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m slurm.status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("sweep", help="sweep file or name (sweeps/delta.yaml or delta)")
    p.add_argument("--preset", help="the preset the sweep was submitted with (e.g. tiny)")
    p.add_argument("--out-root", help="root of the run folders (default results/runs)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(argv)
    try:
        table = rows(args.sweep, args.preset, args.out_root)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        for r in table:
            print(json.dumps(r))
        return 0
    cols = ("run_id", "state", "job", "sacct", "steps", "attempts", "error")
    text = [[str(r[c] if r[c] is not None else "-") for c in cols] for r in table]
    widths = [max([len(c)] + [len(t[i]) for t in text]) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    for t in text:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip())
    counts = {}
    for r in table:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    print(f"{len(table)} runs: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
