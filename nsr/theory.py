"""The analytic expected gradient weight of every rule (docs/method.md, "Expected behaviour").

``w(r)`` is the expected gradient of a unit relative to its unclipped gradient ``-A r grad log pi``. For NSR with
z ~ U(1 - delta, 1 + delta), c = 1 + eps_high, b = 1 - eps_low:

* A > 0, c < r < c / (1 - delta): noisy ((c/r)^2 - (1-delta)^2) / (4 delta); clean (c/r - (1-delta)) / (2 delta)
* A < 0, b / (1 + delta) < r < b: noisy ((1+delta)^2 - (b/r)^2) / (4 delta); clean ((1+delta) - b/r) / (2 delta)
* 0 beyond that zone; 1 for units that are not clipped (A = 0 included).

All of these are one integral, ``E[z^p 1{r z inside on A's side}]`` with p = 1 when the executor carries the
noise and p = 0 when it does not, which :func:`side_expectation` computes for any half-width.

The ``weight_<rule>`` functions below are registered with their rule in ``nsr.objectives`` (``RULES.info(name)
["weight"]``), so :func:`expected_weight` has exactly the rules of ``nsr.RULES``. Each takes ``(r, s, cfg)``:
ratio and advantage sign as broadcast float tensors (s in {-1, 0, 1}).
"""

from __future__ import annotations

import torch

from nsr.config import LossConfig
from nsr.registry import RULES


def clip_sides(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) bool masks of the units the hard clip drops (docs/method.md, "Setting"):
    low: A < 0 and r < 1 - eps_low; high: A > 0 and r > 1 + eps_high. Shapes broadcast; A = 0 is never clipped."""
    return (adv < 0) & (ratio < cfg.low), (adv > 0) & (ratio > cfg.high)


def is_clipped(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Bool mask: the hard clip drops the unit (A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low)."""
    low, high = clip_sides(ratio, adv, cfg)
    return low | high


def side_expectation(ratio, sign, cfg: LossConfig, half_width: float, power: int) -> torch.Tensor:
    """E[z^power * 1{ratio * z inside the region on the side of ``sign``}], z ~ U(1 - h, 1 + h), power 0 or 1.

    A > 0 tests ``r z <= 1 + eps_high``, i.e. z <= t = c / r; A < 0 tests ``r z >= 1 - eps_low``, i.e. z >= t = b / r.
    With t clamped to [1 - h, 1 + h]: P(z <= t) = (t - (1-h)) / 2h, E[z 1{z <= t}] = (t^2 - (1-h)^2) / 4h, and the
    mirror images for z >= t. Sign 0 gives 1; h = 0 gives 1 inside and 0 outside (z = 1).
    """
    if power not in (0, 1):
        raise ValueError(f"power={power!r} is not valid; allowed: 0, 1")
    r, s = _tensors(ratio, sign)
    h = float(half_width)
    if h == 0:
        return (~is_clipped(r, s, cfg)).to(r.dtype)
    a, b = 1.0 - h, 1.0 + h
    t_pos = (cfg.high / r).clamp(a, b)
    t_neg = (cfg.low / r).clamp(a, b)
    if power == 0:
        pos, neg = (t_pos - a) / (2 * h), (b - t_neg) / (2 * h)
    else:
        pos, neg = (t_pos**2 - a**2) / (4 * h), (b**2 - t_neg**2) / (4 * h)
    w = torch.where(s > 0, pos, neg).clamp(0.0, 1.0)  # the clamp removes float rounding at the ends
    return torch.where(s == 0, 1.0, w)


def rescue_weight(ratio, adv, cfg: LossConfig) -> torch.Tensor:
    """Expected weight of a *clipped* unit under NSR: P(rescue) (clean executor) or E[z 1{rescue}] (noisy)."""
    return side_expectation(ratio, adv, cfg, cfg.delta, 1 if cfg.executor == "noisy" else 0)


def _tensors(ratio, sign):
    r = torch.as_tensor(ratio)
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    s = torch.as_tensor(sign, device=r.device).to(r.dtype)
    r, s = torch.broadcast_tensors(r, s)
    return r, torch.sign(s)


# ------------------------------------------------------------------ the expected weight of each rule
def weight_hard(r, s, cfg):
    """1 if kept, 0 if clipped."""
    return (~is_clipped(r, s, cfg)).to(r.dtype)


def weight_nsr(r, s, cfg):
    """Clipped units: the rescue weight; others: 1. Also soft's, whose weight is this by construction."""
    return torch.where(is_clipped(r, s, cfg), rescue_weight(r, s, cfg), 1.0)


