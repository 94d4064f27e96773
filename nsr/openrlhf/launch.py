"""Run OpenRLHF 0.11.2's PPO/GRPO trainer with an NSR clip rule: OpenRLHF's own CLI, unchanged, plus --nsr.* flags.

    python -m nsr.openrlhf.launch --nsr.rule nsr --nsr.delta 0.2 [--nsr.metrics_path RUN/metrics.jsonl] \\
        <the flags of python -m openrlhf.cli.train_ppo_ray, OpenRLHF 0.11.2>

One node: run it on the node (OpenRLHF starts a local Ray). SLURM / several nodes: start Ray on the nodes
(slurm/ray_cluster.py), then run it on the head node with RAY_ADDRESS set; every node imports ``nsr`` from the same
installed package (``pip install -e ./nsr -e .`` into a venv on the shared file system). Normally it is not typed by
hand: ``python -m experiments.run <preset or sweep>`` builds the command (experiments/openrlhf/argv.py), and
``python -m experiments.run --sweep S --dry-run`` prints it.

What it does, in order (docs/cluster.md):
1. refuses any openrlhf but 0.11.2;
2. splits off the --nsr.* flags (nsr/openrlhf/settings.py) and parses the rest with OpenRLHF's own parser and checks
   (nsr/openrlhf/cli.py), then refuses combinations the layer does not support (nsr/openrlhf/mapping.py) and a
   rule that needs stale ratios with one optimizer step per rollout (:func:`check_schedule`), before Ray starts;
3. swaps in the actor subclasses (nsr/openrlhf/actors.py) and wraps ``openrlhf.utils.get_strategy`` so that
   ``args.nsr`` is set on the strategy that is pickled to every Ray actor (with ``--nsr.fp32``, on a CPU run only,
   also ``args.ds.param_dtype = "fp32"``, which the CPU shim maps to float32); the controller is killed at SIGTERM
   (``actors.StopsAtSigterm``: a stopped run stops where it is, with no more steps or checkpoints while Ray shuts
   down), for which Ray's driver checks for signals every 0.1 s (:data:`SIGNAL_CHECK_ENV`);
4. runs ``openrlhf.cli.train_ppo_ray`` as ``__main__`` with runpy: OpenRLHF's parse, checks, ray.init and train().

With ``NSR_OPENRLHF_CPU=1`` (CPU_ENV; set by the backend for a CPU preset only: ``openrlhf.cpu``) it first switches
on the CPU shim (nsr/openrlhf/cpu_shim.py), which starts the local Ray OpenRLHF then uses.
"""

from __future__ import annotations

import os
import runpy
import sys

from nsr.openrlhf import mapping
from nsr.openrlhf.reference import SUPPORTED_VERSION, installed_version
from nsr.openrlhf.settings import NSRSettings

CLI_MODULE = "openrlhf.cli.train_ppo_ray"
CPU_ENV = "NSR_OPENRLHF_CPU"
"""Set to 1, it switches on nsr/openrlhf/cpu_shim.py (OpenRLHF's loop on a CPU); only a CPU preset
(``openrlhf.cpu: true``) sets it."""
FP32 = "fp32"
"""``args.ds.param_dtype`` of a ``--nsr.fp32`` run (set after OpenRLHF's parse, whose choices are bf16 and fp16)."""
EXIT_REFUSED = 2
"""Exit status of a refused command (as argparse's)."""
SIGNAL_CHECK_ENV = "RAY_get_check_signal_interval_milliseconds"
"""How often (ms) Ray's blocking ``get`` runs Python's signal handlers in the driver; ``main`` sets 100 unless set."""


class LaunchError(Exception):
    """A refused command; the message says which flag and what is allowed. ``main`` prints it and exits with
    status 2 (EXIT_REFUSED), as argparse does."""

    def __init__(self, msg: str):
        super().__init__(f"nsr.openrlhf.launch: error: {msg}")


def check_version() -> None:
    try:
        found = installed_version()
    except Exception:  # PackageNotFoundError
        found = None
    if found != SUPPORTED_VERSION:
        raise LaunchError(
            f"openrlhf=={found} is installed; the NSR layer is written and tested against openrlhf=="
            f"{SUPPORTED_VERSION} only (its PolicyLoss signature and CLI flags change between releases): "
            f"pip install openrlhf=={SUPPORTED_VERSION}"
        )


