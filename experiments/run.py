"""Run one experiment and write its run folder (docs/design.md).

CPU (the tiny testbed, minutes on a laptop):
    python -m experiments.run sweeps/presets/tiny-smoke.yaml
    python -m experiments.run sweeps/presets/tiny.yaml loss.rule=nsr loss.delta=0.2 seed=1 --out /tmp/nsr-run
One grid point of a sweep, exactly as the grid runs it (see sweeps/):
    python -m experiments.run --sweep sweeps/delta.yaml --run <run_id> [--preset tiny]
Cluster (inside a SLURM allocation; normally sent by ``python -m slurm.submit``):
    python -m experiments.run sweeps/presets/qwen2.5-math-7b-dapo.yaml loss.rule=nsr

The folder (``--out``, default ``results/runs/<sweep>/<run_id>``) gets config.yaml, metrics.jsonl, eval.jsonl.gz and
an atomically written status.json. A folder whose run is done is never overwritten without ``--force``; any other
folder of the same config resumes from its last checkpoint. A folder of another config, a folder that is not a run
folder, or one whose files cannot be read is refused, ``--force`` or not. Without ``--out``, a config that is
already done (or running) in another folder under results/runs (another sweep that has the same config) is not
run again: the message says where it is. Bad config: a clear error, and no folder is created.

Exit status: 0 done, 2 bad input (nothing created; except that a bad ``NSR_THREADS``, read under the folder's lock,
leaves a new folder with its config and status failed naming it, and any other folder as it was), 3 the folder
refuses the run (done, another config, locked, not writable), 143 cancelled (SIGTERM; or SIGUSR1 on the trl backend,
which first saves a checkpoint at the end of the current RL step, so the rerun loses nothing).

Many seeds in one process (tiny backend; docs/testbed.md, "Batched testbed"):
    python -m experiments.run sweeps/presets/tiny.yaml loss.rule=nsr --seeds 0-7 --out /tmp/nsr-seeds
trains the 8 seeds as one batched model, one run folder per seed, ``<config stem>-s<seed>-<run hash>`` under
``--out``; exit 1 if a run failed (alone: the others finish).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from experiments import backends, stop_request
from experiments.config import ConfigError, RunConfig, load_config
from experiments.rundir import (
    BAD,
    COMPRESSED,
    LOG_FILES,
    RECORD,
    RUNS_ROOT,
    Cancelled,
    RunDir,
    RunExistsError,
    RunFolderError,
    runs_by_hash,
    thread_counts,
)

BACKENDS = backends.BACKENDS
"""Backend name -> its record (experiments/backends.py): what it runs, its checks, preflight, identity, packing."""


def preflight(cfg: RunConfig) -> None:
    """Every check ``cfg``'s run makes at its start, before any work; ConfigError naming the key and the allowed
    values if one fails (the backend's ``preflight``, experiments/backends.py)."""
    backends.preflight(cfg)


def _on_sigterm(signum, frame):
    raise Cancelled(f"received signal {signum}")


def run(
    cfg: RunConfig,
    out: str | Path,
    *,
    run_id: str | None = None,
    meta: dict | None = None,
    force: bool = False,
    progress: bool = True,
    before_step=None,
):
    """Run ``cfg`` into folder ``out`` (resuming it if it holds an unfinished run of the same config).

    ``before_step``: tiny backend, ``before_step(step, model, optimizer)`` called before each RL step with the run's
    state (experiments.mechanism walks a baseline run this way); trl backend, ``before_step(step, trainer)`` called
    once per RL step after its rollout is generated and before its updates (experiments.mechanism.trl). Either must
    leave the run's state unchanged.

    ``meta`` (e.g. ``{"sweep": "delta", "arm": "nsr", "point": {"loss.delta": 0.2}, "seed": 0}``) is stored in
    config.yaml's ``meta`` section, where the analysis finds each run's arm.

    Returns the final status dict. ConfigError if a check the run makes at its start fails (:func:`preflight`),
    before anything is created. The folder is locked first and checked under the lock (no other process can
    change it in between). Raises RunExistsError if ``out`` holds a finished run and ``force`` is False, or a run of
    another config (``force`` does not apply: it never wipes another config's run); RunLockedError if another
    process is running it; RunFolderError if ``out`` is a file, cannot be written, is not a run folder, or holds run
    files that cannot be read.
    """
    preflight(cfg)  # ConfigError before anything exists
    if before_step is not None and cfg.backend not in ("tiny", "trl"):
        raise ConfigError(f"before_step with backend={cfg.backend!r}; allowed: backend tiny or trl")
    rd = RunDir(out)
    if rd.path.exists() and not rd.path.is_dir():
        raise RunFolderError(f"{rd.path}: is a file; allowed: a folder (new, or a run folder of this config)")
    existed, had_lock = rd.path.exists(), rd.lock_path.exists()
    started = False
    save = BACKENDS[cfg.backend].save_signal  # how slurm.stop may stop this attempt without loss
    save_signum = getattr(signal, f"SIG{save}") if save else None
    # listening before the folder is locked, and until it is released (ignoring the signal from the final status
    # write on): a process that holds the folder always has the handler, so the save signal that slurm.stop sends
    # to the folder's holder never meets the default action, which would end the process without a word; a request
    # made while the attempt starts is kept, and honoured at the end of its first step
    previous_save = stop_request.listen(save_signum) if save_signum else None
    try:
        with rd.lock():
            check_folder(rd, cfg, force)
            started = True
            return _run_locked(cfg, rd, run_id, meta, force, progress, before_step, save)
    except RunFolderError:
        if not started:  # refused before anything was written: leave the place as it was
            _leave_as_it_was(rd, existed, had_lock)
        raise
    finally:
        if save_signum:
            stop_request.restore(save_signum, previous_save)


def _leave_as_it_was(rd: RunDir, existed: bool, had_lock: bool) -> None:
    """After a refusal before anything was written: remove the lock file and the (empty) folder the attempt made."""
    with contextlib.suppress(OSError):
        if not had_lock:
            rd.lock_path.unlink(missing_ok=True)
        if not existed:
            rd.path.rmdir()


_RUN_FILES = {"config.yaml", "status.json", *LOG_FILES, *COMPRESSED, "checkpoint.pt", RECORD}


def check_folder(rd: RunDir, cfg: RunConfig, force: bool) -> None:
    """May ``cfg`` run into ``rd``? Identity first (the config hash), then the state. Raises RunFolderError."""
    old_hash = rd.config_hash()  # RunFolderError if config.yaml cannot be read: never guess whose folder it is
    if old_hash is not None and old_hash != cfg.run_hash():
        raise RunExistsError(
            f"{rd.path}: holds a run of another config (hash {old_hash}, this one {cfg.run_hash()}); it is left as "
            "it is (--force does not apply to another config's run); allowed: another --out"
        )
    if old_hash is None:
        foreign = sorted(p.name for p in rd.path.iterdir() if p.name not in _RUN_FILES and not p.name.startswith("."))
        if foreign:
            shown = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
            raise RunFolderError(
                f"{rd.path}: is not a run folder (holds {shown} and no config.yaml); allowed: a new or empty "
                "folder, or a run folder of this config"
            )
    st = rd.status() or {}
    if force:
        return
    if st.get("state") == "done":
        raise RunExistsError(f"{rd.path}: this run is done; pass --force to run it again from scratch")
    if st.get("state") == BAD:
        raise RunFolderError(
            f"{st['problem']}; this folder's run (the same config) cannot be resumed from it; pass --force to run "
            "it again from scratch"
        )


def _threads_or_fail(folders: list[tuple[RunDir, Callable[[], None]]]) -> int:
    """NSR_THREADS for runs that train in this process, read before any folder is touched (``folders``: each run's
    folder and how to write its config). A bad value is bad input (ConfigError): a folder with a status keeps it as
    it is (a done run stays done under --force, a cancelled one stays resumable); a new folder gets its config and
    status failed naming the variable, so the folder, not only a SLURM job's log, says why the run never started."""
    from experiments.threads import threads

    try:
        return threads()
    except ConfigError as e:
        for rd, write_config in folders:
            if rd.status() is None:
                write_config()
                rd.set_status("failed", error=f"{type(e).__name__}: {e}")
        raise


def _note_thread_change(rd: RunDir, n: int | None) -> None:
    """A resumed run at a thread count its earlier attempts did not use: say so (its rows round differently from here
    on; status.json keeps every count in ``thread_counts``)."""
    st = rd.status() or {}
    before = thread_counts(st)
    if n and before and n not in before and st.get("state") != BAD:
        last = st.get("threads") or before[-1]
        print(
            f"note: {rd.path}: NSR_THREADS={n}, its earlier attempts used {', '.join(map(str, before))}: float "
            f"rounding differs from here on; NSR_THREADS={last} keeps it a bit-identical rerun",
            file=sys.stderr,
        )


def _run_locked(
    cfg: RunConfig, rd: RunDir, run_id, meta, force: bool, progress: bool, before_step, save: str | None
) -> dict:
    """:func:`run` under the folder's lock; ``save``: the backend's save signal, which :func:`run` listens for."""
    save_signum = getattr(signal, f"SIG{save}") if save else None
    extra = {"save_signal": save} if save else {}
    write_config = functools.partial(rd.write_config, cfg, run_id=run_id, **(meta or {}))
    if BACKENDS[cfg.backend].threaded(cfg):  # its thread count sets float rounding
        extra["threads"] = _threads_or_fail([(rd, write_config)])
    if force:
        rd.clear()
    _note_thread_change(rd, extra.get("threads"))
    write_config()
    rd.set_status("running", run_hash=cfg.run_hash(), **extra)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)

    def ending() -> None:  # a second SIGTERM (SLURM sends several) or a late save signal must not interrupt the
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # final status write
        if save_signum:
            stop_request.ignore(save_signum)

    try:
        rd.curves = _curves(cfg, rd, run_id)
        if before_step is None:
            BACKENDS[cfg.backend].run(cfg, rd, progress)
        else:  # the tiny and trl backends' hook (run() refuses it for any other)
            BACKENDS[cfg.backend].run(cfg, rd, progress, before_step=before_step)
    except BaseException as e:
        ending()
        error = f"{type(e).__name__}: {e}"
        if isinstance(e, (Cancelled, KeyboardInterrupt, SystemExit)):  # SystemExit: submitit's requeue
            rd.set_status("cancelled", error=error)
        else:
            rd.set_status("failed", error=error, traceback=traceback.format_exc()[-4000:])
        raise
    else:
        ending()
        return rd.set_status("done")
    finally:
        _close_curves(rd)
        signal.signal(signal.SIGTERM, previous)


