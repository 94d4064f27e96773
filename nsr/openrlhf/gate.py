"""Dynamic Gradient Gating on the OpenRLHF actor's DeepSpeed engine (``--nsr.dgg``): measure, decide, skip.

The criterion is :class:`nsr.gating.GradientGate`, the one the tiny loop uses (k x the running median of the lm_head
gradient norm over the previous ``window`` updates; the first optimizer step of each rollout never gated).
:class:`EngineGate` wraps the engine's ``step`` (OpenRLHF 0.11.2's ``ActorPPOTrainer.training_step`` calls
``strategy.optimizer_step`` -> ``engine.step()`` after every micro-batch's backward). At a gradient-accumulation
boundary, where the gradient is complete, and only there:

1. **Measure**: the full lm_head gradient with ``deepspeed.utils.safe_get_full_grad`` (under ZeRO-1/2 the gradient
   lives in the optimizer's partitions and is all-reduced into one tensor; under ZeRO-3 it is all-gathered). The
   output embedding's weight is the tied embedding matrix where the model ties them. The norm is taken before
   gradient clipping and read on the host: one sync per optimizer step (the decision needs it), none in the loss.
   Every rank gets the same tensor from the collective, so every rank takes the same decision.
2. **Decide**: ``gate.gate(norm, first)``.
3. **Skip**: DeepSpeed's own skipped-step path, the one it takes on an fp16 overflow: the ZeRO optimizer's
   ``overflow`` flag is set for this step, so ``optimizer.step`` clears the gradients without touching weights or
   Adam's state, the engine counts a skipped step and does not tick the LR scheduler. ``engine.was_step_applied()``
   is checked afterwards: an applied gated step raises (a DeepSpeed that no longer honours the flag fails loudly
   instead of training ungated). Under fp16 the loss scaler would also halve its scale on a skipped step, so the
   launcher refuses ``--nsr.dgg`` with fp16 (nsr/openrlhf/launch.py); the cluster presets train in bf16.

Not gated: a micro-batch that is not at a boundary (its gradient is partial). ``engine.get_global_grad_norm()``
(OpenRLHF's ``actor_grad_norm``) is not updated by a skipped step. Per RL step the actor adds ``nsr_dgg_gated`` (gated
optimizer steps) and ``nsr_lm_head_grad_norm`` (their mean norm, gated or not) to the status it returns; the gate's
window is saved in the checkpoint's client state (``nsr_dgg``) and restored on resume.
"""

from __future__ import annotations

import contextlib
import math

import torch

from nsr.gating import GradientGate


def lm_head_grad_norm(engine) -> float:
    """L2 norm of the full gradient of the engine module's output projection (ZeRO partitions assembled)."""
    from deepspeed.utils import safe_get_full_grad

    grad = safe_get_full_grad(engine.module.get_output_embeddings().weight)
    return 0.0 if grad is None else float(torch.linalg.vector_norm(grad.float()))


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
