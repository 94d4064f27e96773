"""The run folder contract (design.md, "Run directory contract"), shared by both backends.

    results/runs/<sweep>/<run_id>/
        config.yaml     the resolved RunConfig + a ``meta`` section (git commit, package versions, run id)
        metrics.jsonl   one JSON object per RL step
        eval.jsonl      one JSON object per (step, benchmark, problem_id, decoding, sample)
        ratio_bins.jsonl  (tiny backend) per RL step, clipped and rescued token counts by depth into the rescue zone
        status.json     state running | done | failed | cancelled, timestamps, error; written atomically
        checkpoint.pt   resumable state (tiny backend), replaced atomically

Writes are crash-safe: status.json and checkpoints go through a temp file and ``os.replace``; log lines are
appended with a single ``write`` and flushed, and on resume the logs are cut back to the checkpoint's step, so a
resumed run ends with exactly the rows of an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import os
import platform
import socket
import subprocess
import time
import zlib
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from experiments.config import RunConfig

STATES = ("running", "done", "failed", "cancelled")
LOG_FILES = ("metrics.jsonl", "eval.jsonl", "ratio_bins.jsonl")
"""Step-indexed JSON-lines logs; ratio_bins.jsonl (optional) holds per-step clipped / rescued counts by ratio bin."""
COMPRESSED = tuple(f"{name}.gz" for name in LOG_FILES if name != "metrics.jsonl")
"""What a finished run gzips (metrics.jsonl stays plain: slurm.status and OpenRLHF's logger append to it)."""
REPO_ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = ("torch", "transformers", "openrlhf", "numpy", "datasets", "submitit", "vllm", "deepspeed", "ray")


class RunExistsError(RuntimeError):
    """The run folder holds a finished run (or another config) and ``force`` was not given."""


class RunLockedError(RuntimeError):
    """Another process holds this run folder."""


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path next to ``path`` to write; moved onto ``path`` when the block ends without error, and
    removed in any case, so readers see the old file or the whole new one, never a partial one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when the block failed or was interrupted mid-write


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def git_info() -> dict[str, Any]:
    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit or None, "git_dirty": dirty if commit else None}


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file (plain or .gz); a truncated last line (a crash mid-write) is dropped, a corrupt
    line before it raises ValueError (a resume must not silently lose rows)."""
    rows, problems = read_rows(path)
    corrupt = [msg for kind, msg in problems if kind == "corrupt_lines"]
    if corrupt:
        raise ValueError(f"{path}: {corrupt[0]}")
    return rows


def gunzip_partial(data: bytes) -> tuple[bytes, bool]:
    """Decompress gzip ``data`` (one or more members) as far as it goes: (bytes, whether the stream was complete).
    A file cut short (a crash while compressing, a partial copy) yields everything before the cut."""
    out = []
    while data:
        d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            out.append(d.decompress(data))
        except zlib.error:
            return b"".join(out), False
        if not d.eof:
            return b"".join(out), False
        data = d.unused_data
    return b"".join(out), True


def read_rows(path: Path) -> tuple[list[dict], list[tuple[str, str]]]:
    """Rows of a JSON-lines file (plain or .gz), never raising on bad content.

    Returns:
        (rows, problems); problems are (kind, message): ``truncated`` when the last line (or the gzip stream) is
        cut short, ``corrupt_lines`` when lines in the middle do not parse (they are skipped).
    """
    problems: list[tuple[str, str]] = []
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw, complete = gunzip_partial(raw)
        if not complete:
            problems.append(("truncated", "compressed stream cut short; kept the lines before the cut"))
    lines = raw.decode("utf-8", errors="replace").split("\n")
    rows, bad = [], []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            bad.append(i)
    last = len(lines) - 1 if lines[-1].strip() else len(lines) - 2
    if bad and bad[-1] == last:
        problems.append(("truncated", "last line cut short (a crash mid-write); dropped"))
        bad = bad[:-1]
    if bad:
        problems.append(("corrupt_lines", f"{len(bad)} unparsable line(s) skipped (first: line {bad[0] + 1})"))
    return rows, problems


class RunDir:
    """One run folder. All methods are safe to call again after a crash."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    # ------------------------------------------------------------ files
    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def status_path(self) -> Path:
        return self.path / "status.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def log_path(self, name: str) -> Path:
        """``name`` (e.g. eval.jsonl), or its .gz once the finished run compressed it."""
        gz = self.path / f"{name}.gz"
        return gz if gz.exists() else self.path / name

    @property
    def eval_path(self) -> Path:
        return self.log_path("eval.jsonl")

    @property
    def checkpoint_path(self) -> Path:
        return self.path / "checkpoint.pt"

    # ------------------------------------------------------------ status
    def status(self) -> dict | None:
        try:
            return json.loads(self.status_path.read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:  # cannot happen with atomic writes, but never crash a reader on it
            return {"state": "unknown"}

    def state(self) -> str | None:
        st = self.status()
        return None if st is None else st.get("state")

    def set_status(self, state: str, **extra) -> dict:
        if state not in STATES:
            raise ValueError(f"state={state!r} is not valid; allowed: {', '.join(STATES)}")
        now = time.time()
        st = self.status() or {}
        if state == "running":  # a new attempt: the previous attempt's error is history
            st.pop("error", None)
            st.pop("traceback", None)
        st.update(state=state, updated=now, host=socket.gethostname(), pid=os.getpid(), **extra)
        st.setdefault("created", now)
        if state == "running":
            st["started"] = now
            st["attempts"] = int(st.get("attempts", 0)) + 1
        else:
            st["finished"] = now
        for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
            if key in os.environ:
                st[key.lower()] = os.environ[key]
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.status_path, json.dumps(st, indent=1, sort_keys=True) + "\n")
        return st

    # ------------------------------------------------------------ config
    def write_config(self, cfg: RunConfig, run_id: str | None = None, **meta) -> None:
        data = cfg.to_dict()
        data["meta"] = {
            "run_id": run_id or self.path.name,
            "run_hash": cfg.run_hash(),
            **git_info(),
            "versions": package_versions(),
            **meta,
        }
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config_path, yaml.safe_dump(data, sort_keys=False))

    def config_hash(self) -> str | None:
        try:
            data = yaml.safe_load(self.config_path.read_text()) or {}
        except FileNotFoundError:
            return None
        return (data.get("meta") or {}).get("run_hash")

    # ------------------------------------------------------------ logs
    def append(self, name: str, rows: Iterable[dict]) -> None:
        """Append rows to ``name`` (metrics.jsonl or eval.jsonl), one ``write`` call, flushed."""
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)
        if text:
            with open(self.path / name, "a") as f:
                f.write(text)
                f.flush()

    def truncate_logs(self, last_step: int) -> None:
        """Drop log rows with step > ``last_step`` (written after the checkpoint a resume starts from).

        A compressed eval.jsonl.gz (a run that died after compressing) comes back as a plain eval.jsonl.
        """
        for name in LOG_FILES:
            path = self.path / name
            gz = path.with_name(name + ".gz")
            src = path if path.exists() else gz if gz.exists() else None
            if src is not None:
                keep = [r for r in read_jsonl(src) if r.get("step", -1) <= last_step]
                atomic_write_text(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in keep))
                gz.unlink(missing_ok=True)

    def reset_logs(self) -> None:
        for name in (*LOG_FILES, *COMPRESSED):
            (self.path / name).unlink(missing_ok=True)

    def compress_eval(self) -> None:
        """eval.jsonl and ratio_bins.jsonl -> .gz (readers accept both); done once a run is finished."""
        for name in COMPRESSED:
            src = self.path / name.removesuffix(".gz")
            if src.exists():
                with atomic_path(self.path / name) as tmp:
                    with open(src, "rb") as f, gzip.GzipFile(tmp, "wb", mtime=0) as g:
                        g.write(f.read())
                src.unlink()

    def clear(self) -> None:
        """Remove everything this contract writes (``--force``)."""
        for p in ("config.yaml", "status.json", *LOG_FILES, *COMPRESSED, "checkpoint.pt"):
            (self.path / p).unlink(missing_ok=True)

    # ------------------------------------------------------------ lock
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive use of the folder (an OS lock, released when the process dies)."""
        self.path.mkdir(parents=True, exist_ok=True)
        f = open(self.path / ".lock", "w")
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunLockedError(f"{self.path}: another process is running this run") from None
            yield
        finally:
            f.close()
