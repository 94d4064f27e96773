"""Dynamic Gradient Gating on the OpenRLHF actor's DeepSpeed engine (``--nsr.dgg``): measure, decide, skip.

The criterion is :class:`nsr.gating.GradientGate`, the one the tiny loop uses (k x the running median of the lm_head
gradient norm over the previous ``window`` updates; the first optimizer step of each rollout never gated).
:class:`EngineGate` wraps the engine's ``step`` (OpenRLHF 0.11.2's ``ActorPPOTrainer.training_step`` calls
``strategy.optimizer_step`` -> ``engine.step()`` after every micro-batch's backward). At a gradient-accumulation
boundary, where the gradient is complete, and only there:

1. **Measure**: the norm of the full lm_head gradient, from the pieces the ZeRO optimizer holds: each rank sums
   the squares of its own fragment (ZeRO-1/2: the parameter's slice of the reduced gradient partition, DeepSpeed's
   ``_hp_mapping`` fragment, as ``safe_get_full_grad`` reads it; ZeRO-3: the rank's fp32 gradient partition,
   ``safe_get_local_grad``, without its padding) and one scalar is all-reduced over the partition group. The full
   gradient is never assembled (for a 7B model's lm_head it would be 2.2 GB of fp32 on every rank); the test
   checks the value against ``safe_get_full_grad``'s tensor. The output embedding's weight is the tied embedding
   matrix where the model ties them. The norm is taken before gradient clipping and read on the host: one sync per
   optimizer step (the decision needs it), none in the loss. The scalar comes from one all-reduce, so every rank
   holds the same float and takes the same decision.
2. **Decide**: ``gate.gate(norm, first)``.
3. **Skip**: DeepSpeed's own skipped-step path, the one it takes on an fp16 overflow: the ZeRO optimizer's
   ``overflow`` flag is set for this step, so ``optimizer.step`` clears the gradients without touching weights or
   Adam's state, the engine counts a skipped step and does not tick the LR scheduler. ``engine.was_step_applied()``
   is checked afterwards: an applied gated step raises (a DeepSpeed that no longer honours the flag fails loudly
   instead of training ungated). Under fp16 the loss scaler would also halve its scale on a skipped step, so the
   launcher refuses ``--nsr.dgg`` with fp16 (nsr/openrlhf/launch.py); the cluster presets train in bf16.

Not gated: a micro-batch that is not at a boundary (its gradient is partial). ``engine.get_global_grad_norm()``
(OpenRLHF's ``actor_grad_norm``) is not updated by a skipped step; the LR schedule does not tick on it, so a run that
gates g steps ends g ticks short of the schedule's end (as DeepSpeed's fp16 overflow skips do); an EMA model, if
any, still averages after it (with unchanged weights). Refused by the launcher, because the gate could not act as
stated: a frozen lm_head (LoRA, 4-bit), Muon (DeepSpeed updates its momentum while reducing gradients, before the
step that is skipped), DeepSpeed's BF16_Optimizer (ZeRO-1 with fp32 gradient accumulation), deepcompile (another
gradient path) and OpenRLHF's dynamic batching (not tested). Per RL step the actor adds ``nsr_dgg_gated`` (gated
optimizer steps) and ``nsr_lm_head_grad_norm`` (their mean norm, gated or not) to the status it returns; the gate's
window is saved in the checkpoint's client state (``nsr_dgg``) and restored on resume.
"""

from __future__ import annotations

import contextlib
import math

import torch

from nsr.gating import GradientGate


def output_weight(engine):
    """The lm_head (output embedding) weight of the engine's model."""
    return engine.module.get_output_embeddings().weight


