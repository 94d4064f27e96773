"""Submit a sweep: one submitit job array per preset, each task runs one grid point into its run folder.

    python -m slurm.submit sweeps/delta.yaml --dry-run                 # list runs, their overrides and the plan
    python -m slurm.submit delta                                       # the whole grid on the sweep's preset
    python -m slurm.submit delta --preset tiny --max-parallel 2        # the CPU testbed version, 2 at a time
    python -m slurm.submit delta --only nsr-delta0.2-s0-4e647725       # rerun one (see --dry-run for ids)
    python -m slurm.submit delta --preset tiny --only nsr-delta0.2-s0-ff416816   # the same grid point on tiny
    python -m slurm.submit delta --preset tiny-smoke --cluster local   # no SLURM: local processes, waits
    python -m slurm.status delta                                       # where each run is

A run id is ``<arm>-s<seed>-<8 hex of the run's config hash>``; the preset is part of the config, so one grid point
has an id per preset (above: delta's nsr-delta0.2-s0 on its own preset and with --preset tiny): take ids from a
--dry-run with the same --preset. Folders made under an older identity scheme keep their names, and those ids still
resolve (docs/design.md, "Run identity").

Every run of the sweep is expanded and validated (experiments.sweep.expand) and the site file is checked before anything
is submitted. Run folders (results/runs/<sweep>/<run_id>, or --out-root) decide what is sent:
done -> skipped; failed -> skipped unless --retry-failed; a run whose recorded job is still queued or running ->
skipped; a folder whose status.json or config.yaml cannot be read -> skipped and reported (the rest of the sweep
goes on); anything else (new, cancelled, a ``running`` folder whose job is gone) -> submitted, and it resumes from
its folder. A config runs once: one that is done, or queued / running, in another folder under the root (another
sweep with the same config) is skipped, and the line says where it is. Each submitted folder gets ``slurm.json``
(job id, cluster, log folder) so the next submission and
``slurm.status`` know which job owns it. Resources per preset come from slurm/cluster.yaml (--site). Jobs are
checkpointable: on preemption or time limit submitit requeues them and they resume (slurm/jobs.py).
A preset may carry its own resources (``preset: {slurm: {cpus_per_task, mem_gb, time_min, gpus_per_node}}``, its
measured needs); the site file's entry for the preset overrides them, its ``default`` does not (:func:`resources`). A
CPU run (``openrlhf.cpu``, or any backend but openrlhf) requests no GPU unless the site file asks for one.
``--cluster local`` runs the jobs as local processes (at most --max-parallel at once) and ``debug`` in this process;
both wait for the results. Logs: logs/submitit/<sweep>/ (--log-dir).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.backends import BACKENDS
from experiments.config import ConfigError
from experiments.run import preflight
from experiments.rundir import (
    BAD,
    RECORD,
    REPO_ROOT,
    RUNS_ROOT,
    RunDir,
    RunFolderError,
    atomic_write_text,
    folders_of,
    runs_by_hash,
)
from experiments.sweep import RunSpec, SweepError, check_ready, expand, load_sweep, sweep_path
from experiments.yamlio import load_yaml
from slurm import queue
from slurm.jobs import BatchJob, RunJob

LOG_ROOT = REPO_ROOT / "logs" / "submitit"
SITE_FILE = Path(__file__).resolve().parent / "cluster.yaml"
CLUSTERS = ("slurm", "local", "debug")
SITE_KEYS = {
    "partition": (str, type(None)),
    "account": (str, type(None)),
    "qos": (str, type(None)),
    "constraint": (str, type(None)),
    "nodes": int,
    "gpus_per_node": int,
    "cpus_per_task": int,
    "mem_gb": (int, float),
    "time_min": int,
    "setup": list,
    "array_parallelism": int,
}
_MINIMUM = {"nodes": 1, "gpus_per_node": 0, "cpus_per_task": 1, "mem_gb": 0.1, "time_min": 2, "array_parallelism": 1}
PRESET_KEYS = ("cpus_per_task", "mem_gb", "time_min", "gpus_per_node")
"""Keys of a preset's own ``preset: {slurm: {...}}`` (what the run needs; where it runs is the site file's)."""
BUILTIN = {"nodes": 1, "gpus_per_node": 0, "cpus_per_task": 1, "mem_gb": 2, "time_min": 60, "setup": []}


# ---------------------------------------------------------------- site file
def load_site(path: str | Path | None = None) -> dict[str, Any]:
    """{"default": {...}, "presets": {name: {...}}} from slurm/cluster.yaml (or ``path`` / $NSR_SLURM_SITE)."""
    path = Path(path or os.environ.get("NSR_SLURM_SITE") or SITE_FILE)
    if not path.exists():
        raise ConfigError(f"{path}: no such site file (slurm/cluster.yaml)")
    data = load_yaml(path)  # duplicate keys refused
    if data is None:
        raise ConfigError(f"{path}: empty site file; allowed: `default` and `presets` sections (slurm/cluster.yaml)")
    if not isinstance(data, dict) or set(data) - {"default", "presets"}:
        raise ConfigError(f"{path}: top-level keys allowed: default, presets")
    presets = data.get("presets") or {}
    if not isinstance(presets, dict):
        raise ConfigError(f"{path}: presets must be a mapping {{preset name: settings}}")
    for where, entry in [("default", data.get("default") or {})] + [(f"presets.{k}", v) for k, v in presets.items()]:
        _check_site_entry(path, where, entry)
    return {"path": path, "default": data.get("default") or {}, "presets": presets}


def _check_site_entry(path: Path, where: str, entry, keys=tuple(SITE_KEYS)) -> None:
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: {where} must be a mapping; allowed keys: {', '.join(keys)}")
    for k, v in entry.items():
        if k not in keys:
            raise ConfigError(f"{path}: {where}: unknown key {k!r}; allowed: {', '.join(keys)}")
        ok = isinstance(v, SITE_KEYS[k]) and not isinstance(v, bool)
        if ok and k in _MINIMUM:
            ok = v >= _MINIMUM[k]
        if ok and k == "setup":
            ok = all(isinstance(line, str) for line in v)
        if not ok:
            allowed = "a list of shell lines" if k == "setup" else f">= {_MINIMUM[k]}" if k in _MINIMUM else "a string"
            raise ConfigError(f"{path}: {where}.{k}={v!r} is not valid; allowed: {allowed}")


def preset_resources(spec: RunSpec) -> dict[str, Any]:
    """The preset's own ``preset.slurm`` of ``spec`` (:data:`PRESET_KEYS`), checked; ConfigError naming the file."""
    _check_site_entry(spec.preset_path or Path("preset"), "preset.slurm", spec.slurm, PRESET_KEYS)
    return dict(spec.slurm)


