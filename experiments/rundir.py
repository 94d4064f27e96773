"""The run folder contract (docs/design.md, "Run directory contract"), shared by both backends.

    results/runs/<sweep>/<run_id>/
        config.yaml     the resolved RunConfig + a ``meta`` section (git commit, package versions, run id)
        metrics.jsonl   one JSON object per RL step
        eval.jsonl      one JSON object per (step, benchmark, problem_id, decoding, sample)
        ratio_bins.jsonl  (token level; nsr.PremiseMeter) per RL step, clipped / rescued tokens by depth into the zone
        status.json     state running | done | failed | cancelled, timestamps, error; written atomically
        checkpoint.pt   resumable state (tiny backend), replaced atomically

Writes are crash-safe: status.json and checkpoints go through a temp file and ``os.replace``; log lines are
appended with a single ``write``, flushed and fsynced (:func:`append_jsonl`, the one appender: a row is on disk
before the checkpoint that follows it), and on resume the logs are cut back to the checkpoint's step, so a resumed
run ends with exactly the rows of an uninterrupted one.

This module owns all run-folder I/O: the runs root (:data:`RUNS_ROOT`), the folder lock (:meth:`RunDir.lock`,
``filelock``; a soft lock file where the file system has no ``flock``), the status reader (:func:`read_status`,
never raises on bad content), the appender, and run identity by config hash (:func:`runs_by_hash`).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import os
import platform
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import filelock
import yaml

from experiments.config import IDENTITY_SCHEME, ConfigError, RunConfig, from_dict, scheme1_hash, split_meta
from experiments.yamlio import load_yaml

STATES = ("running", "done", "failed", "cancelled")
BAD = "bad"
"""The state :func:`read_status` gives a folder whose status.json cannot be read (binary, not an object, an
unknown state); its ``problem`` says why. Readers report such a folder and go on; nothing runs into it."""
LOG_FILES = ("metrics.jsonl", "eval.jsonl", "ratio_bins.jsonl")
"""Step-indexed JSON-lines logs; ratio_bins.jsonl (optional) holds per-step clipped / rescued counts by ratio bin."""
COMPRESSED = tuple(f"{name}.gz" for name in LOG_FILES if name != "metrics.jsonl")
"""What a finished run gzips (metrics.jsonl stays plain: slurm.status and OpenRLHF's logger append to it)."""
REPO_ROOT = Path(__file__).resolve().parents[1]
RUNS_ROOT = REPO_ROOT / "results" / "runs"
"""Default root of the run folders: ``RUNS_ROOT/<sweep>/<run_id>/``."""
CACHE_ENV = "NSR_CACHE_DIR"


def cache_dir() -> Path:
    """Where derived files are cached (warm starts, the toy OpenRLHF model, the analysis' parsed logs):
    ``$NSR_CACHE_DIR``, else ``cache/`` in the repo (git ignores it). Deleting it only costs recomputation."""
    return Path(os.environ.get(CACHE_ENV) or REPO_ROOT / "cache")


RECORD = "slurm.json"
"""Written by slurm.submit into a folder it sent a job for (job id, cluster, log folder)."""
_PACKAGES = ("torch", "transformers", "openrlhf", "numpy", "datasets", "submitit", "vllm", "deepspeed", "ray")


SLURM_VARS = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")
"""Recorded (lower-cased) in status.json by an attempt that runs inside a SLURM job."""


class RunFolderError(RuntimeError):
    """This folder cannot take this run: a file, not writable, not a run folder, or unreadable run files."""


class RunExistsError(RunFolderError):
    """The run folder holds a finished run (or another config) and ``force`` was not given."""


class RunLockedError(RunFolderError):
    """Another process holds this run folder."""


class Cancelled(BaseException):
    """The run was stopped from outside and can resume: raised in the main thread on SIGTERM (scancel), or by a
    backend that saved a checkpoint and stopped on request (the trl backend on SIGUSR1). ``experiments.run``
    records it as ``cancelled`` and exits 143."""


_NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK}
"""What flock raises where the file system does not support it (Lustre without -o flock: ENOSYS; some NFS: ENOLCK)."""
SOFT_LOCK_NOTE = (
    "{folder}: this file system does not support flock (e.g. Lustre mounted without -o flock); using a soft lock "
    "file {soft} instead. It works across nodes, but a process killed on another node leaves it behind: if no "
    "process runs this folder, remove it by hand."
)


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


