"""torch's intra-op thread count for a run in this process, from ``NSR_THREADS`` (default 1).

The thread count is not part of the config, so it never changes a run id. It changes float rounding, so bit-identical
reruns need the same value: the default of 1 makes a rerun on any machine match the committed CPU grid, and avoids
OpenMP stalls on shared cores.
"""

from __future__ import annotations

import os

import torch

from experiments.config_errors import ConfigError


def set_threads() -> int:
    """Apply NSR_THREADS (default 1) to torch; returns the thread count."""
    n = threads()
    torch.set_num_threads(n)
    return n


def threads() -> int:
    """The thread count NSR_THREADS asks for (default 1); ConfigError naming the variable if it is not one."""
    raw = os.environ.get("NSR_THREADS", "")
    try:
        n = int(raw) if raw else 1
    except ValueError:
        raise ConfigError(f"NSR_THREADS={raw!r} is not valid; allowed: a positive integer") from None
    if n < 1:
        raise ConfigError(f"NSR_THREADS={raw!r} is not valid; allowed: a positive integer")
    return n