def lm_head_grad_norm(engine) -> float:
    """L2 norm of the full gradient of the output projection, from each rank's ZeRO fragment (module doc)."""
    import torch.distributed as dist

    weight = output_weight(engine)
    if hasattr(weight, "ds_id"):  # ZeRO-3: this rank's fp32 partition, padding cut off
        opt = weight._z3_optimizer
        local = opt.get_local_fp32_grad_for_param(weight)
        group = opt._get_param_partition_group(weight)
        if local is None:
            raise RuntimeError("--nsr.dgg: the lm_head weight has no gradient (is it frozen?)")
        local = local.flatten()
        start = local.numel() * dist.get_rank(group=group)
        local = local[: max(0, min(local.numel(), weight.ds_numel - start))]
    elif hasattr(weight, "_dp_group"):  # ZeRO-1/2: the parameter's slice of this rank's gradient partition
        group = weight._dp_group
        mapping = weight._hp_mapping  # None where this rank's partition holds no piece of the parameter
        if mapping is None:
            local = torch.zeros(0, device=weight.device)
        else:
            local = mapping.get_lp_grad_fragment(weight._index_in_param_group).flatten()
    else:
        raise RuntimeError(
            "--nsr.dgg: the lm_head weight is not managed by a ZeRO optimizer (no ds_id / _dp_group); allowed: "
            "--ds.zero_stage 1, 2 or 3 with a trainable lm_head"
        )
    squares = local.float().square().sum().reshape(1)
    dist.all_reduce(squares, group=group)
    return float(squares.sqrt())


@contextlib.contextmanager
def skipped_step(optimizer):
    """Inside: the ZeRO optimizer's next ``step`` takes DeepSpeed's overflow path (no update, gradients cleared)."""
    optimizer.overflow = True
    # where DeepSpeed checks for an overflow itself (fp16, or bf16 with check_grad_overflow) it would reset the flag
    optimizer._check_overflow = lambda *args, **kwargs: setattr(optimizer, "overflow", True)
    try:
        yield
    finally:
        del optimizer._check_overflow  # the class's method again
        optimizer.overflow = False


class EngineGate:
    """Wraps ``engine.step`` with the gate. ``start_rollout()`` before each RL step's training; per update of the
    rollout ``norms`` and ``gated`` (lists); ``metrics()`` the RL step's two numbers."""

    def __init__(self, engine, gate: GradientGate):
        for name in ("overflow", "_check_overflow"):
            if not hasattr(engine.optimizer, name):
                raise ValueError(
                    f"--nsr.dgg needs a DeepSpeed ZeRO optimizer (it has no {name!r}: "
                    f"{type(engine.optimizer).__name__}); allowed: --ds.zero_stage 1, 2 or 3"
                )
        if not output_weight(engine).requires_grad:
            raise ValueError("--nsr.dgg: the lm_head weight is frozen (LoRA?), so it has no gradient to watch")
        self.engine, self.gate = engine, gate
        self.norms: list[float] = []
        self.gated: list[bool] = []
        self._step = engine.step
        engine.step = self.step

    def start_rollout(self) -> None:
        self.norms, self.gated = [], []

    def step(self, *args, **kwargs):
        engine = self.engine
        if not engine.is_gradient_accumulation_boundary():
            return self._step(*args, **kwargs)
        norm = lm_head_grad_norm(engine)
        gated = self.gate.gate(norm, first=not self.norms)
        self.norms.append(norm)
        self.gated.append(gated)
        if not gated:
            return self._step(*args, **kwargs)
        with skipped_step(engine.optimizer):
            out = self._step(*args, **kwargs)
        if engine.was_step_applied():
            raise RuntimeError(
                f"--nsr.dgg: DeepSpeed applied a gated update (lm_head grad norm {norm:.4g} > threshold); this "
                "DeepSpeed does not honour the optimizer's overflow flag, so DGG cannot skip steps with it"
            )
        return out

    def metrics(self) -> dict[str, float]:
        finite = [v for v in self.norms if math.isfinite(v)]
        return {
            "nsr_dgg_gated": float(sum(self.gated)),
            "nsr_lm_head_grad_norm": sum(finite) / len(finite) if finite else float("nan"),
        }
