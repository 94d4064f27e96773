"""One record per backend: what it runs, its config checks, its preflight, its identity fields, how its runs pack into
one task and its cluster plan, collected here, above the backends (docs/design.md, "Backends").

    from experiments.backends import BACKENDS
    BACKENDS["tiny"].identity          # the fields a tiny run's id hashes
    BACKENDS[cfg.backend].run(cfg, rd, progress=True)

The schema (experiments/config.py) imports no backend: a :class:`Backend` registers its config checks and identity
fields with it (:func:`experiments.config.register_backend`), and ``experiments/__init__.py`` imports this module, so
every process that builds a RunConfig has every backend registered. Adding a backend means one new folder under
experiments/ (its training loop and its checks, importing only the shared modules) and one :func:`register` call
below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from experiments import config
from experiments.config_errors import ConfigError
from experiments.openrlhf.config_checks import check_config as check_openrlhf
from experiments.openrlhf.config_checks import derive_batch as derive_openrlhf
from experiments.tiny.config_checks import check_config as check_tiny
from experiments.trl.config_checks import check_config as check_trl
from nsr.registry import Registry

if TYPE_CHECKING:
    from experiments.config import RunConfig
    from experiments.rundir import RunDir


@dataclass(frozen=True)
class Backend:
    """Everything the harness needs to know about one backend."""

    name: str
    runs: str
    """What it runs, in one line (shown by ``python -m experiments.run --help`` and docs/design.md)."""
    run: Callable[[RunConfig, RunDir, bool], None]
    """Train ``cfg`` into the run folder (resuming it); called by experiments.run under the folder's lock."""
    check: Callable[[RunConfig], None]
    """Config checks at the RunConfig's construction (ConfigError naming the key and the allowed values)."""
    preflight: Callable[[RunConfig], None]
    """Checks a run makes when it starts, before any work; slurm.submit runs them on every run before any job exists."""
    identity: tuple[str, ...]
    """Dotted fields (a section stands for all its fields) that a run's outputs depend on, what its run id hashes: its
    numbers, its evaluation, and the files it leaves (``logging.keep_checkpoint`` keeps the final checkpoint; the trl
    backend keeps every ``checkpoint_every`` checkpoint). Left out: other backends' sections, fields the backend never
    reads (tiny: task.train_data and the other openrlhf task fields; openrlhf: the warm start), the progress bar, and
    ``train.allow_on_policy`` (a guard at construction; no trainer reads it). The sections of the method (``loss``,
    ``advantages``) enter whole: a rule's parameters are part of its config even where the rule ignores one (the hard
    rule at delta 0.5 is its own config, with the numbers of delta 0.2). tests/test_identity.py checks, on the tiny
    backend, that no field outside this tuple is read during a run and that changing every one of them leaves the
    outputs byte-identical."""
    batch_key: Callable[[RunConfig], str] | None = None
    """How its runs pack into one task: runs with equal keys train as one batched process (None: each run alone)."""
    plan: Callable[..., Any] | None = None
    """Its cluster plan of one run (rows, GPU-hours, disk), checked by slurm.submit before submitting (None: none)."""
    fixed_resources: Callable[[RunConfig], dict[str, int]] | None = None
    """SLURM resources its config fixes (nodes, gpus_per_node), which the site file may not contradict."""
    on_ray_cluster: Callable[[RunConfig], bool] = lambda cfg: False
    """Whether a run needs a Ray cluster over its SLURM allocation's nodes (slurm/ray_cluster.py)."""
    command: Callable[[RunConfig, Path, str], Any] | None = None
    """The launcher command of a run that runs outside this process (``--dry-run`` prints it; None: in process)."""
    threaded: Callable[[RunConfig], bool] = lambda cfg: True
    """Whether ``NSR_THREADS`` sets the run's compute threads (and so its float rounding): read before the run starts
    and recorded in status.json. True for the backends that train in this process; the openrlhf backend's CPU path
    gives its processes those threads (experiments/openrlhf/argv.py ``cpu_threads``), a GPU run does not read it."""
    derive: Callable[[RunConfig], dict[str, Any]] | None = None
    """Fields its RunConfig derives from others at construction, before the checks ({section: section with the
    derived values}; experiments.config.BACKEND_DERIVE). None: nothing is derived."""
    save_signal: str | None = None
    """The signal (``USR1``) on which a run finishes its step, saves a checkpoint and stops; recorded in status.json
    for each attempt, read by ``python -m slurm.stop``. None: SIGTERM stops the run at once (last checkpoint)."""


BACKENDS: Registry[Backend] = Registry("backend")


def register(backend: Backend) -> Backend:
    """Add ``backend`` to :data:`BACKENDS` and its checks and identity to the schema."""
    BACKENDS.register(backend.name)(backend)
    config.register_backend(backend.name, backend.check, backend.identity, backend.derive)
    return backend


