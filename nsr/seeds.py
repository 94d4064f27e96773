"""Seeds for ``torch.Generator``: every random stream of the repo (CPU testbed and OpenRLHF layer) is seeded here.

A stream's seed is a hash of what identifies it, e.g. ``derive_seed(seed, step, "rollout")`` or
``derive_seed("loss", seed, dp_rank, rl_step, micro_step)``. Hashing (not adding) keeps the streams of neighbouring
tuples unrelated, and the value depends only on the tuple, so a resumed run draws exactly what an uninterrupted one
would (no RNG state in a checkpoint).
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts) -> int:
    """A 63-bit seed from printable parts: the first 8 bytes of sha256(repr(parts)), little-endian, shifted right 1."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator(*parts, device: str | torch.device = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded with ``derive_seed(*parts)``."""
    return torch.Generator(device=device).manual_seed(derive_seed(*parts))
