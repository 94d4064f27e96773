"""Policy-gradient objectives: every clip rule of docs/method.md, one plain function each, in a registry.

Rule contract (how to add one; verl ``core_algos`` style)::

    @register_rule("name", weight=theory.weight_name)   # weight: E[gradient weight] (r, s, cfg) -> w, or omit;
    def name(x: RuleInput) -> RuleOutput:               # levels=("token",) for a rule with no sequence form
        ...

* ``x.ratio`` r and ``x.log_ratio`` log r: (B, T) float tensors that carry the gradient to ``log_probs``; log r is
  clamped to [-20, 20] (zero gradient outside, as OpenRLHF). At sequence level (GSPO) every token of sequence i
  holds the sequence ratio s_i = exp(mean_t log r_t) in the straight-through form of OpenRLHF's / verl's gspo:
  value sg(s_i), gradient d r_t / d log pi_t = s_i (so a rule never needs to know the level).
* ``x.adv``: (B, T) advantages, detached, 0 on padded tokens. ``x.cfg``: the LossConfig. ``x.valid``: (B, T) bool
  mask of real tokens; ``x.log_probs`` (differentiable) and ``x.old_log_probs`` (constant): (B, T), 0 on padding,
  for rules whose formula uses pi itself (per token, whatever the level; each is computed when read).
* ``x.uniform(h)``: U(1 - h, 1 + h) noise from the run's generator, one value per unit: (B, T) at token level,
  (B, 1) at sequence level (one z per sequence); exactly 1 when h = 0. Draw order: each call draws one full
  tensor, in the order the rule calls it.
* Return ``RuleOutput(loss, clipped_low, clipped_high, rescued, pushed)``: ``loss`` the (B, T) per-token loss
  (``policy_loss`` zeroes padded tokens and applies dual clip afterwards), the others bool masks broadcastable to
  (B, T), or None for "no such units". Stop-gradients are written as ``.detach()`` where the formula has sg(.).
* Metrics are computed in one place (:func:`_metrics`) from those masks; a rule computes no metric itself, and
  nothing in this module reads a tensor back to the host (no ``.item()``, ``nonzero``, boolean indexing or
  data-dependent shapes), so on a GPU the loss never waits for the host (tests/test_no_sync.py).

Shared notation (docs/method.md, "Setting"): region I = [lo, hi] = [1 - eps_low, 1 + eps_high]; a unit is
*clipped* (the judge drops it) iff A > 0 and r > hi or A < 0 and r < lo (:func:`nsr.theory.is_clipped`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from nsr import theory
from nsr.config import AGG_MODES, LEVELS, LossConfig
from nsr.registry import RULES

LOG_RATIO_CLAMP = 20.0

METRIC_KEYS = (
    "clip_frac_low",
    "clip_frac_high",
    "clip_frac",
    "rescue_frac",
    "pushout_frac",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "approx_kl",
)
"""Every metric :func:`policy_loss` returns, each a 0-dim tensor over one call (one minibatch)."""

METRIC_REDUCE = {
    "clip_frac_low": "mean",
    "clip_frac_high": "mean",
    "clip_frac": "mean",
    "rescue_frac": "mean",
    "pushout_frac": "mean",
    "ratio_mean": "mean",
    "ratio_min": "min",
    "ratio_max": "max",
    "approx_kl": "mean",
}
"""How each of :data:`METRIC_KEYS` combines over the calls of a step (updates, micro-batches, ranks): ``mean`` of the
per-call values, or the ``min`` / ``max`` of them. Trainers reduce by this table, never by a key's position."""
assert tuple(METRIC_REDUCE) == METRIC_KEYS


def reduce_metric(key: str, values) -> float:
    """Combine the per-call values of metric ``key`` (floats) as :data:`METRIC_REDUCE` says."""
    values = list(values)
    how = METRIC_REDUCE[key]
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    return sum(values) / len(values)


