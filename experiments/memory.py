"""Return freed memory to the operating system while a run trains (glibc's allocator).

A training step allocates and frees the same large tensors again and again (activations, gradients, the LM head's
tiles). glibc raises its mmap threshold after each large free (up to 32 MiB), so later tensors come from the heap,
whose freed pages stay with the process: a SmolLM2 trl run's resident set grew to 4.0-4.5 GB at rest between steps,
where the live tensors need 2.3 GB (docs/testbed.md, "Speed"). Fixing the threshold at 64 KiB serves every
allocation of 64 KiB or more by its own mapping, returned when freed. Numbers are unchanged (only where memory comes
from); on other C libraries this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number (malloc.h)."""
THRESHOLD = 64 * 1024


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 64 KiB for this process (environment ``MALLOC_MMAP_THRESHOLD_`` does the same
    from the start); True if the allocator took it."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD))
