"""Seeded generators: every random draw of the testbed comes from ``generator(seed, step, purpose)``.

Deriving a fresh generator per (seed, step, purpose) means a checkpoint needs no RNG state: a run resumed at step
s draws exactly what an uninterrupted run draws from step s + 1 on. The hashing is ``nsr.seeds`` (one function for
the testbed and the OpenRLHF layer).
"""

from __future__ import annotations

from nsr.seeds import derive_seed, generator

__all__ = ["derive_seed", "generator"]