def _curves(cfg: RunConfig, rd: RunDir, run_id: str | None):
    """The run's live curves (``logging.report_to``, experiments/curves.py) for a backend that trains in this process
    (tiny, trl; the openrlhf backend's OpenRLHF writes its own TensorBoard events), or None."""
    if cfg.logging.report_to == "none" or BACKENDS[cfg.backend].command is not None:
        return None
    from experiments.curves import Curves

    return Curves(rd.path, cfg.logging.report_to, run_name=run_id or rd.path.name, config=cfg.to_dict())


def _close_curves(rd: RunDir) -> None:
    if rd.curves is not None:
        rd.curves.close()
        rd.curves = None


def run_batch(
    cfgs: list[RunConfig],
    folders: list,
    *,
    run_ids: list[str] | None = None,
    metas: list[dict] | None = None,
    force: bool = False,
    progress: bool = True,
) -> list[dict]:
    """Run compatible tiny configs as one batched process (experiments/tiny/batched.py), ``cfgs[i]`` into
    ``folders[i]``, each folder with the contract of :func:`run`: every folder is locked and checked first (a folder
    that :func:`run` refuses refuses the whole batch, and nothing is written); a run that is done is skipped (rerun
    from scratch with ``force``); the others get config.yaml and status running, resume from their checkpoints, and
    end done, or failed alone (the others go on). SIGTERM or an error that is no single run's ends the batch: its
    unfinished runs are cancelled or failed. Returns the final status of every run, in order. Raises ConfigError
    for configs that cannot share a batch (``experiments.tiny.batched.check_batch``), RunExistsError if every run
    is done, RunLockedError / RunFolderError as :func:`run`."""
    from experiments.tiny.batched import check_batch, train_batch

    check_batch(cfgs)
    rds = [RunDir(f) for f in folders]
    for rd in rds:
        if rd.path.exists() and not rd.path.is_dir():
            raise RunFolderError(f"{rd.path}: is a file; allowed: a folder (new, or a run folder of this config)")
    before = [(rd.path.exists(), rd.lock_path.exists()) for rd in rds]
    with contextlib.ExitStack() as stack:
        todo = []
        try:
            for i, rd in enumerate(rds):
                stack.enter_context(rd.lock())
                try:
                    check_folder(rd, cfgs[i], force)
                    todo.append(i)
                except RunExistsError:  # a done run is skipped; another config's folder refuses the batch
                    if rd.state() != "done" or rd.config_hash() != cfgs[i].run_hash():
                        raise
        except RunFolderError:
            stack.close()  # refused before anything was written: leave every place as it was
            for rd, (existed, had_lock) in zip(rds, before):
                _leave_as_it_was(rd, existed, had_lock)
            raise
        if not todo:
            raise RunExistsError(f"every run of this batch is done ({len(rds)}); pass --force to run them again")
        writes = {
            i: functools.partial(rds[i].write_config, cfgs[i], run_id=run_ids[i] if run_ids else None,
                                 **(metas[i] if metas else {}))
            for i in todo
        }  # fmt: skip
        n_threads = _threads_or_fail([(rds[i], writes[i]) for i in todo])
        for i in todo:
            if force:
                rds[i].clear()
            _note_thread_change(rds[i], n_threads)
            writes[i]()
            rds[i].set_status("running", run_hash=cfgs[i].run_hash(), threads=n_threads)
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            for i in todo:
                rds[i].curves = _curves(cfgs[i], rds[i], run_ids[i] if run_ids else None)
            train_batch([cfgs[i] for i in todo], [rds[i] for i in todo], progress=progress)
        except BaseException as e:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            error = f"{type(e).__name__}: {e}"
            for i in todo:
                if rds[i].state() != "running":  # failed alone before the batch stopped
                    continue
                if isinstance(e, (Cancelled, KeyboardInterrupt, SystemExit)):
                    rds[i].set_status("cancelled", error=error)
                else:
                    rds[i].set_status("failed", error=error, traceback=traceback.format_exc()[-4000:])
            raise
        else:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            for i in todo:
                if rds[i].state() == "running":
                    rds[i].set_status("done")
        finally:
            for i in todo:
                _close_curves(rds[i])
            signal.signal(signal.SIGTERM, previous)
    return [rd.status() for rd in rds]


