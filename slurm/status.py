"""Where each run of a sweep stands: its folder's status.json and what SLURM (sacct) says about its job.

    python -m slurm.status delta                    # table: run id, folder state, job id, sacct state, steps, error
    python -m slurm.status delta --preset tiny      # the runs of the tiny version of the sweep
    python -m slurm.status delta --json             # one JSON object per run

State column: the folder's state (running | done | failed | cancelled), checked against SLURM where the folder
cannot know: a folder with no status.json whose job was submitted reads ``queued`` while SLURM has the job,
``not started (job CANCELLED)`` (or FAILED, TIMEOUT, ...) once its job ended without starting the run, and
``submitted`` where neither sacct nor squeue can be read; a ``running`` folder whose job ended reads
``stopped (job TIMEOUT)`` etc. (the run was killed before it could record it; resubmitting resumes it), unless a
process holds the folder's lock (a run restarted by hand with ``experiments.run`` after its job ended is running).
``held (REASON)``: SLURM holds the run's job (squeue's reason: ``JobHeldUser``, or ``launch failed requeued held``
when a node could not start it); it starts only after ``scontrol release JOB``, and where a node failed, after the
node is back (the table's last lines name each node that starts no job, and why: ``vm drained: SlurmdSpoolDir is
full``). ``bad``: status.json or config.yaml cannot be read (the error column says why). ``-``: not started. The job
id comes from the folder's slurm.json (written by slurm.submit) or status.json; the sacct column is ``n/a`` where SLURM
accounting cannot be read. A config that runs in another sweep's folder (a config runs once) shows that folder's
state, and the ``in`` column names the folder.

The last line counts the states and, while runs are going, the progress: done / total and an ETA from the
median wall time of the done runs (status.json started -> finished) times the runs left, divided by the number
running now.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from experiments.config import ConfigError
from experiments.rundir import BAD, RUNS_ROOT, RunDir, RunFolderError, folders_of, runs_by_hash
from experiments.sweep import expand
from slurm import queue


def _steps(rd: RunDir) -> int:
    try:
        with open(rd.metrics_path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


def rows(sweep: str | Path, preset: str | None = None, out_root: str | Path | None = None) -> list[dict]:
    """One dict per run: run_id, arm, backend, folder, state, job, sacct, steps, attempts, error, in (the folder
    holding the config when it is another sweep's, else ""), wall_s (started -> finished of a done run's last
    attempt, else None). Never raises on a folder."""
    root = Path(out_root) if out_root else RUNS_ROOT
    specs = expand(sweep, preset=preset)
    out = []
    index = runs_by_hash(root)
    for s in specs:
        rd = RunDir(root / s.sweep / s.run_id)
        where = ""
        if not rd.path.exists():  # a config runs once: it may run, or have run, in another sweep's folder
            others = folders_of(index, s.config.run_hash())
            if others:
                rd = RunDir(others[0])
                where = str(rd.path.relative_to(root)) if rd.path.is_relative_to(root) else str(rd.path)
        st = rd.status() or {}
        state = st.get("state") or ("submitted" if rd.job_record() else "-")
        error = (st.get("error") or "").splitlines()[-1:] if state != "done" else []
        try:
            rd.config_hash()
        except RunFolderError as e:
            state, error = BAD, [str(e)]
        if state == BAD:
            error = error or [st["problem"]]
        out.append(
            {
                "run_id": s.run_id,
                "arm": s.meta["arm"],
                "backend": s.config.backend,
                "folder": str(rd.path),
                "state": state,
                "job": rd.job_id(),
                "steps": _steps(rd),
                "attempts": st.get("attempts", 0),
                "error": error[0] if error else "",
                "in": where,
                "wall_s": st["finished"] - st["started"]
                if state == "done" and "finished" in st and "started" in st
                else None,
                "finished": st.get("finished") if state == "done" else None,
                "locked": state == "running" and rd.locked(),
            }
        )
    jobs = [r["job"] for r in out if r["job"]]
    try:
        states = queue.sacct_states(jobs) if jobs else {}
    except queue.QueueError:
        states = None
    live = None
    if states is None and any(r["state"] in ("submitted", "running") for r in out):
        try:
            live = queue.live_jobs()
        except queue.QueueError:
            live = None
    held = _held(out)
    for r in out:
        r["sacct"] = "n/a" if states is None else states.get(r["job"], "-") if r["job"] else "-"
        locked = r.pop("locked")
        r["state"] = _reconcile(r["state"], r["job"], states, live, locked)
        if r["job"] in held and r["state"] in ("submitted", "queued", "running") and not locked:
            r["state"] = f"held ({held[r['job']]})"
    return out


def _held(table: list[dict]) -> dict[str, str]:
    """{job id: reason} of the held jobs among the table's (squeue), asked only when a run waits on its job."""
    if not any(r["job"] and r["state"] in ("submitted", "running") for r in table):
        return {}
    try:
        return queue.held_jobs()
    except queue.QueueError:
        return {}


