"""Dynamic Gradient Gating (DGG) in the tiny testbed's update loop (docs/method.md, "Related methods").

The criterion is :class:`nsr.gating.GradientGate` (k x the running median of the lm_head gradient norm; the first
update of each rollout never gated), the same object the OpenRLHF backend uses (nsr/openrlhf/gate.py). Here the
tiny loop measures the norm with :func:`lm_head_grad_norm` after ``backward`` and, for a gated update, skips
``optimizer.step()``: a gated update changes neither the weights nor the optimizer state (Adam's moments and step
count).

The tiny GPT-2 ties its embeddings, so the output projection *is* the token-embedding matrix: the norm is that of
the tied matrix's gradient (output projection and embedding lookup together), taken before gradient clipping.
"""

from __future__ import annotations

import torch

from nsr.gating import GradientGate

__all__ = ["GradientGate", "lm_head_grad_norm"]


def lm_head_grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of the output projection's gradient (the tied embedding matrix in the tiny GPT-2); 0 if none."""
    grad = model.get_output_embeddings().weight.grad
    return 0.0 if grad is None else float(torch.linalg.vector_norm(grad.float()))
