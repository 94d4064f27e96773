"""Dynamic Gradient Gating (DGG): the gate's criterion, shared by every backend that gates updates.

Source: "When to Stop Reusing: Dynamic Gradient Gating for Sample-Efficient RLVR" (arXiv 2605.19425). When a
rollout batch is reused for several updates, a harmful update shows as a surge of the ``lm_head`` gradient norm
("Disproportionate Weight Divergence") while the inner layers stay calm; DGG watches that norm in real time and
skips (gates) the optimizer step of an update whose norm surges, before the optimizer sees the gradient.

Criterion: the paper's exact threshold is not public in a form we could check, so this is docs/method.md's
[choice]: gate an update whose lm_head gradient norm exceeds ``k`` x the median of the previous ``window``
updates' norms (k = 3, window = 20 by default); the first update of each rollout is never gated (its ratios are
all 1, so it is the on-policy reference). Every measured norm, gated or not, enters the window; a non-finite norm
is always gated (unless first) and stays out of the window.

Where the norm is measured and how an update is skipped is the backend's: experiments/tiny/train.py (the tiny loop)
and nsr/openrlhf/gate.py (a DeepSpeed engine under ZeRO). Pure Python: no torch, no host sync of its own.
"""

from __future__ import annotations

import math
import statistics


class GradientGate:
    """Running-median gate on one gradient norm per update: ``gate(norm, first)`` says whether to skip it."""

    def __init__(self, k: float = 3.0, window: int = 20):
        if not (isinstance(k, (int, float)) and not isinstance(k, bool) and math.isfinite(k) and k > 1):
            raise ValueError(f"dgg_k={k!r} is not valid; allowed: a finite number > 1")
        if not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
            raise ValueError(f"dgg_window={window!r} is not valid; allowed: an integer >= 1")
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