def check_schedule(args, loss) -> None:
    """Refuse a rule that needs stale ratios (nsr.needs_stale_ratios) with one optimizer step per rollout: OpenRLHF's
    actor recomputes the old log-probs of every sample before the update (they are never vLLM's), so with
    ``--rollout.batch_size`` x ``--rollout.n_samples_per_prompt`` / ``--train.batch_size`` x ``--train.max_epochs``
    <= 1 every ratio is 1, no token is clipped and the rule's update is the hard clip's."""
    from nsr import needs_stale_ratios

    samples = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    steps = samples / args.train.batch_size * args.train.max_epochs
    if steps <= 1 and needs_stale_ratios(loss):
        raise LaunchError(
            f"--rollout.batch_size {args.rollout.batch_size} x --rollout.n_samples_per_prompt "
            f"{args.rollout.n_samples_per_prompt} / --train.batch_size {args.train.batch_size} x --train.max_epochs "
            f"{args.train.max_epochs} = {steps:g} optimizer step per rollout with --nsr.rule {loss.rule}: the actor "
            "recomputes the old log-probs before the update, so every ratio is 1, no token is clipped and the rule "
            "equals the hard clip; allowed: more than one step per rollout (a smaller --train.batch_size or "
            "--train.max_epochs >= 2), or --nsr.allow_on_policy true to run it anyway"
        )


def check_args(args, settings: NSRSettings) -> None:
    """Refuse OpenRLHF settings the NSR layer does not support (args: OpenRLHF's parsed, hierarchized args)."""
    if args.train.async_enable:
        raise LaunchError(
            "--train.async_enable is not supported by the NSR layer (it subclasses the synchronous "
            "PPOTrainer); allowed: leave it off"
        )
    kind = settings.advantages.kind
    lo, hi = args.actor.eps_clip_low_high
    try:
        mapping.check_estimator(kind, args.algo.advantage.estimator)
        mapping.check_is_correction(settings.rule, args.algo.advantage.is_correction_level)
        mapping.check_parallelism(args.ds.ring_attn_size, args.ds.tensor_parallel_size)
        mapping.check_random_reward(kind, args.algo.dynamic_filtering_enable, args.reward.overlong_buffer_len)
        # the rule's full config, exactly as every actor will build it
        loss = settings.loss_config(lo, hi, args.actor.dual_clip, mapping.level_of(args.actor.policy_loss_type))
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if not settings.allow_on_policy:
        check_schedule(args, loss)
    if settings.dgg and args.ds.zero_stage not in (1, 2, 3):
        raise LaunchError(
            f"--nsr.dgg with --ds.zero_stage={args.ds.zero_stage}: DGG skips a step through the ZeRO optimizer's "
            "overflow path (nsr/openrlhf/gate.py); allowed: --ds.zero_stage 1, 2 or 3"
        )
    if settings.dgg and args.ds.param_dtype != "bf16":
        raise LaunchError(
            f"--nsr.dgg with --ds.param_dtype={args.ds.param_dtype}: a skipped step would also halve DeepSpeed's fp16 "
            "loss scale; allowed: --ds.param_dtype bf16"
        )
    if settings.dgg and settings.fp32:
        raise LaunchError(
            "--nsr.dgg with --nsr.fp32: DGG's skipped step (the ZeRO optimizer's overflow path, nsr/openrlhf/gate.py) "
            "is tested in bf16 only; allowed: --nsr.fp32 false"
        )
    if settings.fp32 and args.ds.param_dtype != "bf16":
        raise LaunchError(
            f"--nsr.fp32 with --ds.param_dtype {args.ds.param_dtype}: --nsr.fp32 sets the actor's dtype; allowed: "
            "leave --ds.param_dtype out"
        )
    if settings.dgg:
        check_dgg(args)
    if args.ckpt.load_enable and args.ckpt.max_num < 2:
        raise LaunchError(
            f"--ckpt.max_num={args.ckpt.max_num} with --ckpt.load_enable: OpenRLHF deletes the old checkpoint "
            "before writing the new one, so a preemption in between leaves nothing to resume from; allowed: >= 2"
        )


