"""Recompute each decoder layer's MLP in the backward instead of keeping its activations (NSRGRPOTrainer's
``checkpoint_mlp``).

A Llama-style layer keeps, per token, the MLP's input and its gate, up and gated products (4 tensors, three of them
of the intermediate width) for the backward: for SmolLM2-135M (30 layers, 576 -> 1536) about 0.6 MB of the 1.3 MB of
float32 activations a training token holds. With this option each MLP runs under torch's non-reentrant activation
checkpoint: its forward keeps only its input, and the backward runs the MLP's forward once more on that input before
its own backward. The recomputation runs the same kernels on the same tensors, so the gradients, and every number of
the run, are bit for bit those without it (tests/test_trl_fast.py); what it costs is one more MLP forward per update.
Generation and every pass without gradients run the MLP as before.

Unlike TRL's ``gradient_checkpointing`` (every layer recomputed, which the shared prompt cannot use), this leaves
attention and the key/value cache alone.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_SUBCLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    """``cls`` with its forward under activation checkpointing while gradients are recorded (one subclass per class,
    so a deep copy of the model, its state dict and its parameter names are unchanged)."""
    if cls not in _SUBCLASSES:

        def forward(self, *args, **kwargs):
            if torch.is_grad_enabled() and self.training:
                return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)
            return cls.forward(self, *args, **kwargs)

        _SUBCLASSES[cls] = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "_nsr_base": cls})
    return _SUBCLASSES[cls]


def mlp_blocks(model: nn.Module) -> list[nn.Module]:
    """The MLP of every decoder layer of ``model``: the ``mlp`` child of each module that also has a ``self_attn``
    child (transformers' Llama, Qwen2, Qwen3, Mistral layers and their kin)."""
    out = []
    for module in model.modules():
        mlp, attn = getattr(module, "mlp", None), getattr(module, "self_attn", None)
        if isinstance(mlp, nn.Module) and isinstance(attn, nn.Module):
            out.append(mlp)
    return out


def checkpoint_mlps(model: nn.Module) -> int:
    """Put every decoder layer's MLP of ``model`` under activation checkpointing (module doc); the number of MLPs.
    Raises ValueError if the model has none this recognises."""
    blocks = mlp_blocks(model)
    if not blocks:
        raise ValueError(
            f"checkpoint_mlp=True is not valid with a {type(model).__name__}: it has no decoder layer with `mlp` and "
            "`self_attn` children to checkpoint; allowed: checkpoint_mlp=False, or a transformers decoder model "
            "(Llama, Qwen2, Qwen3, Mistral, ...)"
        )
    for mlp in blocks:
        if not hasattr(type(mlp), "_nsr_base"):
            mlp.__class__ = _checkpointed_class(type(mlp))
    return len(blocks)