def _main_seeds(args) -> int:
    """``CONFIG [overrides] --seeds 0-7 [--out DIR]``: the seeds in one batch (:func:`run_batch`), run ``i`` in
    ``DIR/<config stem>-s<seed>-<run hash>`` (default DIR: results/runs/adhoc). Exit 0 all done, 1 a run failed,
    2 bad input, 3 the folders refuse the batch, 143 cancelled (:func:`_exit_code`)."""
    from experiments.tiny.batched import check_batch, parse_seeds, seed_run_id

    if args.sweep or args.dry_run or not args.config:
        raise ConfigError("--seeds takes a config file and overrides (not --sweep, not --dry-run)")
    if any(o.split("=", 1)[0].strip() == "seed" for o in args.overrides):
        raise ConfigError("seed=... and --seeds both given; allowed: one of them")
    base = load_config(args.config, args.overrides)
    cfgs = [base.replace(seed=s) for s in parse_seeds(args.seeds)]
    check_batch(cfgs)
    stem = Path(args.config).stem
    run_ids = [seed_run_id(stem, c) for c in cfgs]
    outs = [Path(args.out) / r if args.out else default_out("adhoc", r) for r in run_ids]
    metas = [{"sweep": "adhoc", "arm": stem, "seed": c.seed} for c in cfgs]
    if not args.out and not args.force:
        for cfg, out in zip(cfgs, outs):
            other = elsewhere(cfg, out) if RunDir(out).state() != "done" else None
            if other is not None:
                raise RunFolderError(f"seed {cfg.seed} (hash {cfg.run_hash()}) is {other[0]} in {other[1]}, a config "
                                     f"runs once (pass --force to run it again into {out})")  # fmt: skip
    statuses = run_batch(cfgs, outs, run_ids=run_ids, metas=metas, force=args.force, progress=not args.no_progress)
    for st, out in zip(statuses, outs):
        print(f"{st['state']}: {out}" + (f" ({st.get('error')})" if st["state"] == "failed" else ""))
    return 0 if all(st["state"] == "done" for st in statuses) else 1


