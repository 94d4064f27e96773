"""openrlhf-backend checks of a RunConfig, run at its construction (before any run folder exists), and the batch
fields it derives then. How the fields fit together for OpenRLHF is checked by the argv builder
(experiments/openrlhf/argv.py) at preflight."""

from __future__ import annotations

import dataclasses

from experiments.config_errors import ConfigError, check_verifier_reward


def check_config(cfg) -> None:
    """openrlhf-backend checks of a RunConfig; ConfigError naming the key and the allowed values."""
    check_verifier_reward(cfg)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def derive_batch(cfg) -> dict:
    """With ``openrlhf.train_batch_size: 0`` (derived; the presets' setting): the batch ``train.minibatches`` implies,
    ``{"openrlhf": section}`` with ``train_batch_size`` = rollout.prompts_per_step x rollout.samples_per_prompt /
    train.minibatches and ``micro_train_batch_size`` lowered to that batch per rank where it is larger. Nothing
    (``{}``) when ``train_batch_size`` is set; a minibatch count that does not split the rollout over the ranks is
    refused, naming the counts that do."""
    o, r, t = cfg.openrlhf, cfg.rollout, cfg.train
    if o.train_batch_size:
        return {}
    samples = r.prompts_per_step * r.samples_per_prompt
    world = o.nodes * o.gpus_per_node
    if samples % t.minibatches or (samples // t.minibatches) % world:
        ok = [m for m in divisors(samples) if (samples // m) % world == 0]
        raise ConfigError(
            f"train.minibatches={t.minibatches} is not valid with openrlhf.train_batch_size=0 (derived: "
            f"rollout.prompts_per_step x rollout.samples_per_prompt / train.minibatches = {samples} / "
            f"{t.minibatches} samples per optimizer step, split over nodes x gpus_per_node = {world} rank(s)); "
            f"allowed: {', '.join(map(str, ok))}"
        )
    batch = samples // t.minibatches
    micro = min(o.micro_train_batch_size, batch // world)
    return {"openrlhf": dataclasses.replace(o, train_batch_size=batch, micro_train_batch_size=micro)}
