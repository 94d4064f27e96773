"""The two OpenRLHF 0.11.2 Ray actors the NSR layer subclasses, and :func:`install` that swaps them in.

* ``NSRPolicyModelActor`` (policy DeepSpeed ranks): after OpenRLHF builds its ``ActorPPOTrainer``, replaces
  ``actor_loss_fn`` by :class:`~nsr.openrlhf.loss.NSRPolicyLoss` (same kwargs as ppo_actor.py:76-86, plus the run's
  ``args.nsr``), wraps the trainer's ``training_step`` so the loss writes its metrics into the micro-batch's
  ``experience.info`` (logged as ``train/nsr_*``), and tells the loss the RL step before each ``fit``. With
  ``--nsr.dgg`` it also gates the engine's optimizer steps (nsr/openrlhf/gate.py) and adds the RL step's
  ``nsr_dgg_gated`` / ``nsr_lm_head_grad_norm`` to the status ``fit`` returns; the gate's window rides in the
  checkpoint's client state. With ``--nsr.record_steps`` it writes each listed step's rollout batch before training on
  it (nsr/openrlhf/record.py).
* ``NSRPPOTrainer`` (the single controller): wraps ``compute_advantages_and_returns`` with the advantage
  interventions (nsr/openrlhf/interventions.py), appends one metrics.jsonl row per RL step
  (nsr/openrlhf/metrics.py), and at token level one ratio_bins.jsonl row next to it (the premise meter's counts,
  which the policy actor's ``fit`` sums over the ranks into its status), before OpenRLHF logs and checkpoints that
  step, and stops the run after
  ``--nsr.max_steps`` RL steps (:func:`cap_steps`): OpenRLHF itself runs until its prompts run out, which with
  dynamic filtering happens at an arm-dependent step.
* :class:`StopsAtSigterm` stands in for the controller's remote class in the driver: at SIGTERM (scancel, a
  preemption, ``experiments.run`` stopping its launcher) the driver kills the controller first, then Ray's own handler
  runs. Ray's handler exits and tears the local cluster down, which takes seconds; without the kill the controller
  went on sampling, training and checkpointing meanwhile (a 1-second CPU step ran two more steps and wrote their
  checkpoint), so a stopped run did not stop where it was.

The loss lives only inside the actor processes, so patching the driver's module globals would not reach it
(docs/cluster.md); the subclasses are importable classes that Ray re-imports in every worker, and the
config rides in ``strategy.args.nsr``. Imports openrlhf, Ray and DeepSpeed: cluster (or test stubs) only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from openrlhf.trainer import ppo_trainer
from openrlhf.trainer.ray import ppo_actor

from nsr.gating import GradientGate
from nsr.openrlhf.gate import EngineGate
from nsr.openrlhf.interventions import wrap_compute_advantages
from nsr.openrlhf.loss import NSRPolicyLoss
from nsr.openrlhf.mapping import level_of
from nsr.openrlhf.metrics import premise_logs, premise_row_from_logs, row_from_logs
from nsr.openrlhf.record import write_batch

# The originals, captured at import: install() may run more than once.
BasePolicyModelActor = ppo_actor.PolicyModelActor.__ray_actor_class__
BasePPOTrainer = ppo_trainer.PPOTrainer.__ray_actor_class__


def policy_loss_kwargs(args) -> dict:
    """The keyword arguments ActorPPOTrainer.__init__ gives PolicyLoss (ppo_actor.py:76-86; a contract test checks
    that they stay the same)."""
    return dict(
        clip_eps_low=args.actor.eps_clip_low_high[0],
        clip_eps_high=args.actor.eps_clip_low_high[1],
        dual_clip=args.actor.dual_clip,
        token_level_loss=args.actor.loss_agg_mode == "token-mean",
        policy_loss_type=args.actor.policy_loss_type,
        is_correction_level=args.algo.advantage.is_correction_level,
        is_correction_mode=args.algo.advantage.is_correction_mode,
        is_correction_gating=args.algo.advantage.is_correction_gating,
        is_correction_threshold=args.algo.advantage.is_correction_threshold,
    )


def make_loss(args, rank: int | None = None) -> NSRPolicyLoss:
    """The run's NSRPolicyLoss from OpenRLHF's parsed ``args`` (with ``args.nsr`` set by the launcher).

    ``rank`` seeds the loss's random stream and must be the data-parallel rank: the global rank is that rank because
    the launcher refuses ring attention and tensor parallelism (nsr/openrlhf/mapping.py check_parallelism)."""
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return NSRPolicyLoss(**policy_loss_kwargs(args), settings=args.nsr, seed=args.train.seed, rank=rank)


class NSRPolicyModelActor(BasePolicyModelActor):
    def init_model_from_pretrained(self, strategy, *args, **kwargs):
        super().init_model_from_pretrained(strategy, *args, **kwargs)
        self.install_nsr(strategy.args, self.trainer, self.checkpoint_states)

    def install_nsr(self, args, trainer, checkpoint_states=None) -> dict:
        """Swap ``trainer.actor_loss_fn`` and wrap ``trainer.training_step``; returns what was installed."""
        loss = make_loss(args)
        trainer.actor_loss_fn = loss
        original = trainer.training_step

        def training_step(experience, kl_ctl, step, loss_batch_info=None):
            loss.sink = experience.info  # read back by OpenRLHF (ppo_actor.py:386) after the loss call
            try:
                return original(experience, kl_ctl, step, loss_batch_info)
            finally:
                loss.sink = None

        trainer.training_step = training_step
        states = checkpoint_states or {}
        # RL steps already done (resume): the streams continue where an uninterrupted run would be
        self._nsr_rl_step = int(states.get("global_step", 0))
        self._nsr_trainer = trainer
        self._nsr_record = (args.nsr.recorded_steps(), args.nsr.record_dir)
        self._nsr_gate = None
        if args.nsr.dgg:
            gate = GradientGate(args.nsr.dgg_k, args.nsr.dgg_window)
            if "nsr_dgg" in states:
                gate.load_state_dict(states["nsr_dgg"])
            self._nsr_gate = EngineGate(trainer.actor.model, gate)
        return {"loss": type(loss).__name__, "rule": loss.cfg.rule, "level": loss.cfg.level, "rank": loss.rank}

    def fit(self, kl_ctl: float = 0):
        self._nsr_rl_step += 1
        loss = self._nsr_trainer.actor_loss_fn
        loss.start_step(self._nsr_rl_step)
        if self._nsr_gate is not None:
            self._nsr_gate.start_rollout()
        steps, record_dir = self._nsr_record
        if self._nsr_rl_step in steps:  # before training: the shuffle's RNG state is still the step's
            buffer = self._nsr_trainer.replay_buffer
            write_batch(record_dir, self._nsr_rl_step, loss.rank, buffer.items, buffer.sample_batch_size)
        status = super().fit(kl_ctl)
        if self._nsr_gate is not None:
            status.update(self._nsr_gate.metrics())
        if loss.premise is not None:
            status.update(premise_status(loss.premise))
        return status

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        if self._nsr_gate is not None:
            client_states = {**(client_states or {}), "nsr_dgg": self._nsr_gate.gate.state_dict()}
        return super().save_checkpoint(tag, client_states, metric_value, metric_key)


def premise_status(meter) -> dict[str, float]:
    """The RL step's premise meter (an nsr.PremiseMeter) as status scalars (nsr.openrlhf.metrics.premise_logs):
    its counts summed over the data-parallel ranks (one all-reduce, every rank calls it from ``fit``) and read once;
    then the meter restarts for the next step."""
    packed = torch.cat([meter.counts().reshape(-1), meter.tokens.reshape(1), meter.tokens_adv.reshape(1)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(packed)
    values = packed.tolist()
    meter.reset()
    counts, tokens, tokens_adv = torch.tensor(values[:-2]).reshape(meter.counts().shape).tolist(), *values[-2:]
    return premise_logs(counts, tokens, tokens_adv)


def cap_steps(generate_samples, steps_done, max_steps: int):
    """``generate_samples`` (SamplesGenerator's bound method) that reports an exhausted loader, without generating,
    once ``steps_done()`` reaches ``max_steps`` (0 = no cap): OpenRLHF's fit loop then ends the episode, and every
    later one, at exactly ``max_steps`` RL steps."""
    if not max_steps:
        return generate_samples

    def capped(**kwargs):
        if steps_done() >= max_steps:
            return [], None, 0, True  # (rollout samples, filter pass rate, prompts consumed, exhausted)
        return generate_samples(**kwargs)

    return capped


class NSRPPOTrainer(BasePPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.install_nsr(self.strategy.args)

    def install_nsr(self, args) -> None:
        self._nsr_step = 0
        self._nsr_done = 0  # RL steps finished (restored from the checkpoint on resume)
        self.samples_generator.generate_samples = cap_steps(
            self.samples_generator.generate_samples, lambda: self._nsr_done, args.nsr.max_steps
        )
        maker = self.experience_maker
        maker.compute_advantages_and_returns = wrap_compute_advantages(
            maker.compute_advantages_and_returns,
            args.nsr.advantages,
            args.train.seed,
            lambda: self._nsr_step,
        )
        self._nsr_metrics = Path(args.nsr.metrics_path) if args.nsr.metrics_path else None
        low, high = args.actor.eps_clip_low_high
        self._nsr_loss = args.nsr.loss_config(low, high, args.actor.dual_clip, level_of(args.actor.policy_loss_type))

    def init_checkpoint_states(self):
        states = super().init_checkpoint_states()
        self._nsr_done = int(states.get("global_step", 0))
        return states

    def train_step(self, rollout_samples, global_step: int):
        self._nsr_step = global_step  # seeds the advantage interventions (same value on resume)
        status, done = super().train_step(rollout_samples, global_step)
        self._nsr_done = done
        return status, done

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        # The row first: a crash before the checkpoint leaves a row the resumed run cuts (RunDir.truncate_logs).
        if self._nsr_metrics is not None and logs_dict:
            append_metrics_row(self._nsr_metrics, global_step, logs_dict)
            bins = premise_row_from_logs(global_step, logs_dict, self._nsr_loss)
            if bins is not None:  # the premise meter's row, next to metrics.jsonl
                append_row(self._nsr_metrics.with_name("ratio_bins.jsonl"), bins)
        super().save_logs_and_checkpoints(global_step, logs_dict, client_states)


def append_metrics_row(path: Path, step: int, logs: dict) -> dict:
    """Append the metrics.jsonl row of one RL step (one write, flushed), as RunDir.append does."""

    return append_row(path, row_from_logs(step, logs))


def append_row(path: Path, row: dict) -> dict:
    """Append one JSON line to ``path`` (one write, flushed and synced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return row


class StopsAtSigterm:
    """A remote actor class whose every actor this process kills at SIGTERM (:func:`kill_at_sigterm`), made with
    ``.remote(...)`` or ``.options(...).remote(...)``; everything else (``__ray_actor_class__``) is the wrapped
    class's. OpenRLHF 0.11.2's ``train()`` creates its controller with ``PPOTrainer.remote(...)`` (a contract test
    reads that call)."""

    def __init__(self, actor_class):
        self.actor_class = actor_class

    def __getattr__(self, name):
        return getattr(self.actor_class, name)

    def options(self, **options):
        return StopsAtSigterm(self.actor_class.options(**options))

    def remote(self, *args, **kwargs):
        handle = self.actor_class.remote(*args, **kwargs)
        kill_at_sigterm(handle)
        return handle


def kill_at_sigterm(handle) -> None:
    """From now on, SIGTERM kills the actor ``handle`` (no restart) and then does what it did before: Ray's driver
    handler (``sys.exit``, then the teardown), another handler, or the default action. Main thread only (Python's
    rule for signal handlers); elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)  # None: a handler set outside Python, put back as the default

    def on_sigterm(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        with contextlib.suppress(Exception):  # already dead, Ray gone: nothing left to stop
            ray.kill(handle, no_restart=True)
            print("nsr.openrlhf: SIGTERM: stopped the controller, then Ray's shutdown", file=sys.stderr, flush=True)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action (or a handler set outside Python): end as it would
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)


def install() -> None:
    """Make OpenRLHF's CLI build our actors: it reads ``ppo_actor.PolicyModelActor`` at exec time (runpy runs it
    after this) and imports ``ppo_trainer.PPOTrainer`` inside ``train()``; the controller is killed at SIGTERM
    (:class:`StopsAtSigterm`)."""
    ppo_actor.PolicyModelActor = ray.remote(num_gpus=1)(NSRPolicyModelActor)
    ppo_trainer.PPOTrainer = StopsAtSigterm(ray.remote(NSRPPOTrainer))