def _exit_code(work: Callable[[], int]) -> int:
    """``work()``'s exit status, or the status of what stopped it (the module doc's): 2 bad input (ConfigError),
    3 the folder refuses the run (RunFolderError), 143 cancelled; the refusal's message goes to stderr."""
    try:
        return work()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except Cancelled:
        return 143


def elsewhere(cfg: RunConfig, out: Path, root: Path | None = None) -> tuple[str, Path] | None:
    """("done" | "running", folder) if another folder under ``root`` (default RUNS_ROOT) holds this config done, or
    running (locked); None otherwise. A config runs once, whichever sweeps contain it."""
    folders = runs_by_hash(RUNS_ROOT if root is None else root).get(cfg.run_hash(), [])
    found = [p for p in folders if p.resolve() != Path(out).resolve()]
    for p in found:
        if RunDir(p).state() == "done":
            return "done", p
    for p in found:
        if RunDir(p).locked():
            return "running", p
    return None


def default_out(sweep: str, run_id: str) -> Path:
    return RUNS_ROOT / sweep / run_id


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", nargs="?", help="a RunConfig YAML (e.g. sweeps/presets/tiny.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. loss.rule=nsr seed=1")
    p.add_argument("--sweep", help="a sweep file (sweeps/*.yaml); with --run, run that grid point")
    p.add_argument("--run", dest="run_id", help="run id within --sweep (as listed by slurm.submit --dry-run)")
    p.add_argument("--preset", help="with --sweep: replace the sweep's preset (e.g. tiny)")
    p.add_argument("--out", help="run folder (default results/runs/<sweep>/<run_id>)")
    p.add_argument("--force", action="store_true", help="rerun a finished run of this config from scratch")
    p.add_argument(
        "--seeds",
        help="tiny backend: train these seeds of CONFIG in one batched process (e.g. 0-7, 0,3,5), one run folder "
        "per seed, <config stem>-s<seed>-<run hash>, under --out (default results/runs/adhoc)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="openrlhf backend: print one JSON line per run (run_id, the full launcher argv, the part OpenRLHF's "
        "parser receives), checked with OpenRLHF's own parser when openrlhf is installed; --run is then optional",
    )
    return p


def resolve(args) -> tuple[RunConfig, str, str, dict]:
    """(config, run_id, sweep name, meta) from the command line; raises ConfigError on bad input."""
    if args.preset and not args.sweep:
        raise ConfigError(
            f"--preset {args.preset} needs --sweep (it replaces a sweep's preset); for a single run give the preset "
            f"file as the config: python -m experiments.run sweeps/presets/{args.preset}.yaml key=value ..."
        )
    if args.sweep:
        if args.config or args.overrides:
            raise ConfigError("give either a config file with overrides, or --sweep with --run, not both")
        if not args.run_id and not getattr(args, "dry_run", False):
            raise ConfigError("--sweep needs --run RUN_ID (list them with: python -m slurm.submit SWEEP --dry-run)")
        from experiments.sweep import check_ready, resolve_run

        spec = resolve_run(args.sweep, args.run_id, preset=args.preset)
        if not args.preset and spec.run_id and spec.meta.get("preset") not in _sweep_presets(args.sweep):
            print(f"run {spec.run_id}: a run of preset {spec.meta['preset']} (found without --preset)", file=sys.stderr)
        if not getattr(args, "dry_run", False):
            check_ready(args.sweep)
        return spec.config, spec.run_id, spec.sweep, spec.meta
    if not args.config:
        raise ConfigError("give a config file (e.g. sweeps/presets/tiny.yaml) or --sweep SWEEP --run RUN_ID")
    cfg = load_config(args.config, args.overrides)
    name = Path(args.config).stem
    return cfg, f"{name}-{cfg.run_hash()}", "adhoc", {"sweep": "adhoc", "arm": name, "seed": cfg.seed}


def _sweep_presets(sweep) -> tuple[str, ...]:
    """The presets a sweep names itself."""
    from experiments.sweep import load_sweep

    return load_sweep(sweep).presets


def dry_run(args) -> list[dict]:
    """The command of each run (all of --sweep, or the one of --run / a config): no Ray, no vLLM. For a backend that
    runs outside this process (openrlhf) its launcher command and the part OpenRLHF's parser receives (checked by that
    parser); null for a backend that runs in this process."""
    if args.sweep and not args.run_id:
        from experiments.sweep import expand

        specs = [(s.config, s.run_id, s.sweep) for s in expand(args.sweep, preset=args.preset)]
    else:
        cfg, run_id, sweep, _ = resolve(args)
        specs = [(cfg, run_id, sweep)]
    try:
        from nsr.openrlhf.cli import CLIError, parse
    except ImportError:  # openrlhf not installed: print the commands unchecked
        parse = None
    out = []
    for cfg, run_id, sweep in specs:
        run_dir = Path(args.out) if args.out and len(specs) == 1 else default_out(sweep, run_id)
        command = BACKENDS[cfg.backend].command
        if command is None:  # the backend runs in this process: its command is this module's
            argv = [sys.executable, "-m", "experiments.run"]
            if args.sweep:
                argv += ["--sweep", str(args.sweep), "--run", run_id]
                argv += ["--preset", args.preset] if args.preset else []
            else:
                argv += [str(args.config), *args.overrides]
            argv += ["--out", str(run_dir)]
            out.append({"run_id": run_id, "argv": argv, "openrlhf_argv": None})
            continue
        cmd = command(cfg, run_dir, run_id)
        if parse is not None:
            try:
                parse(cmd.openrlhf_argv)
            except CLIError as e:
                raise ConfigError(f"{run_id}: {e}") from None
        out.append({"run_id": run_id, "argv": cmd.argv, "openrlhf_argv": cmd.openrlhf_argv})
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)  # `CONFIG --out X key=value` works: overrides after options
    if args.seeds is not None:
        return _exit_code(lambda: _main_seeds(args))
    if args.dry_run:
        return _exit_code(lambda: _main_dry_run(args))
    return _exit_code(lambda: _main_run(args))


def _main_dry_run(args) -> int:
    try:
        lines = dry_run(args)
    except ImportError as e:
        raise ConfigError(str(e)) from None
    for line in lines:
        print(json.dumps(line))
    return 0


def _main_run(args) -> int:
    cfg, run_id, sweep, meta = resolve(args)
    out = Path(args.out) if args.out else default_out(sweep, run_id)
    if not args.out and not args.force and RunDir(out).state() != "done":
        other = elsewhere(cfg, out)
        if other is not None:
            state, where = other
            raise RunFolderError(
                f"this config (hash {cfg.run_hash()}) is {state} in {where}, a config runs once; the analysis reads "
                f"it from there (pass --force to run it again into {out})"
            )
    status = run(cfg, out, run_id=run_id, meta=meta, force=args.force, progress=not args.no_progress)
    print(f"{status['state']}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
