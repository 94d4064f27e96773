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

Exit status: 0 done, 2 bad input (nothing created), 3 the folder refuses the run (done, another config, locked,
not writable), 143 cancelled (SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import traceback
from pathlib import Path

from experiments.config import ConfigError, RunConfig, load_config
from experiments.rundir import (
    BAD,
    COMPRESSED,
    LOG_FILES,
    RECORD,
    RUNS_ROOT,
    RunDir,
    RunExistsError,
    RunFolderError,
    runs_by_hash,
)
from nsr.registry import Registry

BACKENDS: Registry = Registry("backend")


@BACKENDS.register("tiny")
def _tiny(cfg: RunConfig, rd: RunDir, progress: bool) -> None:
    from experiments.tiny.train import train

    train(cfg, rd, progress=progress)


@BACKENDS.register("openrlhf")
def _openrlhf(cfg: RunConfig, rd: RunDir, progress: bool) -> None:
    from experiments.openrlhf.backend import run_openrlhf

    run_openrlhf(cfg, rd, progress=progress)


@BACKENDS.register("trl")
def _trl(cfg: RunConfig, rd: RunDir, progress: bool) -> None:
    from experiments.trl.train import run_trl

    run_trl(cfg, rd, progress=progress)


PREFLIGHT: Registry = Registry("backend")
"""Per backend, the checks a run makes when it starts, before any work (the RunConfig's own checks ran at its
construction). ``slurm.submit`` runs them on every run before any job exists, so no job fails at its start."""


@PREFLIGHT.register("tiny")
def _tiny_preflight(cfg: RunConfig) -> None:
    """Nothing more: every tiny-backend check runs when the RunConfig is built (experiments.tiny.checks)."""


@PREFLIGHT.register("openrlhf")
def _openrlhf_preflight(cfg: RunConfig) -> None:
    """The argv builder's refusals, then (where OpenRLHF is installed) every check the launcher makes before Ray
    starts: OpenRLHF's version, its own parser and argument checks, the NSR layer's refusals."""
    from experiments.openrlhf.argv import build_command

    cmd = build_command(cfg, Path("results/runs/preflight"), "preflight")
    try:
        from nsr.openrlhf.launch import LaunchError, prepare
    except ImportError:  # openrlhf is not installed here: its own checks run at the job's start
        return
    try:
        prepare(cmd.argv[3:])  # after `python -m nsr.openrlhf.launch`
    except LaunchError as e:
        raise ConfigError(str(e).removeprefix("nsr.openrlhf.launch: error: ")) from None


@PREFLIGHT.register("trl")
def _trl_preflight(cfg: RunConfig) -> None:
    """The GRPOConfig the run builds and NSRGRPOTrainer's refusals of it (no model is loaded)."""
    from experiments.trl.train import check_runnable

    check_runnable(cfg)


def preflight(cfg: RunConfig) -> None:
    """Every check ``cfg``'s run makes at its start, before any work; ConfigError naming the key and the allowed
    values if one fails."""
    PREFLIGHT[cfg.backend](cfg)


class Cancelled(BaseException):
    """Raised in the main thread on SIGTERM (scancel), so the run unwinds and records ``cancelled``."""


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
):
    """Run ``cfg`` into folder ``out`` (resuming it if it holds an unfinished run of the same config).

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
    rd = RunDir(out)
    if rd.path.exists() and not rd.path.is_dir():
        raise RunFolderError(f"{rd.path}: is a file; allowed: a folder (new, or a run folder of this config)")
    existed, had_lock = rd.path.exists(), rd.lock_path.exists()
    started = False
    try:
        with rd.lock():
            check_folder(rd, cfg, force)
            started = True
            return _run_locked(cfg, rd, run_id, meta, force, progress)
    except RunFolderError:
        if not started:  # refused before anything was written: leave the place as it was
            with contextlib.suppress(OSError):
                if not had_lock:
                    rd.lock_path.unlink(missing_ok=True)
                if not existed:
                    rd.path.rmdir()
        raise


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


def _run_locked(cfg: RunConfig, rd: RunDir, run_id, meta, force: bool, progress: bool) -> dict:
    if force:
        rd.clear()
    rd.write_config(cfg, run_id=run_id, **(meta or {}))
    rd.set_status("running", run_hash=cfg.run_hash())
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        BACKENDS[cfg.backend](cfg, rd, progress)
    except BaseException as e:
        # A second SIGTERM (SLURM sends several) must not interrupt the final status write.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        error = f"{type(e).__name__}: {e}"
        if isinstance(e, (Cancelled, KeyboardInterrupt, SystemExit)):  # SystemExit: submitit's requeue
            rd.set_status("cancelled", error=error)
        else:
            rd.set_status("failed", error=error, traceback=traceback.format_exc()[-4000:])
        raise
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return rd.set_status("done")
    finally:
        signal.signal(signal.SIGTERM, previous)


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
        if not getattr(args, "dry_run", False):
            check_ready(args.sweep)
        return spec.config, spec.run_id, spec.sweep, spec.meta
    if not args.config:
        raise ConfigError("give a config file (e.g. sweeps/presets/tiny.yaml) or --sweep SWEEP --run RUN_ID")
    cfg = load_config(args.config, args.overrides)
    name = Path(args.config).stem
    return cfg, f"{name}-{cfg.run_hash()}", "adhoc", {"sweep": "adhoc", "arm": name, "seed": cfg.seed}


def dry_run(args) -> list[dict]:
    """The command of each run (all of --sweep, or the one of --run / a config): no Ray, no vLLM. For the openrlhf
    backend also the part OpenRLHF's parser receives (checked by that parser); null for the tiny backend."""
    from experiments.openrlhf.argv import build_command

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
        if cfg.backend != "openrlhf":  # the tiny backend runs in this process: its command is this module's
            argv = [sys.executable, "-m", "experiments.run"]
            if args.sweep:
                argv += ["--sweep", str(args.sweep), "--run", run_id]
                argv += ["--preset", args.preset] if args.preset else []
            else:
                argv += [str(args.config), *args.overrides]
            argv += ["--out", str(run_dir)]
            out.append({"run_id": run_id, "argv": argv, "openrlhf_argv": None})
            continue
        cmd = build_command(cfg, run_dir, run_id)
        if parse is not None:
            try:
                parse(cmd.openrlhf_argv)
            except CLIError as e:
                raise ConfigError(f"{run_id}: {e}") from None
        out.append({"run_id": run_id, "argv": cmd.argv, "openrlhf_argv": cmd.openrlhf_argv})
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)  # `CONFIG --out X key=value` works: overrides after options
    if args.dry_run:
        try:
            lines = dry_run(args)
        except (ConfigError, ImportError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for line in lines:
            print(json.dumps(line))
        return 0
    try:
        cfg, run_id, sweep, meta = resolve(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_out(sweep, run_id)
    try:
        if not args.out and not args.force and RunDir(out).state() != "done":
            other = elsewhere(cfg, out)
            if other is not None:
                state, where = other
                print(
                    f"error: this config (hash {cfg.run_hash()}) is {state} in {where}, a config runs once; the "
                    f"analysis reads it from there (pass --force to run it again into {out})",
                    file=sys.stderr,
                )
                return 3
        status = run(cfg, out, run_id=run_id, meta=meta, force=args.force, progress=not args.no_progress)
    except RunFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except Cancelled:
        return 143
    print(f"{status['state']}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
