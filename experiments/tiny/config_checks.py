"""Tiny-backend checks of a RunConfig, run at its construction (before any run folder exists): the model and task
registries, the sizes a CPU can hold, how the rollout splits into minibatches. Each raises ConfigError naming the key
and the allowed values."""

from __future__ import annotations

from experiments.config_errors import check_field
from experiments.models.tiny import MODELS
from experiments.tasks.countdown import TASKS, check_task_fits

TINY_MAX_PARAMS = 10**8
"""tiny backend: 12 x n_layer x d_model^2 at most (weights + Adam state ~1.6 GB in float32 on a CPU)."""
TINY_MAX_SEQUENCES = 2**17
"""tiny backend: sequences in one batch (a rollout's prompts x samples, an eval's prompts x samples); each
batch is generated at once, so this bounds the memory a step needs (a few GB at the default width)."""


def check_sizes(cfg) -> None:
    """What the tiny backend can hold on a CPU: the model's size and the batches it generates at once."""
    m, r, e = cfg.model, cfg.rollout, cfg.eval
    params = 12 * m.n_layer * m.d_model**2
    allowed = f"12 x n_layer x d_model^2 <= {TINY_MAX_PARAMS:.0e} (a model the tiny backend trains on a CPU)"
    check_field("model", "d_model", params <= TINY_MAX_PARAMS, allowed, m.d_model)
    allowed = f"prompts_per_step x samples_per_prompt <= {TINY_MAX_SEQUENCES} (one batch on a CPU)"
    batch = r.prompts_per_step * r.samples_per_prompt
    check_field("rollout", "samples_per_prompt", batch <= TINY_MAX_SEQUENCES, allowed, r.samples_per_prompt)
    allowed = f"eval.n_prompts x n_samples <= {TINY_MAX_SEQUENCES} (one batch on a CPU)"
    check_field("eval", "n_samples", e.n_prompts * e.n_samples <= TINY_MAX_SEQUENCES, allowed, e.n_samples)


def check_config(cfg) -> None:
    """Tiny-backend checks of a RunConfig, run at its construction (before any run folder exists).

    Raises ConfigError naming the key and the allowed values.
    """
    check_sizes(cfg)
    samples = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    minibatches = cfg.train.minibatches
    allowed = f"a divisor of prompts_per_step x samples_per_prompt = {samples}"
    check_field("train", "minibatches", samples % minibatches == 0, allowed, minibatches)
    check_field("model", "name", cfg.model.name in MODELS, ", ".join(MODELS), cfg.model.name)
    check_field("task", "name", cfg.task.name in TASKS, ", ".join(TASKS), cfg.task.name)
    check_task_fits(cfg, TASKS[cfg.task.name])
