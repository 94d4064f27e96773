"""Give freed memory back to the operating system between training steps (glibc's allocator).

A training step allocates and frees the same large tensors again and again (activations, gradients, the LM head's
tiles). glibc serves most of them from its heaps and keeps the freed pages, so a SmolLM2 trl run's resident set
grows past what its live tensors need. :func:`trim` asks glibc to hand every free page of its heaps back
(``malloc_trim(0)``); the trl backend calls it after each optimizer step (experiments/trl/train.py). Measured on the
4-update bench (docs/testbed.md, "Speed"): peak RSS 4.06 GB with it, 4.13 GB without, at the same step time. Fixing
glibc's mmap threshold low (64 KiB) instead held the peak at 3.79 GB but made the step 1.47x slower: every mapped
block comes back zeroed by the kernel at each allocation. Numbers are unchanged (only where memory comes from); on
other C libraries this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
        lib.malloc_trim  # noqa: B018  (glibc only: musl and macOS have none)
    except (OSError, AttributeError):
        return None
    return lib


def trim() -> bool:
    """Return the free pages of glibc's heaps to the system now; True if glibc released any."""
    lib = _libc()
    return bool(lib.malloc_trim(0)) if lib is not None else False
