"""Group-relative advantages and the advantage interventions (docs/method.md, intervention 1 and related controls)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nsr.config import AdvantageConfig
from nsr.registry import ADVANTAGES

STD_EPS = 1e-9  # docs/method.md: A = (R - mean_g) / (std_g + 1e-9), as OpenRLHF 0.11.2's group_norm

Kind = Callable[[torch.Tensor, torch.Tensor, int, torch.Generator | None], torch.Tensor]


def _group_stats(rewards: torch.Tensor, inverse: torch.Tensor, n_groups: int):
    """Per-response group mean and unbiased group std (torch.std's default)."""
    counts = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    sums = torch.zeros_like(counts).index_add_(0, inverse, rewards)
    mean = (sums / counts)[inverse]
    sq = torch.zeros_like(counts).index_add_(0, inverse, (rewards - mean) ** 2)
    std = (sq / (counts - 1)).sqrt()[inverse]
    return mean, std


@ADVANTAGES.register("group_norm")
def group_norm(rewards, inverse, n_groups, generator):
    """GRPO/DAPO: (R - mean_g) / (std_g + 1e-9)."""
    mean, std = _group_stats(rewards, inverse, n_groups)
    return (rewards - mean) / (std + STD_EPS)


@ADVANTAGES.register("no_std")
def no_std(rewards, inverse, n_groups, generator):
    """Dr. GRPO: R - mean_g, no std normalization (docs/method.md 1a)."""
    mean, _ = _group_stats(rewards, inverse, n_groups)
    return rewards - mean


@ADVANTAGES.register("positive_only")
def positive_only(rewards, inverse, n_groups, generator):
    """WAPO: group_norm, then negative advantages set to 0 (train on positive responses only)."""
    return group_norm(rewards, inverse, n_groups, generator).clamp(min=0.0)


@ADVANTAGES.register("random_reward")
def random_reward(rewards, inverse, n_groups, generator):
    """Control: rewards replaced by seeded Bernoulli(0.5) coin flips, then group_norm."""
    flips = torch.rand(rewards.shape, generator=generator, device=rewards.device, dtype=rewards.dtype) < 0.5
    return group_norm(flips.to(rewards.dtype), inverse, n_groups, generator)


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    cfg: AdvantageConfig,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One advantage per response.

    Args:
        rewards: (N,) float, the verifiable reward of each response.
        group_ids: (N,) int, responses with the same id were sampled from the same prompt (each group >= 2).
        cfg: the advantage kind and noise.
        generator: torch.Generator for random_reward and the noise (None = torch's global RNG).

    Returns:
        (N,) advantages; the noise (one eps ~ N(0, 1) per response, drawn for every response whatever the mode) is
        applied last, after normalization: ``cfg.noise_mode`` mult, add (groups with a nonzero advantage only) or
        add_all (every group).
    """
    if not isinstance(cfg, AdvantageConfig):
        raise TypeError(f"cfg must be nsr.AdvantageConfig, got {type(cfg).__name__}")
    rewards = torch.as_tensor(rewards)
    rewards = rewards.to(torch.get_default_dtype()) if not rewards.is_floating_point() else rewards
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be (N,), got {tuple(rewards.shape)}, {tuple(group_ids.shape)}"
        )
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if rewards.numel() and int(counts.min()) < 2:
        raise ValueError("every group needs at least 2 responses for a group-relative advantage")
    adv = ADVANTAGES[cfg.kind](rewards, inverse, counts.numel(), generator)
    if cfg.noise > 0:  # docs/method.md 1b: scalar noise per response, applied after normalization
        eps = torch.randn(adv.shape, generator=generator, device=adv.device, dtype=adv.dtype)
        if cfg.noise_mode == "mult":
            adv = adv * (1.0 + cfg.noise * eps)
        elif cfg.noise_mode == "add_all":
            adv = adv + cfg.noise * eps
        else:  # add: a group whose advantages are all 0 carries no signal and gets none injected
            nonzero = torch.zeros(counts.numel(), device=adv.device, dtype=adv.dtype).index_add_(
                0, inverse, (adv != 0).to(adv.dtype)
            )
            adv = torch.where(nonzero[inverse] > 0, adv + cfg.noise * eps, adv)
    return adv