def weight_pushout(r, s, cfg):
    """Clipped units: 0; others are kept with probability P(r z inside on A's side)."""
    return torch.where(is_clipped(r, s, cfg), 0.0, side_expectation(r, s, cfg, cfg.delta, 0))


def weight_nsr_pushout(r, s, cfg):
    return torch.where(is_clipped(r, s, cfg), rescue_weight(r, s, cfg), side_expectation(r, s, cfg, cfg.delta, 0))


def weight_noisy_decision(r, s, cfg):
    """Judge = executor = r xi: the kept gradient -A r xi, integrated over xi (no special case at the boundary)."""
    return side_expectation(r, s, cfg, cfg.ratio_noise, 1)


def weight_cispo(r, s, cfg):
    """The IS weight min(r, cap) relative to r: 1 up to the cap, cap / r above it; no lower bound."""
    return torch.where(s == 0, 1.0, r.clamp(max=cispo_cap(cfg)) / r)


def weight_sapo(r, s, cfg):
    """The slope of SAPO's gate relative to r: 4 g (1 - g), g = sigmoid(tau (r - 1)), tau by A's sign."""
    tau = torch.where(s > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(r.dtype)
    g = torch.sigmoid(tau * (r - 1.0))
    return torch.where(s == 0, 1.0, 4.0 * g * (1.0 - g))


def weight_noclip(r, s, cfg):
    return torch.ones_like(r)


def cispo_cap(cfg: LossConfig) -> float:
    """CISPO's upper bound on the IS weight: ``cfg.cispo_cap``, or 1 + eps_high when it is None (verl's cispo)."""
    return cfg.high if cfg.cispo_cap is None else cfg.cispo_cap


def expected_weight(ratio, advantage_sign, cfg: LossConfig) -> torch.Tensor:
    """Analytic E[gradient weight] of ``cfg.rule`` at ``ratio`` (token or sequence ratio) for advantage sign.

    Args:
        ratio: tensor or number, r > 0.
        advantage_sign: tensor or number broadcastable with ratio; only its sign is used.
        cfg: the rule; dual clip, when set, zeroes A < 0 units with r > dual_clip.

    Returns:
        Tensor of the broadcast shape, in [0, 1] for every rule but cispo, whose weight is min(r, cap) / r
        (sapo: the gate's slope 4 g (1 - g), also <= 1).
    """
    weight = RULES.info(cfg.rule).get("weight")
    if weight is None:
        have = [name for name in RULES if RULES.info(name).get("weight") is not None]
        raise ValueError(f"expected_weight has no formula for rule={cfg.rule!r}; allowed: {', '.join(have)}")
    r, s = _tensors(ratio, advantage_sign)
    w = weight(r, s, cfg).to(r.dtype)
    if cfg.dual_clip is not None:
        w = torch.where((s < 0) & (r > cfg.dual_clip), 0.0, w)
    return w


# ------------------------------------------------------------------ the rescue zone, for ratio bins and figures
def rescue_zone(sign: int, cfg: LossConfig) -> tuple[float, float]:
    """(boundary, edge) of NSR's rescue zone on the side of ``sign``: the clipped ratios a z ~ U(1 - delta,
    1 + delta) can bring back inside. A > 0: (c, c / (1 - delta)); A < 0: (b, b / (1 + delta))."""
    if sign > 0:
        return cfg.high, cfg.high / (1.0 - cfg.delta)
    return cfg.low, cfg.low / (1.0 + cfg.delta)


def rescue_depth(ratio, sign, cfg: LossConfig) -> torch.Tensor:
    """How far a clipped ratio lies into the rescue zone: 0 at the clip boundary, 1 at the zone's far edge
    (deep violations > 1; unclipped ratios < 0). Per-side, so both sides share one binning of [0, 1)."""
    r, s = _tensors(ratio, sign)
    pos_b, pos_e = rescue_zone(1, cfg)
    neg_b, neg_e = rescue_zone(-1, cfg)
    pos = (r - pos_b) / (pos_e - pos_b) if cfg.delta > 0 else torch.where(r > pos_b, torch.inf, -1.0)
    neg = (neg_b - r) / (neg_b - neg_e) if cfg.delta > 0 else torch.where(r < neg_b, torch.inf, -1.0)
    return torch.where(s > 0, pos, neg)


def depth_to_ratio(depth, sign: int, cfg: LossConfig):
    """Inverse of :func:`rescue_depth` on one side."""
    b, e = rescue_zone(sign, cfg)
    return b + (e - b) * depth