class RuleInput(NamedTuple):
    """What a rule sees (see the module docstring)."""

    ratio: torch.Tensor
    """(B, T) r = exp(log_ratio), differentiable."""
    log_ratio: torch.Tensor
    """(B, T) clamped log r, differentiable."""
    adv: torch.Tensor
    """(B, T) advantages, constant, 0 on padded tokens."""
    cfg: LossConfig
    generator: torch.Generator | None
    valid: torch.Tensor | None = None
    """(B, T) bool, True on real tokens (for rules that need statistics over the valid tokens)."""
    raw_log_probs: torch.Tensor | None = None
    """(B, T) log pi as the caller passed it (padding may hold anything): use :attr:`log_probs`."""
    raw_old_log_probs: torch.Tensor | None = None
    """(B, T) log pi_old as the caller passed it: use :attr:`old_log_probs`."""

    @property
    def log_probs(self) -> torch.Tensor:
        """(B, T) log pi, differentiable, 0 on padded tokens (computed on each access: read it once)."""
        return torch.where(self.valid, self.raw_log_probs, 0.0)

    @property
    def old_log_probs(self) -> torch.Tensor:
        """(B, T) log pi_old, constant, 0 on padded tokens (computed on each access: read it once)."""
        return torch.where(self.valid, self.raw_old_log_probs.detach(), 0.0)

    def uniform(self, half_width: float) -> torch.Tensor:
        """z ~ U(1 - h, 1 + h), one per unit: (B, T) per token, (B, 1) per sequence (docs/method.md, GSPO variant)."""
        B, T = self.adv.shape
        shape = (B, 1) if self.cfg.level == "sequence" else (B, T)
        u = torch.rand(shape, generator=self.generator, device=self.adv.device, dtype=self.adv.dtype)
        return u * (2.0 * half_width) + (1.0 - half_width)  # exactly 1 when h = 0: delta = 0 is hard clip


class RuleOutput(NamedTuple):
    loss: torch.Tensor
    """(B, T) per-token loss."""
    clipped_low: torch.Tensor | None = None
    """Units the rule's judge dropped (or whose weight it clipped) on the low side (A < 0, r below the region)."""
    clipped_high: torch.Tensor | None = None
    """The same on the high side (A > 0, r above the region; cispo: IS weight capped)."""
    rescued: torch.Tensor | None = None
    """Clipped units that the rule gave a gradient back (nsr, nsr_pushout)."""
    pushed: torch.Tensor | None = None
    """Unclipped units that push-out dropped (pushout, nsr_pushout)."""


Rule = Callable[[RuleInput], RuleOutput]


def register_rule(
    name: str,
    weight: Callable | None = None,
    levels: tuple[str, ...] = LEVELS,
    hard_at_ratio_one: bool | Callable[[LossConfig], bool] = True,
    zero_at_zero_advantage: bool = True,
):
    """Register a rule under ``name`` with its analytic expected gradient weight ``weight(r, s, cfg)``
    (nsr.theory; None when the rule has none), read back by :func:`nsr.expected_weight`, the levels it is
    defined at (LossConfig refuses the others), whether its gradient is the hard clip's when every ratio is 1
    (``hard_at_ratio_one``: a bool, or a function of the LossConfig; read by :func:`needs_stale_ratios`), and whether
    a unit with A = 0 is inert under it (:func:`zero_at_zero_advantage`)."""
    return RULES.register(
        name,
        weight=weight,
        levels=tuple(levels),
        hard_at_ratio_one=hard_at_ratio_one,
        zero_at_zero_advantage=zero_at_zero_advantage,
    )


def needs_stale_ratios(cfg: LossConfig) -> bool:
    """Whether rule ``cfg.rule`` can act only where a ratio is not 1: True when its gradient equals the hard clip's
    as long as every ratio is 1, so that in a schedule with no stale update (one optimizer step per rollout, old
    log-probs recomputed by the learner itself) it *is* the hard clip and the run measures nothing of it.

    False for ``hard`` itself, for ``clip_cov`` (it drops tokens chosen by covariance, whatever their ratio) and for
    ``noisy_decision`` / ``clean_decision`` with ``ratio_noise`` > 0 (their executor r xi moves every token's
    weight). tests/test_objectives.py checks each rule's declaration against its gradient at ratio 1. The plug-ins
    refuse such a rule in such a schedule (nsr.trl, nsr.verl, nsr.openrlhf.launch)."""
    if cfg.rule == "hard":
        return False
    same = RULES.info(cfg.rule)["hard_at_ratio_one"]
    return bool(same(cfg) if callable(same) else same)