def resources(site: dict, preset: str, spec: RunSpec) -> dict[str, Any]:
    """The resources of one run of ``preset``, later ones winning: :data:`BUILTIN`, the site's ``default``, the
    preset's own ``preset.slurm`` (its measured needs), the site's entry for the preset, then for the openrlhf backend
    the config's nodes and GPUs per node (none for a CPU run, ``openrlhf.cpu``)."""
    own = preset_resources(spec)
    res = dict(BUILTIN)
    res.update(site["default"])
    res.update(own)
    res.update(site["presets"].get(preset, {}))
    cfg = spec.config
    fixed = BACKENDS[cfg.backend].fixed_resources  # openrlhf: nodes, and GPUs per node (none for openrlhf.cpu)
    for key, want in (fixed(cfg) if fixed else {}).items():
        given = site["presets"].get(preset, {}).get(key, own.get(key, site["default"].get(key)))
        if given is not None and given != want:
            cpu = key == "gpus_per_node" and cfg.backend == "openrlhf" and cfg.openrlhf.cpu
            has = "is a CPU run (openrlhf.cpu=true)" if cpu else f"has {cfg.backend}.{key}={want}"
            raise ConfigError(
                f"{site['path']}: {key}={given} for preset {preset!r}, but its config {has}; allowed: {want} "
                f"(or leave {key} out of the site file and of the preset's preset.slurm)"
            )
        res[key] = want
    return res