def append_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """Append ``rows`` to a JSON-lines file: one ``write``, flushed and fsynced (the one fsync policy of every run
    log, so a row is on disk before the checkpoint written after it). Nothing is written for no rows."""
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)
    if text:
        with open(path, "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def read_status(path: Path) -> dict | None:
    """A run folder's status.json (``path`` is the file): None if there is none; never raises on its content.

    A file that is binary, not JSON, not a JSON object, or has no valid ``state`` comes back as
    ``{"state": "bad", "problem": "<path>: why"}``, so one bad folder is reported, not a crash of the whole sweep.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return _bad(path, f"cannot read ({e.strerror or e})")
    try:
        st = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return _bad(path, f"not JSON ({type(e).__name__}: {e})")
    if not isinstance(st, dict):
        return _bad(path, f"not a JSON object (a {type(st).__name__})")
    if st.get("state") not in STATES:
        return _bad(path, f"state={st.get('state')!r}; allowed: {', '.join(STATES)}")
    return st


def _bad(path: Path, why: str) -> dict:
    return {"state": BAD, "problem": f"{path}: {why}"}


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


class StoredIdentity(NamedTuple):
    run_hash: str
    """The identity: recomputed from the stored config by today's code, else the recorded one."""
    recomputed: str | None
    """Today's :meth:`RunConfig.run_hash` of the stored config (None: today's RunConfig cannot read it)."""
    legacy: bool
    """The recorded hash is not what the code that wrote the folder would record for this config today: the run was
    made by older code (a field added or changed since), under identity scheme 1 or 2."""


def stored_identity(data: dict, source: str | Path = "config.yaml") -> StoredIdentity:
    """Identity of a run folder's config.yaml mapping (``meta`` included). RunFolderError if it has neither a config
    today's RunConfig reads nor a recorded ``meta.run_hash``.

    Lookups use the recomputed identity, so a folder keeps counting when the identity rule changes (its name keeps
    the suffix it was made with). ``legacy`` compares the recorded hash with what its own scheme
    (``meta.identity``, 1 when absent) gives for the stored config today.
    """
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    recorded = meta.get("run_hash") if isinstance(meta.get("run_hash"), str) and meta.get("run_hash") else None
    body, _ = split_meta(data)
    try:
        cfg = from_dict(body)
    except (ConfigError, TypeError, ValueError):
        if recorded is None:
            raise RunFolderError(f"{source}: no meta.run_hash and not a valid config") from None
        return StoredIdentity(recorded, None, False)
    recomputed = cfg.run_hash()
    scheme = meta.get("identity", 1)
    expected = recomputed if scheme == IDENTITY_SCHEME else scheme1_hash(cfg) if scheme == 1 else None
    return StoredIdentity(recomputed, recomputed, recorded is not None and recorded != expected)


def thread_counts(st: dict | None) -> list[int]:
    """The torch thread counts (NSR_THREADS) a run's attempts recorded in status.json: ``thread_counts``, or the one
    ``threads`` of a folder written before that list existed. Sorted; empty if none was recorded."""
    st = st or {}
    return sorted(set(st.get("thread_counts") or ([st["threads"]] if st.get("threads") else [])))


class RunDir:
    """One run folder. All methods are safe to call again after a crash."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.curves = None
        """A live-curves writer (experiments.curves.Curves) that :meth:`append` also hands every row to, or None."""

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
        """status.json (None if absent); state ``bad`` with a ``problem`` if it cannot be read (:func:`read_status`)."""
        return read_status(self.status_path)

    def state(self) -> str | None:
        st = self.status()
        return None if st is None else st.get("state")

    def set_status(self, state: str, **extra) -> dict:
        if state not in STATES:
            raise ValueError(f"state={state!r} is not valid; allowed: {', '.join(STATES)}")
        now = time.time()
        st = self.status() or {}
        if st.get("state") == BAD:  # unreadable history is not carried over
            st = {}
        if state == "running":  # a new attempt: the previous attempt's error and SLURM job are history
            counts = set(thread_counts(st))
            for key in ("error", "traceback", "save_signal", "threads", *(k.lower() for k in SLURM_VARS)):
                st.pop(key, None)
            if extra.get("threads"):  # every attempt's count: a run resumed at another count is no one-count rerun
                st["thread_counts"] = sorted(counts | {extra["threads"]})
        st.update(state=state, updated=now, host=socket.gethostname(), pid=os.getpid(), **extra)
        st.setdefault("created", now)
        if state == "running":
            st["started"] = now
            st["attempts"] = int(st.get("attempts", 0)) + 1
        else:
            st["finished"] = now
        for key in SLURM_VARS:  # the attempt's own job, if it runs in one
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
            "identity": IDENTITY_SCHEME,
            **git_info(),
            "versions": package_versions(),
            **meta,
        }
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config_path, yaml.safe_dump(data, sort_keys=False))

    def update_meta(self, **entries) -> None:
        """Set ``meta`` entries of config.yaml (what a backend learns once it runs, e.g. the warm start's hash);
        written atomically. RunFolderError if there is no config.yaml."""
        data = self.read_config()
        if data is None:
            raise RunFolderError(f"{self.config_path}: no config.yaml to record {', '.join(entries)} in")
        meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
        data["meta"] = {**meta, **entries}
        atomic_write_text(self.config_path, yaml.safe_dump(data, sort_keys=False))

    def read_config(self) -> dict | None:
        """config.yaml as a mapping (None if there is none); RunFolderError if it cannot be read."""
        if not self.config_path.exists():
            return None
        try:
            data = load_yaml(self.config_path)
        except ConfigError as e:
            raise RunFolderError(str(e)) from None
        if not isinstance(data, dict):
            raise RunFolderError(f"{self.config_path}: not a mapping (a {type(data).__name__})")
        return data

    def config_hash(self) -> str | None:
        """The run's identity (:meth:`RunConfig.run_hash`), recomputed from config.yaml by today's code (the recorded
        ``meta.run_hash`` where today's RunConfig cannot read the config); None without config.yaml. RunFolderError if
        the file cannot be read or records no hash (not written by experiments.run)."""
        data = self.read_config()
        if data is None:
            return None
        meta = data.get("meta")
        if not isinstance(meta, dict) or not isinstance(meta.get("run_hash"), str) or not meta["run_hash"]:
            raise RunFolderError(f"{self.config_path}: no meta.run_hash (not written by experiments.run)")
        return stored_identity(data, self.config_path).run_hash

    # ------------------------------------------------------------ logs
    def append(self, name: str, rows: Iterable[dict]) -> None:
        """Append rows to log ``name`` (metrics.jsonl, eval.jsonl, ratio_bins.jsonl) with :func:`append_jsonl`; then
        to the live curves, if the run has them (``logging.report_to``)."""
        rows = list(rows)
        append_jsonl(self.path / name, rows)
        if self.curves is not None:
            self.curves.rows(name, rows)

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
    @property
    def lock_path(self) -> Path:
        return self.path / ".lock"

    @property
    def soft_lock_path(self) -> Path:
        """The lock file used where flock is not supported (exists only while a process holds the folder)."""
        return self.path / ".lock.soft"

    @contextlib.contextmanager
    def lock(self, wait: float = 1.0) -> Iterator[None]:
        """Exclusive use of the folder, created if needed; RunLockedError if another process holds it for ``wait``
        seconds (the default outlasts :meth:`locked`'s momentary probe, so a run starting just then is not refused),
        RunFolderError if the folder or its lock file cannot be created (a read-only place, a file in the way).

        An OS lock (``filelock``, flock: released when the process dies). Where the file system has no flock
        (Lustre without ``-o flock``), a soft lock file :attr:`soft_lock_path` instead, with a note on stderr.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            lock = filelock.FileLock(self.lock_path, timeout=wait, fallback_to_soft=False)
            lock.acquire()
        except filelock.Timeout:
            raise RunLockedError(f"{self.path}: another process is running this run") from None
        except OSError as e:
            if e.errno not in _NO_FLOCK:  # a read-only place, a file where a folder should be
                raise RunFolderError(f"{self.path}: cannot write the run folder here ({e.strerror or e})") from None
            print(SOFT_LOCK_NOTE.format(folder=self.path, soft=self.soft_lock_path), file=sys.stderr)
            lock = filelock.SoftFileLock(self.soft_lock_path, timeout=wait)
            try:
                lock.acquire()
            except filelock.Timeout:
                raise RunLockedError(
                    f"{self.path}: another process is running this run (soft lock {self.soft_lock_path}; "
                    "if none is, remove that file)"
                ) from None
        try:
            yield
        finally:
            lock.release()

    def locked(self) -> bool:
        """True if a process holds the folder's lock now (:meth:`lock`); never creates the folder."""
        if not self.path.is_dir():
            return False
        if self.soft_lock_path.exists():
            return True
        if not self.lock_path.exists():
            return False
        probe = filelock.FileLock(self.lock_path, timeout=0, fallback_to_soft=False)
        try:  # a probe of the OS lock only, held for an instant; where flock is missing, only the soft lock file
            probe.acquire()  # counts (a probe must never take it: a run starting just then would be refused)
        except filelock.Timeout:
            return True
        except OSError:  # no flock here, or the lock cannot even be opened (a read-only copy): nobody runs it now
            return False
        probe.release()
        return False

    def holder_pid(self) -> int | None:
        """The process holding the folder's OS lock on this host, from /proc/locks; None if none does or it cannot
        be told (not Linux, a soft lock, a lock held on another host). A process named in status.json is the run's
        only if it is this one: a new attempt holds the folder for a moment before it rewrites its status."""
        try:
            st = os.stat(self.lock_path)
            text = Path("/proc/locks").read_text()
        except OSError:
            return None
        where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in text.splitlines():  # "1: FLOCK  ADVISORY  WRITE 1234 00:2e:5678 0 EOF"
            parts = line.split()
            if "->" not in parts and len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == where:
                return int(parts[4])
        return None

    # ------------------------------------------------------------ SLURM
    def job_record(self) -> dict:
        """slurm.json (written by slurm.submit), {} if absent or unreadable."""
        try:
            rec = json.loads((self.path / RECORD).read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            return {}
        return rec if isinstance(rec, dict) else {}

    def job_id(self) -> str | None:
        """The SLURM job that owns the folder: from slurm.json, else from status.json's SLURM variables."""
        rec = self.job_record()
        if rec.get("cluster") == "slurm" and rec.get("job_id"):
            return str(rec["job_id"])
        st = self.status() or {}
        if st.get("slurm_array_job_id") and st.get("slurm_array_task_id"):
            return f"{st['slurm_array_job_id']}_{st['slurm_array_task_id']}"
        job = st.get("slurm_job_id")
        return str(job) if job else None


def runs_by_hash(root: str | Path = RUNS_ROOT, bad: list | None = None) -> dict[str, list[Path]]:
    """Run identity: {run hash: [run folders holding that config]} for every folder under ``root`` (at any depth: a
    sweep folder, a copy under ``backup/``) that has a config.yaml written by experiments.run; the hash is recomputed
    from each config.yaml (:meth:`RunDir.config_hash`).

    Folders are sorted by path. A config is one run however many folders hold it: the submitter skips a config done
    in any folder, and the analysis counts it once. Folders whose config.yaml cannot be read are left out and, if
    ``bad`` is a list, appended to it as (folder, problem).
    """
    out: dict[str, list[Path]] = {}
    root = Path(root)
    if not root.is_dir():
        return out
    for cfg in sorted(root.rglob("config.yaml")):
        rd = RunDir(cfg.parent)
        try:
            h = rd.config_hash()
        except RunFolderError as e:
            if bad is not None:
                bad.append((rd.path, str(e)))
            continue
        out.setdefault(h, []).append(rd.path)
    return out


def folders_of(index: dict[str, list[Path]], run_hash: str, exclude: str | Path | None = None) -> list[Path]:
    """The folders of ``index`` (from :func:`runs_by_hash`) that hold ``run_hash``, those of a done run first (else
    by path), ``exclude`` left out: where a config has run, or runs, besides its own folder."""
    ex = Path(exclude).resolve() if exclude is not None else None
    paths = [p for p in index.get(run_hash, []) if ex is None or p.resolve() != ex]
    return sorted(paths, key=lambda p: RunDir(p).state() != "done")