def get(cfg_or_name) -> Backend:
    """The record of a RunConfig's backend (or of a backend name); ValueError naming the valid names otherwise."""
    return BACKENDS[getattr(cfg_or_name, "backend", cfg_or_name)]


def preflight(cfg: RunConfig) -> None:
    """Every check ``cfg``'s run makes at its start, before any work; ConfigError naming the key and the allowed
    values if one fails. Also the live curves' (``logging.report_to``, experiments/curves.py)."""
    from experiments.curves import check

    check(cfg.logging.report_to, cfg.backend)
    get(cfg).preflight(cfg)


# ---------------------------------------------------------------- tiny: the CPU testbed
def _tiny_run(cfg: RunConfig, rd: RunDir, progress: bool, before_step=None) -> None:
    """``before_step``: experiments.mechanism.toy's hook (experiments.tiny.train.train), called before each step."""
    from experiments.tiny.train import train

    train(cfg, rd, progress=progress, before_step=before_step)


def _tiny_preflight(cfg: RunConfig) -> None:
    """Nothing more: every tiny-backend check runs when the RunConfig is built (experiments.tiny.config_checks)."""


def _tiny_batch_key(cfg: RunConfig) -> str:
    from experiments.tiny.batched import batch_key

    return batch_key(cfg)


_METHOD = ("backend", "seed", "rollout", "train", "loss", "advantages", "reward", "eval")
_TINY_MODEL = ("model.name", "model.d_model", "model.n_layer", "model.n_head")
"""The model fields a tiny run reads (model.untie_embeddings, a real model's option, is not one of them)."""

register(
    Backend(
        name="tiny",
        runs="a tiny GPT-2 on the CPU testbed's tasks, SFT warm start then GRPO with any nsr rule (experiments/tiny)",
        run=_tiny_run,
        check=check_tiny,
        preflight=_tiny_preflight,
        identity=(*_METHOD, *_TINY_MODEL, "sft", "task.name", "logging.keep_checkpoint"),
        batch_key=_tiny_batch_key,
    )
)


# ---------------------------------------------------------------- openrlhf: the cluster backend
def _openrlhf_run(cfg: RunConfig, rd: RunDir, progress: bool) -> None:
    from experiments.openrlhf.backend import run_openrlhf

    run_openrlhf(cfg, rd, progress=progress)


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


def _openrlhf_plan(cfg: RunConfig, run_id: str = "", time_limit_h: float | None = None):
    from experiments.openrlhf.plan import plan_run

    return plan_run(cfg, run_id, time_limit_h)


def _openrlhf_command(cfg: RunConfig, run_dir: Path, run_id: str):
    from experiments.openrlhf.argv import build_command

    return build_command(cfg, run_dir, run_id)


register(
    Backend(
        name="openrlhf",
        runs="OpenRLHF 0.11.2's PPO/GRPO loop with the nsr loss, launched on a Ray cluster (experiments/openrlhf)",
        run=_openrlhf_run,
        check=check_openrlhf,
        derive=derive_openrlhf,
        preflight=_openrlhf_preflight,
        identity=(*_METHOD, "model", "task", "openrlhf", "logging.keep_checkpoint"),
        plan=_openrlhf_plan,
        fixed_resources=lambda cfg: {  # a CPU run's DeepSpeed ranks hold fake Ray GPUs only: it asks SLURM for none
            "nodes": cfg.openrlhf.nodes,
            "gpus_per_node": 0 if cfg.openrlhf.cpu else cfg.openrlhf.gpus_per_node,
        },
        on_ray_cluster=lambda cfg: cfg.openrlhf.nodes > 1,
        command=_openrlhf_command,
        threaded=lambda cfg: cfg.openrlhf.cpu,
    )
)


# ---------------------------------------------------------------- trl: TRL's GRPOTrainer
def _trl_run(cfg: RunConfig, rd: RunDir, progress: bool, before_step=None) -> None:
    from experiments.trl.train import run_trl

    run_trl(cfg, rd, progress=progress, before_step=before_step)


def _trl_preflight(cfg: RunConfig) -> None:
    """The GRPOConfig the run builds and NSRGRPOTrainer's refusals of it (no model is loaded)."""
    from experiments.trl.train import check_runnable

    check_runnable(cfg)


register(
    Backend(
        name="trl",
        runs="TRL 1.16.0's GRPOTrainer loop with nsr.trl.NSRGRPOTrainer (experiments/trl)",
        run=_trl_run,
        check=check_trl,
        preflight=_trl_preflight,
        identity=(*_METHOD, "model", "sft", "task", "trl", "logging.checkpoint_every", "logging.keep_checkpoint"),
        save_signal="USR1",  # experiments/trl/train.py: SAVE_SIGNAL
    )
)
