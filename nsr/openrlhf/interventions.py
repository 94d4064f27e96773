"""Advantage interventions inside OpenRLHF's controller (docs/method.md intervention 1 and the related controls).

OpenRLHF computes advantages once per RL step in ``RemoteExperienceMaker.compute_advantages_and_returns``, in the
PPOTrainer controller actor, so every epoch of the step sees the same values (as ``nsr.compute_advantages`` in the
CPU testbed). :func:`wrap_compute_advantages` wraps that bound method:

* ``random_reward``: before it, each response's reward becomes a seeded coin flip (Bernoulli(0.5));
* then OpenRLHF's own estimator runs (group_norm, or dr_grpo for ``no_std``: chosen by the argv builder);
* ``positive_only``: after it, negative advantages are set to 0 (WAPO);
* ``noise``: after it, one eps ~ N(0, 1) per response: A (1 + sigma eps) (mult) or A + sigma eps (add).

Draws come from one generator seeded by (train seed, RL step), taken in the rollout's original sample order
(``experience.index``), coin flips first, then noise: the draws of ``nsr.compute_advantages`` with the same
generator, whatever the micro-batch split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nsr import seeds
from nsr.config import AdvantageConfig


def _order(experiences) -> list[torch.Tensor]:
    """Per experience, the (B_i,) original sample indices; checks they cover 0..N-1 exactly once."""
    idx = [torch.as_tensor(e.index, dtype=torch.long) for e in experiences]
    flat = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
    if not torch.equal(flat.sort().values, torch.arange(flat.numel())):
        raise ValueError("experience.index must cover the rollout's samples 0..N-1 exactly once")
    return idx


def transform_rewards(experiences, acfg: AdvantageConfig, generator: torch.Generator) -> None:
    """random_reward: replace ``experience.rewards`` (B_i,) by coin flips (in place); other kinds: nothing."""
    if acfg.kind != "random_reward":
        return
    idx = _order(experiences)
    n = sum(len(i) for i in idx)
    flips = torch.rand(n, generator=generator, dtype=torch.float32) < 0.5  # nsr.advantages.random_reward's draw
    for e, i in zip(experiences, idx):
        e.rewards = flips[i].to(device=e.rewards.device, dtype=torch.promote_types(e.rewards.dtype, torch.float32))


def transform_advantages(experiences, acfg: AdvantageConfig, generator: torch.Generator) -> None:
    """positive_only and noise on ``experience.advantages`` (B_i, A), in place (masked tokens untouched)."""
    if acfg.kind == "positive_only":
        for e in experiences:
            e.advantages = e.advantages.clamp(min=0.0)
    if acfg.noise > 0:
        idx = _order(experiences)
        n = sum(len(i) for i in idx)
        eps = torch.randn(n, generator=generator, dtype=torch.float32)  # docs/method.md 1b: one eps per response
        for e, i in zip(experiences, idx):
            z = (acfg.noise * eps[i]).to(e.advantages.device, e.advantages.dtype)[:, None]
            if acfg.noise_mode == "mult":
                e.advantages = e.advantages * (1.0 + z)
            else:
                e.advantages = e.advantages + z * e.action_mask.to(e.advantages.dtype)


def step_generator(seed: int, rl_step: int) -> torch.Generator:
    return seeds.generator("advantages", seed, rl_step)


def wrap_compute_advantages(original: Callable, acfg: AdvantageConfig, seed: int, rl_step: Callable[[], int]):
    """``original`` (a bound ``compute_advantages_and_returns``) with the interventions of ``acfg`` around it.

    ``rl_step()`` returns the step being made (the controller's global_step), so a resumed run draws the same.
    Returns ``original`` itself when ``acfg`` asks for nothing OpenRLHF does not do already.
    """
    if acfg.kind not in ("random_reward", "positive_only") and acfg.noise == 0:
        return original

    def compute_advantages_and_returns(experiences):
        g = step_generator(seed, rl_step())
        transform_rewards(experiences, acfg, g)
        experiences = original(experiences)
        transform_advantages(experiences, acfg, g)
        return experiences

    return compute_advantages_and_returns
