"""The CPU testbed backend: a tiny GPT-2 learns Countdown-3 by SFT, then GRPO with any ``nsr`` objective.

    python -m experiments.run sweeps/presets/tiny-smoke.yaml            # CI-sized run, < 1 minute
    python -m experiments.run sweeps/presets/tiny.yaml loss.rule=nsr     # the demo / grid default

Modules: task (problems, exact verifier), model (GPT-2 builder, sampling, log-probs), sft (cached warm start),
evaluate (fixed held-out eval set -> eval.jsonl rows), train (the GRPO loop behind ``experiments.run``).

Threads: ``NSR_THREADS`` (default 1) sets torch's intra-op threads; it is not part of the config, so it never
changes a run id. The thread count changes float rounding, so bit-identical reruns need the same value: the
default of 1 makes a rerun on any machine match the committed CPU grid, and avoids OpenMP stalls on shared cores.
"""

from __future__ import annotations

import os

import torch


def set_threads() -> int:
    """Apply NSR_THREADS (default 1) to torch; returns the thread count."""
    raw = os.environ.get("NSR_THREADS", "")
    try:
        n = int(raw) if raw else 1
    except ValueError:
        raise ValueError(f"NSR_THREADS={raw!r} is not valid; allowed: a positive integer") from None
    if n < 1:
        raise ValueError(f"NSR_THREADS={raw!r} is not valid; allowed: a positive integer")
    torch.set_num_threads(n)
    return n
