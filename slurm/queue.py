"""What SLURM says about jobs: live ones from ``squeue``, final states from ``sacct`` (needs accounting), held jobs,
and nodes that start no job (``sinfo``).

Job ids are strings: ``"123"`` for a single job, ``"123_4"`` for task 4 of array 123 (as submitit and
``SLURM_ARRAY_JOB_ID``/``SLURM_ARRAY_TASK_ID`` give them). Pending array tasks are listed collapsed
(``123_[4-9%2]``) by both tools; :func:`expand_ids` opens them.
"""

from __future__ import annotations

import getpass
import re
import shutil
import subprocess

LIVE_STATES = frozenset(
    {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED", "CONFIGURING"}
    | {"COMPLETING", "STAGE_OUT", "SIGNALING", "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
)
"""States in which a job still owns its run (it runs, or will run again)."""
_RANGE = re.compile(r"^(\d+)_\[([0-9,\-]+)(?:%\d+)?\]$")


class QueueError(RuntimeError):
    """squeue/sacct could not be run or failed (no SLURM here, or accounting disabled)."""


def available() -> bool:
    return shutil.which("squeue") is not None


def expand_ids(job_id: str) -> list[str]:
    """``"7_[2-4,9%2]"`` -> ["7_2", "7_3", "7_4", "7_9"]; anything else is returned as a one-item list."""
    m = _RANGE.match(job_id)
    if not m:
        return [job_id]
    out = []
    for part in m.group(2).split(","):
        lo, _, hi = part.partition("-")
        out += [f"{m.group(1)}_{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def _run(cmd: list[str]) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise QueueError(f"{cmd[0]}: {e}") from None
    if p.returncode != 0:
        raise QueueError(f"{' '.join(cmd[:2])} ...: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def _parse(text: str) -> dict[str, str]:
    """``JobID|State`` lines -> {job id: state}, array ranges expanded, "CANCELLED by 0" -> "CANCELLED"."""
    out = {}
    for line in text.splitlines():
        if "|" not in line:
            continue
        jid, state = line.split("|", 1)
        for j in expand_ids(jid.strip()):
            out[j] = state.split()[0] if state.strip() else "UNKNOWN"
    return out


def live_jobs() -> dict[str, str]:
    """{job id: state} of this user's jobs that are still queued or running (``squeue``; no accounting needed)."""
    states = _parse(_run(["squeue", "-r", "-h", "-u", getpass.getuser(), "-o", "%i|%T"]))
    return {j: s for j, s in states.items() if s in LIVE_STATES}


def sacct_states(job_ids: list[str]) -> dict[str, str]:
    """{job id: state} from ``sacct`` for the given ids (whole arrays are queried once); raises QueueError."""
    bases = sorted({j.split("_")[0] for j in job_ids if j})
    if not bases:
        return {}
    return _parse(_run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(bases)]))


def _fields(text: str) -> list[tuple[str, str, str]]:
    """``a|b|c`` lines -> (a, b, c), the last field kept whole (a reason may hold anything), missing ones ""."""
    return [tuple((line.split("|", 2) + ["", ""])[:3]) for line in text.splitlines() if line.strip()]


def held_jobs() -> dict[str, str]:
    """{job id: reason} of this user's jobs that SLURM holds: they never start until released (``scontrol release
    JOB``). A user's or admin's hold (``JobHeldUser``, ``JobHeldAdmin``), or a job requeued after its launch failed
    (``launch failed requeued held``: the node could not start it, e.g. its disk was full)."""
    out = {}
    for jid, state, reason in _fields(
        _run(["squeue", "-r", "-h", "-u", getpass.getuser(), "-t", "PD,RH", "-o", "%i|%T|%r"])
    ):
        if state.strip() == "REQUEUE_HOLD" or "held" in reason.lower():
            for j in expand_ids(jid.strip()):
                out[j] = reason.strip() or state.strip()
    return out


NODE_PROBLEMS = ("down", "drain", "drained", "draining", "fail", "failing", "inval")
"""sinfo node states (flags such as ``*`` stripped) in which a node starts no new job."""


def node_problems() -> list[str]:
    """``"NODE STATE: reason"`` for each node that starts no new job (down, drained, failing ...), e.g.
    ``"vm drained: SlurmdSpoolDir is full"``; [] when every node takes jobs."""
    out = []
    for node, state, reason in _fields(_run(["sinfo", "-h", "-N", "-o", "%N|%T|%E"])):
        state = state.strip().rstrip("*~#!%$@^-+").lower()
        entry = f"{node.strip()} {state}: {reason.strip() or 'no reason given'}"
        if state in NODE_PROBLEMS and entry not in out:  # sinfo -N repeats a node once per partition
            out.append(entry)
    return out
