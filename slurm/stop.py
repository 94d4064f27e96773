"""Stop a sweep's running runs so that each resumes later without losing work.

    python -m slurm.stop regime_r0               # trl runs save at the end of the RL step under way, others stop now
    python -m slurm.stop regime_r0 --now         # every run stops now (SIGTERM): it resumes from its last checkpoint
    python -m slurm.stop regime_r0 --wait 900    # ... then wait until none runs (exit 1 if one still does)
    python -m slurm.stop regime_r0 --dry-run     # what would be sent; nothing is sent

Each run of the sweep, as ``python -m slurm.status`` sees its folder:
- running in a live SLURM job: ``scancel --signal=USR1 JOB`` where the attempt recorded that it saves on USR1
  (status.json ``save_signal``: the trl backend finishes its RL step, saves a checkpoint there and ends ``cancelled``;
  experiments/trl/train.py) and a process holds the folder (past its start-up); otherwise, a requeued job waiting
  to start again, or with ``--now``: ``scancel JOB`` (SIGTERM: ``cancelled`` at once; the rerun resumes from the last
  periodic checkpoint). ``scancel --signal`` reaches every process of the job's steps: the trl backend runs in one;
- running outside SLURM on this host (``experiments.run`` by hand, ``slurm.submit --cluster local``): the same signal
  to the process that status.json names, only while it holds the folder's lock (on Linux, /proc/locks must name
  that process: a new attempt holds the folder for a moment before it rewrites the record);
- queued (its job has not started the run), or cancelled / failed on record while its job is back in the queue (a
  requeued attempt, waiting or starting): ``scancel JOB``;
- anything else is left as it is; a run held on another host without a SLURM job is listed, not signalled, and so
  is a run whose config runs in another sweep's folder (a config runs once) unless ``--shared``.
Runs of one batched task share a job and a process: it is signalled once.
A stopped run resumes with ``python -m slurm.submit SWEEP`` or ``python -m experiments.run --sweep SWEEP --run ID``.

A run that a process holds while nothing is sent to it (another host, squeue unreadable, its folder held by another
process than the one on record) is named on stderr and makes the exit status 1.

Exit status: 0; 1 a run is left running (``--wait`` ran out, nothing could be sent to it, or a signal could not be
sent); 2 bad input.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time

from experiments.config import ConfigError
from experiments.rundir import RunDir
from slurm import queue
from slurm.status import rows, sweep_parser


def actions(
    table: list[dict], now: bool = False, live: dict[str, str] | None = None, shared: bool = False
) -> list[dict]:
    """What to send to each run of ``table`` (:func:`slurm.status.rows`): {run_id, how (scancel | kill | none),
    target (job id or pid), signal (USR1 | TERM | ""), why}. ``live``: SLURM's live jobs (None: squeue unreadable).
    ``shared``: also runs whose config runs in another sweep's folder (left alone by default). A target already
    signalled for an earlier run (the runs of one batched task share a job and a process) is not signalled again."""
    host = socket.gethostname()
    out, seen = [], set()
    for r in table:
        job, rd = r["job"], RunDir(r["folder"])
        st = rd.status() or {}
        locked = r["state"] == "running" and rd.locked()
        # USR1 only where the attempt records that it saves on it AND holds its folder now (past its start-up,
        # where the handler is installed): a process without the handler would die of USR1 without a word
        usr1 = not now and st.get("save_signal") == "USR1" and locked
        sig = "USR1" if usr1 else "TERM"
        state = "not started" if r["state"] == "-" else r["state"]
        act = {"run_id": r["run_id"], "how": "none", "target": "", "signal": "", "why": state}
        in_slurm = bool(job) and live is not None and job in live
        if r.get("in") and not shared:
            act.update(why=f"its config runs in {r['in']} (another sweep's folder): --shared stops it too")
        elif r["state"] == "running" and in_slurm:
            if live[job] != "RUNNING":  # requeued and waiting: nothing runs, nothing to save
                sig = "TERM"
            act.update(how="scancel", target=job, signal=sig, why=f"running in job {job} ({live[job]})")
        elif r["state"] == "running":
            if not locked:
                act.update(why="running on record, but no process holds its folder")
            elif job and live is None:
                act.update(why=f"running in job {job}, but squeue cannot be read here: scancel {job} where it can")
            elif st.get("host") != host or not st.get("pid"):
                act.update(why=f"running on {st.get('host')} outside SLURM: stop it there")
            elif (holder := rd.holder_pid()) is not None and holder != st["pid"]:  # a new attempt, an old record
                act.update(why=f"its folder is held by process {holder}, not {st['pid']} on record (an attempt "
                           "starting): run this again in a moment")  # fmt: skip
            else:
                act.update(how="kill", target=str(st["pid"]), signal=sig, why=f"running here, process {st['pid']}")
        elif r["state"] in ("queued", "submitted") and in_slurm:
            act.update(how="scancel", target=job, signal="TERM", why=f"queued as job {job}, not started")
        elif r["state"] in ("cancelled", "failed") and in_slurm:  # a requeued attempt, waiting or starting
            why = f"{state} on record, but its job {job} is back ({live[job]}): a requeued attempt"
            act.update(how="scancel", target=job, signal="TERM", why=why)
        # a process runs it, nothing is sent to it, and it was not left alone on purpose (--shared)
        act["left_running"] = act["how"] == "none" and locked and not (r.get("in") and not shared)
        if act["how"] != "none":
            if (act["how"], act["target"]) in seen:
                act.update(how="none", target="", signal="", why=f"{act['why']}: signalled with an earlier run")
            else:
                seen.add((act["how"], act["target"]))
        out.append(act)
    return out


def send(act: dict) -> str | None:
    """Send one action; an error message, or None."""
    if act["how"] == "scancel":
        cmd = ["scancel", *([f"--signal={act['signal']}"] if act["signal"] == "USR1" else []), act["target"]]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        return None if p.returncode == 0 else (p.stderr.strip() or f"{' '.join(cmd)}: exit {p.returncode}")
    if act["how"] == "kill":
        try:
            os.kill(int(act["target"]), getattr(signal, f"SIG{act['signal']}"))
        except OSError as e:
            return f"process {act['target']}: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = sweep_parser("python -m slurm.stop", __doc__)
    p.add_argument("--now", action="store_true", help="SIGTERM for every run: stop at once, resume from a checkpoint")
    p.add_argument("--wait", type=float, default=0, metavar="SECONDS", help="wait this long for the runs to stop")
    p.add_argument("--dry-run", action="store_true", help="print what would be sent, send nothing")
    p.add_argument("--shared", action="store_true", help="also runs whose config runs in another sweep's folder")
    args = p.parse_args(argv)
    if not math.isfinite(args.wait) or args.wait < 0:
        print(f"error: --wait={args.wait} is not valid; allowed: seconds >= 0", file=sys.stderr)
        return 2
    try:
        table = rows(args.sweep, args.preset, args.out_root)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        live = queue.live_jobs()
    except queue.QueueError:
        live = None  # no SLURM here: only local processes can be reached
    todo = actions(table, now=args.now, live=live, shared=args.shared)
    failed = 0
    quiet = {}  # runs with nothing to send and nothing running: counted by state, not listed one by one
    for act in todo:
        if act["how"] == "none" and not act["why"].startswith("running") and not act["left_running"]:
            quiet[act["why"]] = quiet.get(act["why"], 0) + 1
            continue
        if act["how"] == "none":
            print(f"{act['run_id']}: nothing to send ({act['why']})")
            continue
        what = f"{act['how']} SIG{act['signal']} {act['target']}"
        error = None if args.dry_run else send(act)
        failed += error is not None
        print(
            f"{act['run_id']}: {'would send' if args.dry_run else 'sent'} {what} ({act['why']})"
            + (f": FAILED: {error}" if error else "")
        )
    if quiet:
        print("nothing to send to " + ", ".join(f"{n} {why}" for why, n in sorted(quiet.items())))
    left = [a["run_id"] for a in todo if a.get("left_running")]
    if left:  # the command did not stop them: a script that goes on after it must not think they stopped
        print(f"not stopped by this command, still running: {', '.join(left)}", file=sys.stderr)
    sent = {a["run_id"] for a in todo if a["how"] != "none"}
    if args.dry_run or not args.wait or not sent:
        return 1 if failed or left else 0
    end = time.time() + args.wait
    while True:
        going = [r for r in rows(args.sweep, args.preset, args.out_root) if r["run_id"] in sent and _going(r)]
        if not going or time.time() >= end:
            break
        time.sleep(10)  # each look runs sacct and probes the folders' locks
    for r in rows(args.sweep, args.preset, args.out_root):
        if r["run_id"] in sent:
            print(f"{r['run_id']}: {r['state']} after {r['steps']} steps")
    if going:
        print(f"still running after {args.wait:g} s: {', '.join(r['run_id'] for r in going)}", file=sys.stderr)
    return 1 if going or failed or left else 0


def _going(r: dict) -> bool:
    """Still running: on record, and its folder held by a process or its job live."""
    return r["state"] in ("running", "queued", "submitted") and (
        RunDir(r["folder"]).locked() or r["sacct"] in (queue.LIVE_STATES)
    )


if __name__ == "__main__":
    sys.exit(main())
