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


def check_config(cfg) -> None:
    """Tiny-backend checks of a RunConfig, run at its construction (before any run folder exists).

    Raises ConfigError naming the key and the allowed values.
    """
    from experiments.config import check_field
    from experiments.tiny.model import MODELS
    from experiments.tiny.task import TASKS

    samples = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    minibatches = cfg.train.minibatches
    allowed = f"a divisor of prompts_per_step x samples_per_prompt = {samples}"
    check_field("train", "minibatches", samples % minibatches == 0, allowed, minibatches)
    check_field("model", "name", cfg.model.name in MODELS, ", ".join(MODELS), cfg.model.name)
    check_field("task", "name", cfg.task.name in TASKS, ", ".join(TASKS), cfg.task.name)
    check_task_fits(cfg, TASKS[cfg.task.name])


def check_task_fits(cfg, task) -> None:
    """The answers and held-out split of a tiny task fit the config (tiny and trl-tiny backends share this)."""
    from experiments.config import check_field
    from experiments.tiny.task import N_POSITIONS

    new = cfg.rollout.max_new_tokens
    allowed = f">= {task.answer_len} (a correct {task.name} answer and its EOS)"
    check_field("rollout", "max_new_tokens", new >= task.answer_len, allowed, new)
    allowed = f"<= {N_POSITIONS - task.prompt_len} (the tiny model's context)"
    check_field("rollout", "max_new_tokens", task.prompt_len + new <= N_POSITIONS, allowed, new)
    allowed = f"<= {task.n_eval} (the held-out split of {task.name})"
    check_field("eval", "n_prompts", cfg.eval.n_prompts <= task.n_eval, allowed, cfg.eval.n_prompts)