# ---------------------------------------------------------------- plan
@dataclass
class Decision:
    spec: RunSpec
    out: Path
    submit: bool
    reason: str


def _busy_elsewhere(spec: RunSpec, folder: Path, index: dict, live: dict[str, str] | None) -> str | None:
    """Why ``spec`` need not run: its config is done, or queued / running, in another folder (None if not)."""
    others = folders_of(index, spec.config.run_hash(), exclude=folder)
    if others and RunDir(others[0]).state() == "done":
        return f"done in {others[0]} (the same config)"
    for p in others:
        job = RunDir(p).job_id()
        if job and live is not None and job in live:
            return f"job {job} is {live[job]} in {p} (the same config)"
        if RunDir(p).locked():
            return f"running in {p} (the same config; its folder is locked)"
    return None


def plan(specs: list[RunSpec], out_root: Path, retry_failed: bool, live: dict[str, str] | None) -> list[Decision]:
    """What to do with each run. ``live`` = {job id: state} of queued/running jobs (None: not known).

    Never raises on a folder's content: a folder whose files cannot be read is skipped with the reason.
    """
    out = []
    index = runs_by_hash(out_root)
    for spec in specs:
        folder = out_root / spec.sweep / spec.run_id
        rd = RunDir(folder)
        st = rd.status() or {}
        state = st.get("state")
        try:
            rd.config_hash()
            bad = st.get("problem") if state == BAD else None
        except RunFolderError as e:
            bad = str(e)
        job = rd.job_id()
        elsewhere = None if state == "done" or bad else _busy_elsewhere(spec, folder, index, live)
        if state == "done":
            out.append(Decision(spec, folder, False, "done"))
        elif bad:
            out.append(Decision(spec, folder, False, f"bad folder, not touched: {bad}"))
        elif elsewhere:
            out.append(Decision(spec, folder, False, elsewhere))
        elif state == "failed" and not retry_failed:
            out.append(Decision(spec, folder, False, "failed (--retry-failed reruns it)"))
        elif job and live is not None and job in live:
            out.append(Decision(spec, folder, False, f"job {job} is {live[job]}"))
        elif rd.locked():
            out.append(Decision(spec, folder, False, "running here (its folder is locked)"))
        elif state is None and not job:
            out.append(Decision(spec, folder, True, "new"))
        elif state is None:
            out.append(Decision(spec, folder, True, f"job {job} left the queue before starting"))
        elif state == "failed":
            out.append(Decision(spec, folder, True, "failed, retrying"))
        else:
            gone = f", job {job} gone" if job else ""
            out.append(Decision(spec, folder, True, f"{state}{gone}: resumes"))
    return out


# ---------------------------------------------------------------- submission
@dataclass
class Refusal:
    """Why the real submit would refuse (a dry run's finding): ``why`` for the runs ``run_ids``, and ``fix``."""

    why: str
    run_ids: list[str]
    fix: str
    per_run: dict[str, str] = field(default_factory=dict)
    """{run id: why this run} where it says more than ``why``."""


@dataclass
class Submission:
    sweep: str
    decisions: list[Decision]
    jobs: list = field(default_factory=list)
    """submitit Jobs, one per task (a task runs one run, or a batch of compatible tiny runs)."""
    tasks: int = 0
    arrays: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plans: list = field(default_factory=list)
    """experiments.openrlhf.plan.RunPlan of every openrlhf run to submit (all of them in a dry run)."""
    resources: dict[str, dict] = field(default_factory=dict)
    """{preset: the resources each of its tasks requests} (:func:`resources`; a batch of tiny runs asks for more
    time)."""
    refusals: list[Refusal] = field(default_factory=list)
    """A dry run: what the real submit would refuse (it then submits nothing), each with the command that fixes it."""

    @property
    def submitted(self) -> list[Decision]:
        return [d for d in self.decisions if d.submit]