def _reconcile(state: str, job: str | None, sacct: dict | None, live: dict | None, locked: bool = False) -> str:
    """The folder's state, corrected by what SLURM knows where the folder cannot record it (see the module doc)."""
    if state not in ("submitted", "running") or not job:
        return state
    if state == "running" and locked:  # a process holds the folder: running, whatever an earlier job says
        return state
    if sacct is not None and job in sacct:
        ended = sacct[job] not in queue.LIVE_STATES
        if state == "submitted":
            return f"not started (job {sacct[job]})" if ended else "queued"
        return f"stopped (job {sacct[job]})" if ended else state
    if live is not None:  # no accounting: squeue still says whether the job is there
        if state == "submitted":
            return "queued" if job in live else "not started (job gone)"
        return state if job in live else "stopped (job gone)"
    return state


def sweep_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The arguments that name a sweep's runs (sweep, --preset, --out-root), shared by slurm.status and slurm.stop."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep file or name (sweeps/delta.yaml or delta)")
    p.add_argument("--preset", help="the preset the sweep was submitted with (e.g. tiny)")
    p.add_argument("--out-root", help="root of the run folders (default results/runs)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = sweep_parser("python -m slurm.status", __doc__)
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
    cols = ("run_id", "state", "job", "sacct", "steps", "attempts", "in", "error")
    text = [[str(r[c] if r[c] is not None else "-") for c in cols] for r in table]
    widths = [max([len(c)] + [len(t[i]) for t in text]) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    for t in text:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip())
    counts = {}
    for r in table:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    print(f"{len(table)} runs: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    line = progress(table)
    if line:
        print(line)
    try:
        problems = queue.node_problems() if queue.available() else []
    except queue.QueueError:
        problems = []
    for p in problems:
        name = p.split()[0]
        print(f"SLURM node {p} (no job starts there; once fixed: scontrol update nodename={name} state=resume)")
    return 0


RECENT = 10
"""Finished runs whose pace gives the ETA."""


def progress(table: list[dict], now: float | None = None) -> str:
    """'progress: D/N done, R running, ETA ~M min (...)' while runs are going; '' when none is.

    ETA: the runs left at the pace of the last RECENT runs that finished (finish times within as many median run
    times of now, so runs of an earlier session do not count), which counts however many ran side by side; with
    fewer than 3 such runs, rounds of the median run time at the number running now."""
    done = sum(r["state"] == "done" for r in table)
    running = sum(r["state"] == "running" for r in table)
    stuck = sum(
        r["state"] in ("failed", "bad") or r["state"].startswith(("not started", "stopped", "held")) for r in table
    )
    if not running:
        return ""
    walls = [r["wall_s"] for r in table if r["wall_s"] is not None]
    text = f"progress: {done}/{len(table)} done, {running} running"
    if walls:
        median = statistics.median(walls)
        left = len(table) - done - stuck  # failed / stopped runs wait for a resubmission: not in the ETA
        now = time.time() if now is None else now
        ends = sorted(r["finished"] for r in table if r.get("finished") and now - r["finished"] < RECENT * median)
        ends = ends[-RECENT:]
        if len(ends) >= 3 and ends[-1] > ends[0]:
            pace = (ends[-1] - ends[0]) / (len(ends) - 1)  # seconds per finished run, lately
            text += f", ETA ~{left * pace / 60:.0f} min (one run finished every {pace:.0f} s lately)"
        else:
            text += f", ETA ~{math.ceil(left / running) * median / 60:.0f} min (median run {median:.0f} s)"
    return text


if __name__ == "__main__":
    sys.exit(main())
