"""The analytic expected gradient weight of every rule (method.md, "Expected behaviour").

``w(r)`` is the expected gradient of a unit relative to its unclipped gradient ``-A r grad log pi``. For NSR with
z ~ U(1 - delta, 1 + delta), c = 1 + eps_high, b = 1 - eps_low:

* A > 0, c < r < c / (1 - delta): noisy ((c/r)^2 - (1-delta)^2) / (4 delta); clean (c/r - (1-delta)) / (2 delta)
* A < 0, b / (1 + delta) < r < b: noisy ((1+delta)^2 - (b/r)^2) / (4 delta); clean ((1+delta) - b/r) / (2 delta)
* 0 beyond that zone; 1 for units that are not clipped (A = 0 included).

All of these are one integral, ``E[z^p 1{r z inside on A's side}]`` with p = 1 when the executor carries the
noise and p = 0 when it does not, which :func:`side_expectation` computes for any half-width.
"""

from __future__ import annotations

import torch

from nsr.config import LossConfig


def side_expectation(ratio, sign, cfg: LossConfig, half_width: float, power: int) -> torch.Tensor:
    """E[z^power * 1{ratio * z inside the region on the side of ``sign``}], z ~ U(1 - h, 1 + h).

    A > 0 tests ``r z <= 1 + eps_high``; A < 0 tests ``r z >= 1 - eps_low``; sign 0 gives 1.
    """
    r, sign = _tensors(ratio, sign)
    (w,) = _side_terms(r, (sign > 0).to(r.dtype), cfg, float(half_width), (power,))
    return torch.where(sign == 0, 1.0, w)


def clipped_expectations(ratio: torch.Tensor, pos: torch.Tensor, cfg: LossConfig, half_width: float, power: int):
    """(P(rescue), E[z^power 1{rescue}]) of *clipped* units: :func:`side_expectation` at powers 0 and ``power``,
    sharing the work (the soft rule calls this on its clipped tokens).

    Args:
        ratio: float tensor of ratios, each outside the region on its side (A > 0: r > hi; A < 0: r < lo).
        pos: float tensor of the same shape, 1.0 where A > 0 and 0.0 where A < 0.
    """
    powers = (0,) if power == 0 else (0, power)
    terms = _side_terms(ratio, pos, cfg, float(half_width), powers, clipped=True)
    return terms[0], terms[-1]


def _side_terms(r: torch.Tensor, pos: torch.Tensor, cfg: LossConfig, h: float, powers, clipped: bool = False):
    """E[z^p 1{r z inside on the side}] for each p of ``powers``, for units with A != 0 (pos: 1.0 if A > 0, 0.0 if
    A < 0). Both sides are computed and one is selected by ``lerp(neg_side, pos_side, pos)``, which returns one
    of them exactly (finite values, weight 0 or 1) and, unlike a bool ``where``, is cheap on CPU. ``clipped``:
    every unit is outside on its side, so clip(r) is its bound and one t = bound / r serves both sides."""
    hi, lo = cfg.high, cfg.low
    if h == 0:
        inside = torch.lerp((r >= lo).to(r.dtype), (r <= hi).to(r.dtype), pos)  # z = 1: P = E[z^p ...] = inside
        return [inside for _ in powers]
    a, b = 1.0 - h, 1.0 + h
    if clipped:  # (1 / r) * bound, as torch computes hi / r for a Python number hi: the same bits
        t_pos = t_neg = r.reciprocal().mul_(r.clamp(lo, hi)).clamp_(a, b)
    else:
        t_pos, t_neg = (hi / r).clamp_(a, b), (lo / r).clamp_(a, b)
    out = []
    for power in powers:
        if power == 1:
            tt_pos = t_pos * t_pos
            tt_neg = tt_pos if clipped else t_neg * t_neg
            side_pos, side_neg = (tt_pos - a * a) / (4 * h), (b * b - tt_neg) / (4 * h)
        elif power == 0:
            side_pos, side_neg = (t_pos - a) / (2 * h), (b - t_neg) / (2 * h)
        else:
            raise ValueError(f"power={power!r} is not valid; allowed: 0, 1")
        # both are in [0, 1] exactly; the clamp removes float rounding at the ends (e.g. 1 + 1e-7)
        out.append(torch.lerp(side_neg, side_pos, pos).clamp_(0.0, 1.0))
    return out