def _params(res: dict, name: str, max_parallel: int | None) -> dict[str, Any]:
    setup = list(res.get("setup", []))  # the job's python is this one, which has the repo installed (pip install -e .)
    params = {
        "name": name,
        "timeout_min": res["time_min"],
        "nodes": res["nodes"],
        "tasks_per_node": 1,
        "cpus_per_task": res["cpus_per_task"],
        "mem_gb": res["mem_gb"],
        "slurm_setup": setup,
        "slurm_array_parallelism": max_parallel or res.get("array_parallelism") or 256,
    }
    if res["gpus_per_node"]:
        params["gpus_per_node"] = res["gpus_per_node"]
    for key in ("partition", "account", "qos", "constraint"):
        if res.get(key):
            params[f"slurm_{key}"] = res[key]
    return params


def _job(task: list[Decision], res: dict, batched: bool) -> RunJob | BatchJob:
    """The submitit callable of one task: a BatchJob when ``batched`` (the batched trainer, also for a task of one
    run, so a sweep's runs come from one engine), else a RunJob."""
    env = {"NSR_THREADS": str(res["cpus_per_task"])}
    if not batched:
        (d,) = task
        return RunJob(d.spec.config.to_dict(), d.spec.run_id, str(d.out), dict(d.spec.meta), env)
    return BatchJob(
        [d.spec.config.to_dict() for d in task],
        [d.spec.run_id for d in task],
        [str(d.out) for d in task],
        [dict(d.spec.meta) for d in task],
        env,
    )


def batched(task: list[Decision], batch_size: int) -> bool:
    """Whether ``task`` runs on its backend's batched trainer: its backend packs runs and ``batch_size`` > 1."""
    return batch_size > 1 and BACKENDS[task[0].spec.config.backend].batch_key is not None