def check_dgg(args) -> None:
    """Settings under which --nsr.dgg could not gate as stated (nsr/openrlhf/gate.py): refused."""
    refused = [
        (
            args.ds.lora.rank > 0,
            f"--ds.lora.rank={args.ds.lora.rank}",
            "the lm_head is frozen, no gradient to watch",
            "0",
        ),
        (args.ds.load_in_4bit, "--ds.load_in_4bit", "the lm_head is frozen, no gradient to watch", "leave it off"),
        (
            args.actor.optim == "muon",
            "--actor.optim muon",
            "DeepSpeed updates Muon's momentum while reducing gradients, before the skipped step",
            "adam",
        ),
        (
            args.ds.zero_stage == 1 and args.ds.grad_accum_dtype == "fp32" and not args.ds.adam_offload,
            "--ds.grad_accum_dtype fp32 with --ds.zero_stage 1",
            "DeepSpeed then uses its BF16_Optimizer, which has no skipped-step path",
            "another stage or grad_accum_dtype",
        ),
        (args.ds.deepcompile, "--ds.deepcompile", "it reduces gradients on another path", "leave it off"),
        (
            args.train.dynamic_batch_enable,
            "--train.dynamic_batch_enable",
            "gating with dynamic batches is not tested",
            "leave it off",
        ),
    ]
    for bad, flag, why, allowed in refused:
        if bad:
            raise LaunchError(f"--nsr.dgg with {flag}: {why}; allowed: {allowed}")


def install(settings: NSRSettings) -> None:
    """Swap the actors and make every strategy carry ``args.nsr`` (driver side, before runpy)."""
    import openrlhf.utils

    from nsr.openrlhf import actors

    actors.install()
    original = getattr(openrlhf.utils.get_strategy, "__wrapped__", openrlhf.utils.get_strategy)

    def get_strategy(args):
        args.nsr = settings  # pickled with the strategy into every Ray actor
        if settings.fp32:  # the CPU shim maps it to float32 (cpu_shim.patch_fp32); DeepSpeed then enables no bf16/fp16
            args.ds.param_dtype = FP32
        return original(args)

    get_strategy.__wrapped__ = original
    openrlhf.utils.get_strategy = get_strategy  # the CLI does `from openrlhf.utils import get_strategy` at exec


def prepare(argv: list[str]) -> tuple[NSRSettings, list[str]]:
    """Every check of the command line, before Ray starts: (settings, OpenRLHF's argv). Raises LaunchError."""
    check_version()
    try:
        settings, rest = NSRSettings.parse(argv)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    from nsr.openrlhf.cli import CLIError, parse

    try:
        args = parse(rest)
    except CLIError as e:
        raise LaunchError(str(e)) from None
    check_args(args, settings)
    return settings, rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        settings, rest = prepare(argv)
        if settings.fp32 and os.environ.get(CPU_ENV) != "1":
            raise LaunchError(
                f"--nsr.fp32 without {CPU_ENV}=1: float32 is the CPU shim's (OpenRLHF 0.11.2's --ds.param_dtype takes "
                "bf16 or fp16); allowed: --nsr.fp32 on a CPU run (openrlhf.cpu=true), else --ds.param_dtype bf16"
            )
    except LaunchError as e:
        print(e, file=sys.stderr)
        raise SystemExit(EXIT_REFUSED) from None
    # The driver waits in ray.get(controller.fit) and runs Python's signal handlers only when Ray checks for signals
    # there, every second by default: at 0.1 s a SIGTERM kills the controller (actors.StopsAtSigterm) within a fraction
    # of a CPU step; an interval set by the user wins
    os.environ.setdefault(SIGNAL_CHECK_ENV, "100")
    if os.environ.get(CPU_ENV) == "1":
        from nsr.openrlhf import cpu_shim
        from nsr.openrlhf.cli import parse

        cpu_shim.install_driver(parse(rest))
    install(settings)
    sys.argv = [CLI_MODULE, *rest]
    runpy.run_module(CLI_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
