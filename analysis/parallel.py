"""Worker processes for the analysis: make_all reads the run folders' logs and draws its figures on every core.

    from analysis.parallel import default_jobs, worker_pool
    with worker_pool(default_jobs()) as pool:      # jobs = 1: an inline pool, the work runs here, in order
        fut = pool.submit(fn, *args)               # fn and args must pickle (a module-level function)
        fut.result()

Workers come from a fork server (a fresh interpreter that imports the analysis once, then forks each worker), or are
spawned where there is none; never forked from the caller, which may hold threads (pyarrow's, torch's, a test
runner's) whose locks a forked child would inherit held. What a worker computes does not depend on which process
runs it, so ``--jobs 1`` and ``--jobs 8`` write byte-identical files (tests/test_analysis_make_all.py checks it).
As with any multiprocessing code, a script that starts a pool must guard its top level with
``if __name__ == "__main__":`` (the workers import the main module).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor

JOBS_ENV = "NSR_JOBS"
"""Environment variable: the default number of worker processes (make_all --jobs overrides it)."""
MAX_DEFAULT_JOBS = 8
"""The default never takes more than this many cores (memory: each worker holds one run's logs at a time, plus its
imports, about 0.3 GiB)."""


def default_jobs() -> int:
    """``$NSR_JOBS`` when set, else the cores this process may run on (at most :data:`MAX_DEFAULT_JOBS`)."""
    env = os.environ.get(JOBS_ENV)
    if env is not None and env.strip():
        return check_jobs(env, JOBS_ENV)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_JOBS, cores))


def check_jobs(value, name: str = "jobs") -> int:
    """``value`` as a number of worker processes; ValueError naming ``name`` and the allowed values otherwise."""
    try:
        jobs = int(str(value).strip())
    except ValueError:
        jobs = 0
    if jobs < 1 or str(value).strip() != str(jobs):
        raise ValueError(f"{name}={value!r} is not valid; allowed: an integer >= 1 (1 = no worker processes)")
    return jobs


class _Warmup:
    """Starts ``pool``'s workers in a thread: the first submit blocks while the fork server imports the analysis
    (seconds), and the caller can work meanwhile (:func:`ready` says when the workers take tasks)."""

    def __init__(self, pool: ProcessPoolExecutor):
        self._probe: Future | None = None
        self._thread = threading.Thread(target=self._start, args=(pool,), daemon=True)
        self._thread.start()

    def _start(self, pool: ProcessPoolExecutor) -> None:
        try:
            self._probe = pool.submit(os.getpid)
        except RuntimeError:  # shut down before it started
            pass

    def ready(self) -> bool:
        return self._probe is not None and self._probe.done()


def ready(pool: Executor) -> bool:
    """Whether ``pool`` runs tasks at once: an inline pool always; a worker pool once its first worker answered."""
    return getattr(pool, "ready", lambda: True)()


class InlinePool(Executor):
    """An executor that runs each task at once, in this process (``jobs = 1``): the same code path as the process
    pool, without its start-up cost; an exception is kept in the future, as a process pool does."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001  (delivered by fut.result(), like a worker's exception)
            fut.set_exception(e)
        return fut


PRELOAD = ("analysis.load", "analysis.figures", "analysis.claims", "analysis.regime", "analysis.tables")
"""What the fork server imports once, before it forks the workers: everything a task needs, and what
analysis.make_all imports (a worker of ``python -m analysis.make_all`` runs that module again as its main module: its
own code only, as its imports are loaded; preloading the module itself would make runpy warn in every worker)."""


def _context():
    """``forkserver`` where the platform has it (Linux): one fresh interpreter imports :data:`PRELOAD` once and forks
    each worker from that clean, single-threaded state; else ``spawn`` (each worker imports on its own)."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        return ctx
    return multiprocessing.get_context("spawn")


def prestart(argv: list[str]) -> None:
    """For a command line with a ``--jobs`` option, called before its own (slow) imports: start the fork server now,
    so that it imports :data:`PRELOAD` while the command imports the same (the workers are ready seconds sooner).
    Nothing when the command will not start workers (``--jobs 1``, ``$NSR_JOBS=1``, ``--help``) or the platform has
    no fork server; never raises (the command itself reports bad options)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--jobs")
    pre.add_argument("-h", "--help", action="store_true")
    try:
        known, _ = pre.parse_known_args(argv)
    except SystemExit:  # a malformed --jobs: the command's own parser says so
        return
    jobs = known.jobs if known.jobs is not None else os.environ.get(JOBS_ENV, "").strip() or None
    if known.help or (jobs is not None and jobs.strip() == "1"):
        return
    _context()
    from multiprocessing import forkserver

    forkserver.ensure_running()


@contextlib.contextmanager
def worker_pool(jobs: int = 1) -> Iterator[Executor]:
    """An executor with ``jobs`` worker processes (spawned), or an :class:`InlinePool` for ``jobs = 1``; shut down
    (waiting for its tasks) on exit, and its pending tasks cancelled when the block raises."""
    jobs = check_jobs(jobs)
    if jobs == 1:
        yield InlinePool()
        return
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=_context())
    warm = _Warmup(pool)
    pool.ready = warm.ready  # type: ignore[attr-defined]
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