def zero_at_zero_advantage(rule: str) -> bool:
    """Whether every unit with A = 0 has zero loss and zero gradient under ``rule`` and leaves the other units'
    loss unchanged, so a trainer may leave such sequences out of its forward and backward passes (NSRGRPOTrainer's
    ``skip_zero_advantage``). False for rules with a term at A = 0 (kl_cov's |log r| penalty) or whose choice of
    units reads every valid unit (clip_cov's covariance and token budget). tests/test_trl_fast.py checks each rule
    that claims it."""
    return RULES.info(rule)["zero_at_zero_advantage"]


def ppo_loss(r: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """PPO/DAPO min-form: -min(r A, clip(r, lo, hi) A)."""
    return -torch.minimum(r * adv, r.clamp(cfg.low, cfg.high) * adv)


def _hard_value(x: RuleInput) -> torch.Tensor:
    """Hard clipping's loss value -min(r A, clip(r) A) as a constant: what a dropped unit keeps (zero gradient)."""
    return ppo_loss(x.ratio.detach(), x.adv, x.cfg)


@register_rule("hard", weight=theory.weight_hard)
def hard(x: RuleInput) -> RuleOutput:
    """PPO/GRPO/DAPO clipping: L = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    low, high = theory.clip_sides(x.ratio.detach(), x.adv, x.cfg)
    return RuleOutput(ppo_loss(x.ratio, x.adv, x.cfg), low, high)


def _rescue(x: RuleInput, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/method.md, NSR steps 1-3 on the clipped units (``low``, ``high``): (rescued mask, executor ratio).

    z ~ U(1 - delta, 1 + delta) (step 1); candidate r z (step 2); rescued iff r z is back inside on the clipped
    side (step 3). Executor: r z for a rescued unit under the noisy executor (z a constant), else r.
    """
    z = x.uniform(x.cfg.delta)
    rz = x.ratio.detach() * z
    rescued = (low & (rz >= x.cfg.low)) | (high & (rz <= x.cfg.high))
    executor = x.ratio * torch.where(rescued, z, 1.0) if x.cfg.executor == "noisy" else x.ratio
    return rescued, executor


def _push_out(x: RuleInput, clipped: torch.Tensor) -> torch.Tensor:
    """docs/method.md intervention 4: an unclipped unit draws z and is pushed out (dropped) iff r z would be
    clipped. Returns the pushed mask."""
    z = x.uniform(x.cfg.delta)
    return ~clipped & theory.is_clipped(x.ratio.detach() * z, x.adv, x.cfg)


@register_rule("nsr", weight=theory.weight_nsr)
def nsr(x: RuleInput) -> RuleOutput:
    """Near-boundary Stochastic Rescue (docs/method.md, NSR): a clipped unit is rescued iff r z is back inside
    on its side, z ~ U(1 - delta, 1 + delta); its loss is then -A r z (noisy executor) or -A r (clean). The other
    clipped units keep the hard-clip value with zero gradient (step 4); unclipped units keep -A r, as under hard."""
    low, high = theory.clip_sides(x.ratio.detach(), x.adv, x.cfg)
    rescued, executor = _rescue(x, low, high)
    loss = torch.where(~(low | high) | rescued, -x.adv * executor, _hard_value(x))
    return RuleOutput(loss, low, high, rescued=rescued)


@register_rule("soft", weight=theory.weight_nsr)
def soft(x: RuleInput) -> RuleOutput:
    """Deterministic twin of nsr (docs/method.md intervention 3): each unit's unclipped gradient times NSR's
    expected weight w(r) (1 if not clipped), no sampling.

    L = -sg(w) A r + sg((1 - P(rescue)) * hard-clip value) on clipped units: NSR's expected loss value. So the
    gradient is w times the unclipped one, and delta = 0 (w = P = 0 on clipped units) is hard clipping.
    """
    r, A, cfg = x.ratio, x.adv, x.cfg
    low, high = theory.clip_sides(r.detach(), A, cfg)
    clipped = low | high
    w = torch.where(clipped, theory.rescue_weight(r.detach(), A, cfg), 1.0)  # theory.weight_nsr
    p_rescue = theory.side_expectation(r.detach(), A, cfg, cfg.delta, 0)
    still_clipped = torch.where(clipped, (1.0 - p_rescue) * _hard_value(x), 0.0)
    return RuleOutput(-w * A * r + still_clipped, low, high)


@register_rule("pushout", weight=theory.weight_pushout)
def pushout(x: RuleInput) -> RuleOutput:
    """Push-out only: an unclipped unit is dropped (hard value, zero gradient) when r z would be clipped; clipped
    units stay clipped. A kept unit keeps the clean executor r, whatever ``executor`` says."""
    low, high = theory.clip_sides(x.ratio.detach(), x.adv, x.cfg)
    pushed = _push_out(x, low | high)
    loss = torch.where(~(low | high | pushed), -x.adv * x.ratio, _hard_value(x))
    return RuleOutput(loss, low, high, pushed=pushed)


@register_rule("nsr_pushout", weight=theory.weight_nsr_pushout)
def nsr_pushout(x: RuleInput) -> RuleOutput:
    """Both directions: NSR rescue of clipped units, then push-out of unclipped ones (an independent draw)."""
    low, high = theory.clip_sides(x.ratio.detach(), x.adv, x.cfg)
    rescued, executor = _rescue(x, low, high)
    pushed = _push_out(x, low | high)
    loss = torch.where(~(low | high | pushed) | rescued, -x.adv * executor, _hard_value(x))
    return RuleOutput(loss, low, high, rescued=rescued, pushed=pushed)


@register_rule("noisy_decision", weight=theory.weight_noisy_decision, hard_at_ratio_one=lambda c: c.ratio_noise == 0)
def noisy_decision(x: RuleInput) -> RuleOutput:
    """Judge = executor = r xi, xi ~ U(1 - sigma, 1 + sigma) a constant (docs/method.md intervention 2):
    L = -min(r xi A, clip(r xi) A)."""
    r_noisy = x.ratio * x.uniform(x.cfg.ratio_noise)
    low, high = theory.clip_sides(r_noisy.detach(), x.adv, x.cfg)
    return RuleOutput(ppo_loss(r_noisy, x.adv, x.cfg), low, high)


@register_rule("clean_decision", weight=theory.weight_hard, hard_at_ratio_one=lambda c: c.ratio_noise == 0)
def clean_decision(x: RuleInput) -> RuleOutput:
    """Judge = clean r, executor = r xi (docs/method.md intervention 2): a kept unit's loss is -A r xi, a clipped
    one keeps the hard-clip value. E[xi] = 1, so its expected weight is hard's."""
    r, A = x.ratio, x.adv
    low, high = theory.clip_sides(r.detach(), A, x.cfg)
    xi = x.uniform(x.cfg.ratio_noise)
    loss = torch.where(low | high, _hard_value(x), -A * r * xi)
    return RuleOutput(loss, low, high)


@register_rule("cispo", weight=theory.weight_cispo)
def cispo(x: RuleInput) -> RuleOutput:
    """CISPO (MiniMax-M1): L = -sg(min(r, cap)) A log r; only the IS weight is clipped, from above, and no unit is
    dropped. clip_frac_high counts the units whose weight is capped (A != 0); there is no low side.

    The value uses log r instead of log pi: the two differ by a constant, so the gradient is MiniMax's.
    """
    cap = theory.cispo_cap(x.cfg)
    weight = x.ratio.clamp(max=cap).detach()
    capped = (x.adv != 0) & (x.ratio.detach() > cap)
    return RuleOutput(-weight * x.adv * x.log_ratio, clipped_high=capped)


@register_rule("sapo", weight=theory.weight_sapo)
def sapo(x: RuleInput) -> RuleOutput:
    """SAPO soft gate: L = -(4 / tau) sigmoid(tau (r - 1)) A, tau = sapo_tau_pos (A > 0) or sapo_tau_neg (A < 0).

    It drops nothing; its clip metrics count the units hard would clip (where the gate has mostly shut), so they
    compare with the other rules'.
    """
    r, A, cfg = x.ratio, x.adv, x.cfg
    tau = torch.where(A > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(A.dtype)
    low, high = theory.clip_sides(r.detach(), A, cfg)
    return RuleOutput(-(4.0 / tau) * torch.sigmoid(tau * (r - 1.0)) * A, low, high)


@register_rule("noclip", weight=theory.weight_noclip)
def noclip(x: RuleInput) -> RuleOutput:
    """No trust region (control): L = -A r. Nothing is clipped, so every clip metric is 0."""
    return RuleOutput(-x.adv * x.ratio)


# ------------------------------------------------------------------ the loss, its checks and its metrics
def _check(log_probs, old_log_probs, advantages, mask):
    """(adv, valid): advantages as a constant (B, T) tensor, 0 on padded tokens; valid the (B, T) bool mask."""
    for name, t in (("log_probs", log_probs), ("old_log_probs", old_log_probs)):
        if not torch.is_tensor(t) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor of shape (B, T), got {getattr(t, 'shape', type(t))}")
    if old_log_probs.shape != log_probs.shape:
        raise ValueError(f"old_log_probs shape {tuple(old_log_probs.shape)} != log_probs {tuple(log_probs.shape)}")
    if mask is None:
        mask = torch.ones_like(log_probs, dtype=torch.bool)
    if mask.shape != log_probs.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != log_probs {tuple(log_probs.shape)}")
    B, T = log_probs.shape
    if advantages.shape in ((B,), (B, 1)):  # one advantage per response, broadcast over its tokens
        advantages = advantages.reshape(B, 1).expand(B, T)
    if advantages.shape != log_probs.shape:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} must be (B, T), (B, 1) or (B,) for B, T = {B, T}")
    valid = mask.bool()
    adv = torch.where(valid, advantages.detach().to(log_probs.dtype), 0.0)  # zero A on padding
    return adv, valid


def _metrics(out: RuleOutput, ratio, log_ratio_raw, valid, ratio_units=None) -> dict[str, torch.Tensor]:
    """Every METRIC_KEYS value as a 0-dim tensor, from the rule's masks: fractions of valid tokens; ratio
    mean / min / max over valid units (token-weighted at sequence level) and approx_kl = mean(old - logp) over
    ``ratio_units`` (default: the valid units)."""
    dtype = ratio.dtype
    n = torch.count_nonzero(valid)
    denom = n.clamp(min=1).to(dtype)
    none = torch.zeros((), dtype=torch.bool, device=valid.device)

    def frac(mask):
        return torch.count_nonzero((none if mask is None else mask) & valid).to(dtype) / denom

    low, high = (none if m is None else m for m in (out.clipped_low, out.clipped_high))
    r = ratio.detach()
    units = valid if ratio_units is None else valid & ratio_units
    n_units = torch.count_nonzero(units)
    units_denom = n_units.clamp(min=1).to(dtype)
    has = n_units > 0  # an empty mask reports ratio 1, not inf
    return {
        "clip_frac_low": frac(low),
        "clip_frac_high": frac(high),
        "clip_frac": frac(low | high),
        "rescue_frac": frac(out.rescued),
        "pushout_frac": frac(out.pushed),
        "ratio_mean": torch.where(has, torch.where(units, r, 0.0).sum() / units_denom, 1.0),
        "ratio_min": torch.where(has, torch.where(units, r, torch.inf).amin(), 1.0),
        "ratio_max": torch.where(has, torch.where(units, r, -torch.inf).amax(), 1.0),
        "approx_kl": -torch.where(units, log_ratio_raw.detach(), 0.0).sum() / units_denom,
    }


def _without(mask: torch.Tensor | None, drop: torch.Tensor) -> torch.Tensor | None:
    return None if mask is None else mask & ~drop


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    cfg: LossConfig,
    generator: torch.Generator | None = None,
    ratio_units: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss of ``cfg.rule``.

    Args:
        log_probs: (B, T) float, log pi_theta of the sampled tokens; gradients flow here only.
        old_log_probs: (B, T) float, log pi_old (behaviour policy), treated as constant.
        advantages: (B, T) float (or (B,) / (B, 1), broadcast over tokens), treated as constant.
        mask: (B, T) bool, True on real response tokens (None = all real).
        cfg: the rule and its parameters.
        generator: torch.Generator on the tensors' device for every random draw (None = torch's global RNG).
        ratio_units: (B, T) bool, the units ratio_mean / ratio_min / ratio_max and approx_kl are taken over, within
            ``mask`` (None = every valid unit): a trainer that did not compute some sequences' log-probs (their
            advantage is zero, NSRGRPOTrainer's skip_zero_advantage) keeps them out of these statistics.

    Returns:
        loss_tok: (B, T), zero where mask is False; reduce it with :func:`aggregate`.
        metrics: dict of 0-dim tensors, keys ``METRIC_KEYS``: clip_frac_low / clip_frac_high / clip_frac
            (tokens the judge dropped, by side), rescue_frac, pushout_frac (fractions of valid tokens),
            ratio_mean / ratio_min / ratio_max over valid units, approx_kl = mean(old - logp) over valid tokens.
            Nothing is read back to the host: the caller decides when to.
    """
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"cfg must be nsr.LossConfig, got {type(cfg).__name__}")
    adv, valid = _check(log_probs, old_log_probs, advantages, mask)
    lr = torch.where(valid, log_probs - old_log_probs.detach(), 0.0)  # (B, T); garbage in padding stays out
    if cfg.level == "sequence":  # GSPO: s_i = exp(mean_t log r_t), straight-through: sg(s_i) * pi_t / sg(pi_t)
        u_seq = lr.detach().sum(-1, keepdim=True) / torch.count_nonzero(valid, -1).unsqueeze(-1).clamp(min=1)
        u = u_seq + (lr - lr.detach())
    else:
        u = lr
    log_ratio = u.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # zero gradient outside, as OpenRLHF
    ratio = log_ratio.exp()
    out = RULES[cfg.rule](RuleInput(ratio, log_ratio, adv, cfg, generator, valid, log_probs, old_log_probs))
    loss = out.loss
    if cfg.dual_clip is not None:  # docs/method.md: after the rule; such units are neither rescued nor clipped
        dual = (adv < 0) & (ratio.detach() > cfg.dual_clip)
        loss = torch.where(dual, -cfg.dual_clip * adv, loss)
        out = RuleOutput(loss, *(_without(m, dual) for m in out[1:]))
    loss = torch.where(valid, loss, 0.0)
    return loss, _metrics(out, ratio, lr, valid, ratio_units)


def aggregate(loss_tok: torch.Tensor, mask: torch.Tensor | None, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    token-mean: sum over valid tokens / number of valid tokens (DAPO). seq-mean-token-mean: mean over sequences
    with at least one valid token of each sequence's token-mean (GRPO, GSPO). An empty mask gives 0, not NaN.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode={mode!r} is not valid; allowed: {', '.join(AGG_MODES)}")
    m = torch.ones_like(loss_tok, dtype=torch.bool) if mask is None else mask.bool()
    masked = torch.where(m, loss_tok, 0.0)
    if mode == "token-mean":
        return masked.sum() / torch.count_nonzero(m).clamp(min=1)
    counts = torch.count_nonzero(m, -1)
    seq = masked.sum(-1) / counts.clamp(min=1)
    return seq.sum() / (counts > 0).sum().clamp(min=1)