def rescue_weight(ratio, adv, cfg: LossConfig) -> torch.Tensor:
    """Expected weight of a *clipped* unit under NSR: P(rescue) (clean) or E[z 1{rescue}] (noisy)."""
    return side_expectation(ratio, adv, cfg, cfg.delta, 1 if cfg.executor == "noisy" else 0)


def _tensors(ratio, sign):
    r = torch.as_tensor(ratio)
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    s = torch.as_tensor(sign, device=r.device).to(r.dtype)
    r, s = torch.broadcast_tensors(r, s)
    return r, torch.sign(s)


def _clipped(r, s, cfg: LossConfig) -> torch.Tensor:
    return ((s > 0) & (r > cfg.high)) | ((s < 0) & (r < cfg.low))


def _weight_nsr(r, s, cfg):
    return torch.where(_clipped(r, s, cfg), rescue_weight(r, s, cfg), 1.0)


def _weight_pushout(r, s, cfg):
    return torch.where(_clipped(r, s, cfg), 0.0, side_expectation(r, s, cfg, cfg.delta, 0))


def _weight_nsr_pushout(r, s, cfg):
    return torch.where(_clipped(r, s, cfg), rescue_weight(r, s, cfg), side_expectation(r, s, cfg, cfg.delta, 0))


def _weight_hard(r, s, cfg):
    return (~_clipped(r, s, cfg)).to(r.dtype)


_WEIGHTS = {
    "hard": _weight_hard,
    "nsr": _weight_nsr,
    "soft": _weight_nsr,  # the deterministic twin has NSR's expected weight by construction
    "pushout": _weight_pushout,
    "nsr_pushout": _weight_nsr_pushout,
    # judge = executor = r xi: the kept gradient -A r xi, integrated over xi (no special case at the boundary)
    "noisy_decision": lambda r, s, cfg: side_expectation(r, s, cfg, cfg.ratio_noise, 1),
    "clean_decision": _weight_hard,  # clean judge, E[xi] = 1 on kept units
    "cispo": lambda r, s, cfg: torch.where(s == 0, 1.0, r.clamp(cfg.low, cfg.high) / r),
    "sapo": lambda r, s, cfg: torch.where(
        s == 0, 1.0, _sapo_gate(r, torch.where(s > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(r.dtype))
    ),
}


def _sapo_gate(r, tau):
    g = torch.sigmoid(tau * (r - 1.0))
    return 4.0 * g * (1.0 - g)


def expected_weight(ratio, advantage_sign, cfg: LossConfig) -> torch.Tensor:
    """Analytic E[gradient weight] of ``cfg.rule`` at ``ratio`` (token or sequence ratio) for advantage sign.

    Args:
        ratio: tensor or number, r > 0.
        advantage_sign: tensor or number broadcastable with ratio; only its sign is used.
        cfg: the rule; dual clip, when set, zeroes A < 0 units with r > dual_clip.

    Returns:
        Tensor of the broadcast shape, in [0, 1] for every rule but cispo, whose weight clip(r) / r exceeds 1
        below the region (sapo: the gate's slope 4 s (1 - s)).
    """
    r, s = _tensors(ratio, advantage_sign)
    if cfg.rule not in _WEIGHTS:
        raise ValueError(f"expected_weight has no formula for rule={cfg.rule!r}; allowed: {', '.join(_WEIGHTS)}")
    w = _WEIGHTS[cfg.rule](r, s, cfg).to(r.dtype)
    if cfg.dual_clip is not None:
        w = torch.where((s < 0) & (r > cfg.dual_clip), 0.0, w)
    return w


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
