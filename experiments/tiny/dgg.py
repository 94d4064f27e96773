"""Dynamic Gradient Gating (DGG) for the tiny testbed's update loop (docs/method.md, "Related methods").

Source: "When to Stop Reusing: Dynamic Gradient Gating for Sample-Efficient RLVR" (arXiv 2605.19425). When a
rollout batch is reused for several updates, a harmful update shows as a surge of the ``lm_head`` gradient norm
("Disproportionate Weight Divergence") while the inner layers stay calm; DGG watches that norm in real time and
skips (gates) the optimizer step of an update whose norm surges, before the optimizer sees the gradient.

Criterion: the paper's exact threshold is not public in a form we could check, so this is docs/method.md's
[choice]: gate an update whose lm_head gradient norm exceeds ``k`` x the median of the previous ``window``
updates' norms (k = 3, window = 20 by default); the first update of each rollout is never gated (its ratios are
all 1, so it is the on-policy reference). Every measured norm, gated or not, enters the window; a non-finite norm
is always gated (unless first) and stays out of the window. A gated update changes neither the weights nor the
optimizer state (Adam's moments and step count).

The tiny GPT-2 ties its embeddings, so the output projection *is* the token-embedding matrix: the norm is that of
the tied matrix's gradient (output projection and embedding lookup together), taken before gradient clipping.

OpenRLHF actor (ZeRO): not built; reachable with an actor-level patch, not with the loss subclass. OpenRLHF
0.11.2's ``ActorPPOTrainer.training_step`` calls ``strategy.backward`` (``engine.backward``) and then
``strategy.optimizer_step`` (``engine.step``). Under ZeRO-2/3 the lm_head gradient is reduced into partitions, so
``param.grad`` does not hold it; ``deepspeed.utils.safe_get_full_grad(lm_head.weight)`` gathers it (one all-gather
per optimizer step, only at the gradient-accumulation boundary, where the norm is complete). Gating would then
replace ``engine.step()`` by ``engine.zero_grad()`` on every rank at once (the decision must be the same
everywhere, which the gathered norm gives) and skip the LR scheduler tick. Both fit the ``training_step`` wrapper
that nsr/openrlhf/actors.py already installs; see docs/method.md.
"""

from __future__ import annotations

import math
import statistics

import torch


class GradientGate:
    """Running-median gate on one gradient norm per update: ``gate(norm, first)`` says whether to skip it."""

    def __init__(self, k: float = 3.0, window: int = 20):
        if not (isinstance(k, (int, float)) and math.isfinite(k) and k > 1):
            raise ValueError(f"train.dgg_k={k!r} is not valid; allowed: a finite number > 1")
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"train.dgg_window={window!r} is not valid; allowed: an integer >= 1")
        self.k = float(k)
        self.window = window
        self.history: list[float] = []
        """The previous ``window`` finite norms, oldest first."""

    def threshold(self) -> float:
        """k x median of the window; inf while the window is empty (nothing to compare with yet)."""
        return self.k * statistics.median(self.history) if self.history else math.inf

    def gate(self, norm: float, first: bool) -> bool:
        """True if the update with this norm is to be skipped; records the norm either way."""
        finite = math.isfinite(norm)
        gated = not first and (not finite or norm > self.threshold())
        if finite:
            self.history = (self.history + [norm])[-self.window :]
        return gated

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = [float(v) for v in state["history"]][-self.window :]


def lm_head_grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of the output projection's gradient (the tied embedding matrix in the tiny GPT-2); 0 if none."""
    grad = model.get_output_embeddings().weight.grad
    return 0.0 if grad is None else float(torch.linalg.vector_norm(grad.float()))
