"""The submitit jobs: run one grid point into its run folder (:class:`RunJob`), or several compatible tiny grid points
in one batched process (:class:`BatchJob`); checkpointable, so requeue resumes them.

A job carries the resolved config (not the sweep file), so editing a sweep after submitting changes nothing that is
already queued. The run folder is the checkpoint: ``experiments.run.run`` resumes an unfinished folder of the same
config, so ``checkpoint()`` only has to resubmit the same job. SLURM events and what the folder then says:

- ``scancel``: SIGTERM -> ``experiments.run.Cancelled`` -> status ``cancelled`` (files are written atomically).
- ``scontrol requeue`` / node failure with requeue: same SIGTERM, then the job starts again and resumes.
- preemption or time limit: submitit's USR2 handler calls :meth:`RunJob.checkpoint`, requeues the job and exits;
  the folder is set to ``cancelled`` ("requeued") and the next start resumes it.
- an exception in the run: status ``failed`` with the traceback, and the job fails (submitit ``FailedJobError``).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Any

import submitit

REQUEUED = "requeued by submitit after preemption or time limit; the next start resumes this folder"


@dataclass
class RunJob:
    """Run ``config`` (RunConfig as a dict) into ``out``; called by submitit on each task of the allocation."""

    config: dict[str, Any]
    run_id: str
    out: str
    meta: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    """Environment defaults for the run (NSR_THREADS = the task's CPUs); variables already set win."""
    _requeued: bool = field(default=False, repr=False)

    def __call__(self) -> dict:
        from experiments.backends import BACKENDS
        from experiments.config import from_dict
        from experiments.run import run
        from experiments.rundir import RunDir, RunExistsError

        for key, value in self.env.items():
            os.environ.setdefault(key, value)
        cfg = from_dict(self.config, source=f"job {self.run_id}")
        rd = RunDir(self.out)

        def go() -> dict:
            try:
                return run(cfg, self.out, run_id=self.run_id, meta=self.meta, progress=False)
            except RunExistsError:
                if rd.state() == "done":  # finished by an earlier attempt of this job: nothing to do
                    return rd.status()
                raise
            except SystemExit:
                if self._requeued:  # submitit's USR2 handler exits after requeueing: not a failure
                    rd.set_status("cancelled", error=REQUEUED, traceback=None)
                raise

        if BACKENDS[cfg.backend].on_ray_cluster(cfg):
            from slurm.ray_cluster import on_ray_cluster

            return on_ray_cluster(go, done_file=os.path.join(self.out, ".ray_done"))
        return go()

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on USR2 (preemption, time limit): requeue the same job; the folder holds the state.

        submitit then runs ``scontrol requeue`` (SLURM sends SIGTERM at once) and exits: SIGTERM is ignored from here
        on, so it cannot interrupt the status writes of that orderly exit.
        """
        self._requeued = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return submitit.helpers.DelayedSubmission(RunJob(self.config, self.run_id, self.out, self.meta, self.env))


@dataclass
class BatchJob:
    """Run compatible tiny configs as one batched process (``experiments.run.run_batch``), ``configs[i]`` into
    ``outs[i]``: one SLURM task for several runs. Each folder keeps the run-folder contract: a run that is done is
    skipped, one that fails fails alone, and a requeued or restarted batch resumes every unfinished run."""

    configs: list[dict[str, Any]]
    run_ids: list[str]
    outs: list[str]
    metas: list[dict[str, Any]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    _requeued: bool = field(default=False, repr=False)

    def __call__(self) -> list[dict]:
        from experiments.config import from_dict
        from experiments.run import run_batch
        from experiments.rundir import RunDir, RunExistsError

        for key, value in self.env.items():
            os.environ.setdefault(key, value)
        cfgs = [from_dict(c, source=f"job {r}") for c, r in zip(self.configs, self.run_ids)]
        rds = [RunDir(o) for o in self.outs]
        try:
            return run_batch(cfgs, self.outs, run_ids=self.run_ids, metas=self.metas or None, progress=False)
        except RunExistsError:
            if all(rd.state() == "done" for rd in rds):  # finished by an earlier attempt of this job
                return [rd.status() for rd in rds]
            raise
        except SystemExit:
            if self._requeued:  # submitit's USR2 handler exits after requeueing: not a failure
                for rd in rds:
                    if rd.state() in ("running", "cancelled"):
                        rd.set_status("cancelled", error=REQUEUED, traceback=None)
            raise

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        """As :meth:`RunJob.checkpoint`: requeue the same batch; the folders hold the state."""
        self._requeued = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return submitit.helpers.DelayedSubmission(BatchJob(self.configs, self.run_ids, self.outs, self.metas, self.env))
