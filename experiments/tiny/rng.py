"""Seeded generators: every random draw of the testbed comes from ``generator(seed, step, purpose)``.

Deriving a fresh generator per (seed, step, purpose) means a checkpoint needs no RNG state: a run resumed at step
s draws exactly what an uninterrupted run draws from step s + 1 on.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts) -> int:
    """A 63-bit seed from any printable parts, e.g. ``derive_seed(seed, step, "rollout")``.

    The same idea as nsr.openrlhf.settings.stream_seed, but it hashes ``repr(parts)``: kept apart, because another
    encoding would change every draw of the committed CPU grid."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))