def pack(decisions: list[Decision], batch_size: int) -> list[list[Decision]]:
    """The tasks to submit: runs whose backend packs runs (its ``batch_key``, experiments/backends.py; the tiny
    backend's: model, task, rollout, steps, updates, eval) that can share a batch (same preset and key) in as few
    tasks of at most ``batch_size`` as they need, sized evenly (9 runs in tasks of 8: 5 + 4, not 8 + 1), in order of
    their first run; every other run alone. Every task of a packing backend runs on its batched trainer
    (:func:`batched`), a task of one run too, so a sweep's arms come from one engine (docs/testbed.md, "Batched
    testbed"). A batch is an execution detail (its float64 check: tests/test_batched.py), not part of a run's
    identity."""
    slots: list[list[Decision] | tuple] = []
    groups: dict[tuple, list[Decision]] = {}
    for d in decisions:
        cfg = d.spec.config
        batch_key = BACKENDS[cfg.backend].batch_key
        if batch_size <= 1 or batch_key is None:
            slots.append([d])
            continue
        key = (d.spec.meta["preset"], cfg.backend, batch_key(cfg))
        if key not in groups:
            groups[key] = []
            slots.append(key)
        groups[key].append(d)
    tasks: list[list[Decision]] = []
    for slot in slots:
        if isinstance(slot, list):
            tasks.append(slot)
            continue
        group = groups[slot]
        n_tasks = -(-len(group) // batch_size)
        size, extra = divmod(len(group), n_tasks)
        start = 0
        for i in range(n_tasks):
            end = start + size + (1 if i < extra else 0)
            tasks.append(group[start:end])
            start = end
    return tasks


def _record(d: Decision, job, cluster: str, log_dir: Path) -> None:
    """slurm.json (which job owns the folder), and config.yaml if the folder has none yet, so the config's identity
    (its hash) is known from submission on: another sweep's submitter sees it queued (a config runs once)."""
    d.out.mkdir(parents=True, exist_ok=True)
    rd = RunDir(d.out)
    if not rd.config_path.exists():
        rd.write_config(d.spec.config, run_id=d.spec.run_id, **d.spec.meta)
    rec = {"job_id": str(job.job_id), "cluster": cluster, "submitted": time.time(), "log_dir": str(log_dir)}
    atomic_write_text(d.out / RECORD, json.dumps(rec, indent=1) + "\n")


def check_runs(specs: list[RunSpec], source: str | Path = "") -> None:
    """Every check each run makes at its start (experiments.run.preflight: for the cluster, the argv builder and the
    launcher's own checks), on every run, before any job exists. ConfigError naming each run that would fail."""
    bad = []
    for s in specs:
        try:
            preflight(s.config)
        except ConfigError as e:
            bad.append(f"{s.run_id}: {e}")
    if bad:
        shown = "\n  ".join(bad[:5]) + (f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ConfigError(
            f"{source}: {len(bad)} of {len(specs)} runs would fail at their start; nothing was submitted:\n  {shown}"
        )


def submit(
    sweep: str | Path,
    *,
    preset: str | None = None,
    cluster: str = "slurm",
    only: list[str] | None = None,
    dry_run: bool = False,
    retry_failed: bool = False,
    max_parallel: int | None = None,
    out_root: str | Path | None = None,
    log_dir: str | Path | None = None,
    site: str | Path | None = None,
    presets_dir: str | Path | None = None,
    batch_size: int = 8,
) -> Submission:
    """Expand, validate, plan and (unless ``dry_run``) submit a sweep. Raises ConfigError before submitting anything.

    With ``cluster`` local or debug this waits for the jobs; with slurm it returns once they are queued. Runs of the
    tiny backend that can share a batch go to one task, at most ``batch_size`` of them (:func:`pack`; 1 = a task per
    run).
    """
    if cluster not in CLUSTERS:
        raise ConfigError(f"cluster={cluster!r} is not valid; allowed: {', '.join(CLUSTERS)}")
    if max_parallel is not None and max_parallel < 1:
        raise ConfigError(f"max_parallel={max_parallel} is not valid; allowed: >= 1")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} is not valid; allowed: an integer >= 1 (1: a task per run)")
    sw = load_sweep(sweep)
    specs = expand(sw, preset=preset, presets_dir=Path(presets_dir) if presets_dir else None)
    template = None
    try:
        check_ready(sw)
    except SweepError as e:
        if not dry_run:
            raise
        template = str(e)
    if only:
        ids = {s.run_id for s in specs}
        missing = [r for r in only if r not in ids]
        if missing:
            where = f" with --preset {preset}" if preset else ""
            raise SweepError(
                f"{sweep_path(sweep)}: --only {missing[0]!r} is not a run of this sweep{where}; "
                f"list them with: python -m slurm.submit {sweep} --dry-run{' --preset ' + preset if preset else ''}"
            )
        specs = [s for s in specs if s.run_id in set(only)]
    check_runs(specs, sw.path)
    site_cfg = load_site(site)
    groups: dict[str, list[RunSpec]] = {}
    for s in specs:
        groups.setdefault(s.meta["preset"], []).append(s)
    res_of = {p: resources(site_cfg, p, group[0]) for p, group in groups.items()}
    for p, group in groups.items():  # every run of a preset must fit the same allocation
        for s in group[1:]:
            if resources(site_cfg, p, s) != res_of[p]:
                raise ConfigError(f"{s.run_id}: needs other resources than the rest of preset {p!r} (nodes, GPUs)")

    live = None
    sub = Submission(specs[0].sweep if specs else Path(sweep).stem, [], resources=res_of)
    if cluster == "slurm" or queue.available():
        try:
            live = queue.live_jobs()
        except queue.QueueError as e:
            if cluster == "slurm" and not dry_run:
                raise
            need = (
                "; the real submit needs SLURM here (squeue, sbatch), or --cluster local" if cluster == "slurm" else ""
            )
            sub.notes.append(f"queue not checked ({e}){need}")
    root = Path(out_root) if out_root else RUNS_ROOT
    sub.decisions = plan(specs, root, retry_failed, live)
    sub.plans = _resource_plans(sub.decisions if dry_run else sub.submitted, res_of)
    logs = Path(log_dir) if log_dir else LOG_ROOT / sub.sweep
    if dry_run:
        sub.tasks = len(pack(sub.submitted, batch_size))  # what would be sent (pack keys include the preset)
        sub.refusals = _refusals(sub, template, logs)
        return sub
    if not sub.submitted:
        return sub
    short = _short_of_rows(sub)
    if short:  # refused here, not inside a GPU allocation
        raise ConfigError(f"{short.why}; nothing was submitted; fix: {short.fix} (docs/cluster.md)")

    import submitit

    for folder in sorted({d.out.parent for d in sub.submitted} | {logs}):  # before any job is sent
        _check_writable(folder)
    for p in groups:
        tasks = pack([d for d in sub.submitted if d.spec.meta["preset"] == p], batch_size)
        if not tasks:
            continue
        res = dict(res_of[p])
        # a batch of S runs takes about S / 2 single-run times (docs/testbed.md, "Batched testbed"); longer: requeue
        res["time_min"] = res["time_min"] * math.ceil(max(len(t) for t in tasks) / 2)
        ex = submitit.AutoExecutor(folder=logs / "%j", cluster=cluster)
        ex.update_parameters(**_params(res, f"nsr-{sub.sweep}", max_parallel))
        runs = sum(len(t) for t in tasks)
        if cluster == "slurm":
            with ex.batch():
                jobs = [ex.submit(_job(t, res, batched(t, batch_size))) for t in tasks]
            sub.arrays.append(f"{jobs[0].job_id.split('_')[0]} ({p}, {runs} runs in {len(tasks)} tasks)")
            for t, j in zip(tasks, jobs):
                for d in t:
                    _record(d, j, cluster, logs)
            sub.jobs += jobs
        else:
            sub.jobs += _run_here(ex, tasks, res, cluster, logs, max_parallel, batch_size)
        sub.tasks += len(tasks)
    return sub


def _short_of_rows(sub: Submission) -> Refusal | None:
    """The runs to submit whose training prompt file is missing or short (their backend's plan), as a Refusal."""
    submitted = {d.spec.run_id: d.spec for d in sub.submitted}
    short = [pl for pl in sub.plans if pl.run_id in submitted and not pl.rows_ok]
    if not short:
        return None
    from experiments.openrlhf.data import fix_commands

    pl = short[0]
    have = "no training data file" if pl.rows_written is None else f"{pl.rows_written} rows"
    why = (
        f"{len(short)} runs short of training prompt rows (e.g. {pl.run_id} needs {pl.rows_needed} and finds {have}: "
        f"{submitted[pl.run_id].config.task.train_data})"
    )
    fix = "; ".join(fix_commands([submitted[p.run_id].config for p in short]))
    per_run = {
        p.run_id: f"short of training prompt rows: needs {p.rows_needed}, finds "
        + ("no file" if p.rows_written is None else str(p.rows_written))
        for p in short
    }
    return Refusal(why, [p.run_id for p in short], fix, per_run)


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` could not be created and written (its nearest existing ancestor is not a writable folder), or
    None; creates nothing."""
    p = folder.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a folder"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable"
    return None


def _refusals(sub: Submission, template: str | None, logs: Path) -> list[Refusal]:
    """What the real submit of a dry run's plan would refuse, in the order it checks: a template sweep, runs short of
    training data, folders it cannot write. Only runs it would send count (done or running ones are skipped)."""
    out = []
    ids = [d.spec.run_id for d in sub.decisions]
    if template is not None:
        out.append(Refusal(f"the sweep is a template ({template})", ids, "fill in its values and set status: ready"))
    if sub.submitted:
        short = _short_of_rows(sub)
        if short:
            out.append(short)
        for folder in sorted({d.out.parent for d in sub.submitted} | {logs}):
            why = _unwritable(folder)
            if why:
                out.append(Refusal(f"cannot write {folder} ({why})", [d.spec.run_id for d in sub.submitted],
                                   "a writable --out-root and --log-dir"))  # fmt: skip
    return out


def _check_writable(folder: Path) -> None:
    """ConfigError unless ``folder`` can be created and written (a read-only --out-root or --log-dir)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(
            f"{folder}: cannot write here ({e.strerror or e}); nothing was submitted; allowed: a writable "
            "--out-root and --log-dir"
        ) from None


def _resource_plans(decisions: list[Decision], res_of: dict) -> list:
    """Rows, GPU-hours and disk of each run whose backend has a cluster plan (experiments/backends.py; the openrlhf
    backend's: experiments.openrlhf.plan), with the site's time limit."""
    out = []
    for d in decisions:
        plan = BACKENDS[d.spec.config.backend].plan
        if plan is not None:
            out.append(plan(d.spec.config, d.spec.run_id, res_of[d.spec.meta["preset"]]["time_min"] / 60))
    return out


def _run_here(
    ex, tasks: list[list[Decision]], res: dict, cluster: str, logs: Path, max_parallel: int | None, batch_size: int
) -> list:
    """local: processes (one per task), at most ``max_parallel`` at once; debug: one after the other in this process.
    Waits."""
    width = max_parallel or (1 if cluster == "debug" else os.cpu_count() or 1)
    jobs, running = [], []
    for t in tasks:
        while len(running) >= width:
            running = [j for j in running if not j.done()]
            time.sleep(0.2)
        j = ex.submit(_job(t, res, batched(t, batch_size)))
        for d in t:
            _record(d, j, cluster, logs)
        jobs.append(j)
        running.append(j)
        if cluster == "debug":
            _wait(j)
    for j in jobs:
        _wait(j)
    return jobs


def _wait(job) -> None:
    with contextlib.suppress(Exception):  # a failing run is reported from its folder, not raised here
        job.result()


# ---------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m slurm.submit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("sweep", help="sweep file or name (sweeps/delta.yaml or delta)")
    p.add_argument("--preset", help="replace the sweep's preset (e.g. tiny, tiny-smoke)")
    p.add_argument("--cluster", default="slurm", choices=CLUSTERS, help="slurm (default), local processes, debug")
    p.add_argument("--only", nargs="+", metavar="RUN_ID", help="submit only these runs")
    p.add_argument("--dry-run", action="store_true", help="list the runs and what would be done; submit nothing")
    p.add_argument("--retry-failed", action="store_true", help="also resubmit failed runs")
    p.add_argument("--max-parallel", type=int, metavar="N", help="at most N tasks of the array at once")
    p.add_argument(
        "--batch-size", type=int, default=8, metavar="S",
        help="tiny backend: up to S compatible runs per task, as one batched model (default 8; 1: a task per run)",
    )  # fmt: skip
    p.add_argument("--out-root", help="root of the run folders (default results/runs)")
    p.add_argument("--log-dir", help="submitit logs (default logs/submitit/<sweep>)")
    p.add_argument("--site", help="site file (default slurm/cluster.yaml or $NSR_SLURM_SITE)")
    return p


def _overrides_text(spec: RunSpec) -> str:
    return " ".join(f"{k}={v}" for k, v in spec.overrides.items())


def _resources_text(res: dict) -> str:
    """One line of what each task of a preset requests from SLURM."""
    gpus = f"{res['gpus_per_node']} GPUs per node" if res["gpus_per_node"] else "no GPU"
    return (
        f"{res['nodes']} node(s), {res['cpus_per_task']} CPUs, {res['mem_gb']} GB, {res['time_min']} min, {gpus}"
        + "".join(f", {k} {res[k]}" for k in ("partition", "account", "qos", "constraint") if res.get(k))
    )


def _gb(x) -> str:
    return "?" if x is None else f"{x:,.0f}"


def _print_plans(plans: list) -> None:
    """One line per openrlhf run and a sweep total (experiments.openrlhf.plan has the assumptions)."""
    if not plans:
        return
    from experiments.openrlhf.plan import total

    for pl in plans:
        rows = f"{pl.rows_written}" if pl.rows_written is not None else "no file"
        flag = "" if pl.rows_ok else "  SHORT OF ROWS"
        print(
            f"plan {pl.run_id}: rows {rows}/{pl.rows_needed}{flag}; GPU-h {_gb(pl.gpu_hours_limit)} per allocation "
            f"({pl.nodes}x{pl.gpus // max(pl.nodes, 1)} GPUs), ~{_gb(pl.gpu_hours_estimate)} estimated; "
            f"disk peak {_gb(pl.disk_peak_gb)} GB"
        )
    t = total(plans)
    print(
        f"plan total: {t['runs']} openrlhf runs, GPU-h {_gb(t['gpu_hours_limit'])} of allocations, "
        f"~{_gb(t['gpu_hours_estimate'])} estimated, disk {_gb(t['disk_peak_gb_all_at_once'])} GB if all at once; "
        f"{len(t['runs_short_of_rows'])} runs short of rows (python -m experiments.openrlhf.plan --sweep ... for JSON)"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        sub = submit(
            args.sweep,
            preset=args.preset,
            cluster=args.cluster,
            only=args.only,
            dry_run=args.dry_run,
            retry_failed=args.retry_failed,
            max_parallel=args.max_parallel,
            out_root=args.out_root,
            log_dir=args.log_dir,
            site=args.site,
            batch_size=args.batch_size,
        )
    except (ConfigError, queue.QueueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    width = max((len(d.spec.run_id) for d in sub.decisions), default=0)
    refused = {}
    for r in sub.refusals:
        for run_id in r.run_ids:
            refused.setdefault(run_id, r.per_run.get(run_id, r.why))
    for d in sub.decisions:
        verb = ("would submit" if args.dry_run else "submit") if d.submit else "skip"
        reason = d.reason
        if d.spec.run_id in refused:
            verb, reason = "refused", f"{d.reason}; the submit refuses it: {refused[d.spec.run_id]}"
        print(f"{verb:12s} {d.spec.run_id:{width}s}  {reason}")
        if args.dry_run:
            print(f"{'':12s} {'':{width}s}  preset {d.spec.meta['preset']}: {_overrides_text(d.spec)}")
    for note in sub.notes:
        print(f"note: {note}")
    n_sub, n_skip = len(sub.submitted), len(sub.decisions) - len(sub.submitted)
    if args.dry_run:
        _print_plans(sub.plans)
        for p, res in sub.resources.items():
            print(f"resources {p}: {_resources_text(res)}")
        if sub.refusals:  # the last line: how many, why, the fix; exit as the real submit would (2)
            why = "; ".join(r.why for r in sub.refusals)
            fix = "; then ".join(r.fix for r in sub.refusals)
            n = len({i for r in sub.refusals for i in r.run_ids})
            print(f"dry run: {len(sub.decisions)} runs; the submit would refuse {n} of them and submit nothing: {why}; "
                  f"fix: {fix}")  # fmt: skip
            return 2
        print(f"dry run: {len(sub.decisions)} runs, {n_sub} would be submitted in {sub.tasks} tasks, {n_skip} skipped")
        return 0
    arrays = f" as job array {', '.join(sub.arrays)}" if sub.arrays else ""
    print(f"submitted {n_sub} runs in {sub.tasks} tasks{arrays} ({args.cluster}); skipped {n_skip}")
    if args.cluster != "slurm":
        states = [RunDir(d.out).state() for d in sub.submitted]
        print("finished: " + ", ".join(f"{s}={states.count(s)}" for s in sorted(set(map(str, states)))))
        return 0 if all(s == "done" for s in states) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
