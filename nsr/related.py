"""Contemporary fixes for the clipping bottleneck, as rules of ``nsr.RULES`` (docs/method.md, "Related methods").

Each rule is one plain function in the contract of :mod:`nsr.objectives` (the formula reads off the code;
``.detach()`` is sg(.)), with its source and the public code it was checked against. Region I = [lo, hi] =
[1 - eps_low, 1 + eps_high]; r = pi / pi_old; q = pi_old. None of these sources defines a sequence-level form, so
every rule here is registered with ``levels=("token",)`` and ``LossConfig`` refuses ``level: sequence`` for it.

======== ====================================================== ============================================
rule     loss per token                                         published defaults (LossConfig field)
======== ====================================================== ============================================
gppo     -A r outside the clip; clipped: -A * b * r / sg(r),    eps 0.2 / 0.28 (Klear recipe; dual clip 10 in
         b = 1 + eps_high (A > 0) or 1 - eps_low (A < 0)        the recipe = loss.dual_clip, off here)
ce_gppo  gppo with b times beta1 (A < 0 side) / beta2 (A > 0)   ce_gppo_beta1 0.5 (paper also 0.75; Klear's
                                                                script 0.25), ce_gppo_beta2 1.0
dcpo     -min(r A, clip(r, lo(q), hi(q)) A),                    eps 0.2 / 0.28, dcpo_cap 10 (dual clip 10 in
         lo(q) = (1 + sqrt(max(0, 1 - 4 eps_low / q))) / 2,     the recipe = loss.dual_clip, off here)
         hi(q) = min((1 + sqrt(1 + 4 eps_high / q)) / 2, cap)
clip_cov PPO min-form; a random clip_cov_frac x n_valid of the  clip_cov_frac 2e-4, bounds (1, 5); the
         unclipped tokens with lb < cov < ub get loss 0         recipe's PPO bounds are eps 1 / 1
kl_cov   -A r (no clip) + kl_cov_coef |log r| on the top        kl_cov_frac 2e-3 (7B recipe; 2e-4 for 32B
         kl_cov_frac x n_valid tokens by cov                    and verl's default), kl_cov_coef 1
dppo_tv  -A sg(min(r, C)) log r on kept tokens, 0 on dropped;   dppo_delta 0.15, dppo_cap C 1e4 (the example
         A > 0 drops pi - q > delta, A < 0 pi - q < -delta      scripts; LossConfig's default 20 is unpublished)
======== ====================================================== ============================================

cov = (A - mean A)(log pi - mean log pi), means over the minibatch's valid tokens (Clip-Cov / KL-Cov); the token
counts are floor(frac x n_valid), at least 1, kept as tensors: the selection is a partial one (``torch.topk`` of
the static count floor(frac x B x T) >= k, then the tokens beyond the k-th key and, of those tied with it, the first
in position order: the tokens a stable sort would take), never ``nonzero`` / ``.item()`` / ``randperm``, so the loss
path has no host-device sync and costs what verl's implementations cost (``python -m experiments.bench.loss
--verl``). Clip-Cov's random choice draws one uniform priority per token from the run's generator and takes the k
smallest among the eligible tokens.

Tiny-scale fractions ([choice], docs/method.md): a tiny minibatch has ~384 valid tokens (32 x 8 responses of 6
tokens / 4 minibatches), so the published 2e-4 floors to the minimum of 1 token per minibatch. The tiny testbed's
value (preset tiny-regime, and the ``*_scaled`` arms of sweeps/related.yaml) is clip_cov_frac = kl_cov_frac = 1e-2
(3 tokens; ``loss.clip_cov_frac=1e-2 loss.kl_cov_frac=1e-2``), a share
still below the share of tokens the hard clip drops there (docs/method.md, "[choice] Clip-Cov / KL-Cov at tiny scale").
The cluster presets keep the published 2e-4 (Clip-Cov) and 2e-3 (KL-Cov, Qwen2.5-7B recipe).

Metrics (nsr.METRIC_KEYS): clip_frac_low / clip_frac_high count the tokens each rule's own bounds flag (GPPO and
CE-GPPO: those whose gradient is rescaled, also reported as rescue_frac when their beta is > 0; DPPO-TV: the
dropped tokens; KL-Cov: none); Clip-Cov's detached tokens are unclipped tokens it drops, so they are pushout_frac.
"""

from __future__ import annotations

import math

import torch

from nsr import theory
from nsr.objectives import RuleInput, RuleOutput, ppo_loss, register_rule

TOKEN_ONLY = ("token",)


def register(name: str, weight=None, hard_at_ratio_one=True, zero_at_zero_advantage: bool = True):
    """``register_rule`` at token level only: LossConfig refuses ``level: sequence`` for these rules."""
    return register_rule(
        name,
        weight=weight,
        levels=TOKEN_ONLY,
        hard_at_ratio_one=hard_at_ratio_one,
        zero_at_zero_advantage=zero_at_zero_advantage,
    )


# ------------------------------------------------------------------ GPPO and CE-GPPO
def _gppo(x: RuleInput, beta_low: float, beta_high: float) -> RuleOutput:
    r, A, cfg = x.ratio, x.adv, x.cfg
    low, high = theory.clip_sides(r.detach(), A, cfg)
    bound = torch.where(high, beta_high * cfg.high, beta_low * cfg.low)  # b, times beta on its side
    lp = x.log_probs  # padding masked to 0
    kept_gradient = -A * bound * torch.exp(lp - lp.detach())  # value -A b, d/d log pi = -A b at any ratio
    loss = torch.where(low | high, kept_gradient, -A * r)
    rescued = (low & (beta_low > 0)) | (high & (beta_high > 0))
    return RuleOutput(loss, low, high, rescued=rescued)


def weight_gppo(r, s, cfg):
    """Clipped units keep the gradient of the bound: weight (1 + eps_high) / r (A > 0) or (1 - eps_low) / r."""
    low, high = theory.clip_sides(r, s, cfg)
    return torch.where(high, cfg.high / r, torch.where(low, cfg.low / r, 1.0))


def weight_ce_gppo(r, s, cfg):
    low, high = theory.clip_sides(r, s, cfg)
    return torch.where(high, cfg.ce_gppo_beta2 * cfg.high / r, torch.where(low, cfg.ce_gppo_beta1 * cfg.low / r, 1.0))


@register("gppo", weight=weight_gppo)
def gppo(x: RuleInput) -> RuleOutput:
    """GPPO, gradient-preserving clipping (Klear-Reasoner, arXiv 2508.07629).

    A clipped unit keeps the hard-clip loss value but not a zero gradient: L = -A b r / sg(r) with b = 1 + eps_high
    (A > 0, r > 1 + eps_high) or 1 - eps_low (A < 0, r < 1 - eps_low), so d L / d log pi = -A b; other units -A r.
    Checked against Kwai-Klear/KlearReasoner ``compute_gppo_loss`` (verl/trainer/ppo/core_algos.py, commit 3422f6d):
    ``-A clamp(r, lo / sg(r) r, hi / sg(r) r)`` under the PPO max, which is this. Recipe: eps 0.2 / 0.28 and dual
    clip 10 (``loss.dual_clip``; the harness's arms leave it off for every rule alike).
    """
    return _gppo(x, 1.0, 1.0)


@register("ce_gppo", weight=weight_ce_gppo)
def ce_gppo(x: RuleInput) -> RuleOutput:
    """CE-GPPO (arXiv 2509.20712): GPPO with the rescued gradient scaled by beta1 on the low side (A < 0,
    r < 1 - eps_low) and beta2 on the high side (A > 0, r > 1 + eps_high): L = -A beta b r / sg(r) there.

    Checked against KlearReasoner ``compute_gppo_loss_general_beta`` (same file; ``gppo_loss_beta1`` multiplies
    (1 - eps_low) on the A < 0 side, ``gppo_loss_beta2`` (1 + eps_high) on the A > 0 side). Published beta1 0.5 or
    0.75 and beta2 1 (the repo's example script uses beta1 0.25); LossConfig ce_gppo_beta1 = 0.5, ce_gppo_beta2 = 1.
    beta1 = beta2 = 1 is gppo; beta1 = beta2 = 0 is hard clip.
    """
    return _gppo(x, x.cfg.ce_gppo_beta1, x.cfg.ce_gppo_beta2)


# ------------------------------------------------------------------ DCPO
def dcpo_bounds(old_prob: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """DCPO's per-token bounds from the old probability q:
    lo(q) = (1 + sqrt(max(0, 1 - 4 eps_low / q))) / 2, hi(q) = min((1 + sqrt(1 + 4 eps_high / q)) / 2, dcpo_cap)."""
    q = old_prob
    lo = (1.0 + torch.sqrt((1.0 - 4.0 * cfg.eps_low / q).clamp(min=0.0))) / 2.0
    hi = ((1.0 + torch.sqrt(1.0 + 4.0 * cfg.eps_high / q)) / 2.0).clamp(max=cfg.dcpo_cap)
    return lo, hi


@register("dcpo")
def dcpo(x: RuleInput) -> RuleOutput:
    """DCPO, dynamic adaptive clipping (arXiv 2509.02333): the PPO min-form with bounds that depend on the old
    token probability q (:func:`dcpo_bounds`): L = -min(r A, clip(r, lo(q), hi(q)) A). A rare token (small q) may
    move further up (hi(q) grows as q falls, up to dcpo_cap); lo(q) stays in [0.5, (1 + sqrt(1 - 4 eps_low)) / 2].

    Checked against lime-RL/DCPO ``get_clip_low_high`` and ``compute_policy_loss_dcpo`` with clip_type "dynamic"
    (verl/trainer/ppo/core_algos.py, commit 01787b0): the same bounds, capped at max(clip_ratio_c, 10); the recipe
    (recipe/dcpo/run_dcpo.sh) uses eps 0.2 / 0.28 and clip_ratio_c 10, which also sets a dual clip of 10
    (``loss.dual_clip`` here, off in the harness's arms). Its q = 0 special case (a sampled token never has q = 0)
    is not reproduced. Its other parts (smooth advantage standardization, OTM loss) are not clip rules.
    """
    r, A = x.ratio, x.adv
    lo, hi = dcpo_bounds(x.old_log_probs.exp(), x.cfg)
    loss = -torch.minimum(r * A, torch.minimum(torch.maximum(r, lo), hi) * A)
    rd = r.detach()
    return RuleOutput(loss, (A < 0) & (rd < lo), (A > 0) & (rd > hi))


# ------------------------------------------------------------------ Clip-Cov and KL-Cov
def centred_covariance(x: RuleInput) -> torch.Tensor:
    """(A - mean A)(log pi - mean log pi) per token, means over the valid tokens; constant (no gradient)."""
    valid = x.valid
    n = valid.sum().clamp(min=1)
    logp = torch.where(valid, x.raw_log_probs.detach(), 0.0)  # x.log_probs, outside the graph
    mean_a = x.adv.sum() / n  # both are 0 on padding: sums over the valid tokens
    mean_logp = logp.sum() / n
    return (x.adv - mean_a) * (logp - mean_logp)


def token_budget(frac: float, valid: torch.Tensor) -> torch.Tensor:
    """floor(frac x number of valid tokens), at least 1: a 0-dim tensor (no host read)."""
    return torch.floor(frac * valid.sum().to(torch.float64)).clamp(min=1).to(torch.long)


def static_budget(frac: float, valid: torch.Tensor) -> int:
    """The largest :func:`token_budget` the shape allows, floor(frac x B x T) (at least 1, at most B x T): known
    without reading a tensor, so a partial selection of that many tokens needs no host sync."""
    n = valid.numel()
    return min(max(math.floor(frac * n), 1), max(n, 1))


def first_k(
    key: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor, descending: bool, k_max: int | None = None
) -> torch.Tensor:
    """Bool mask of the min(k, #eligible) eligible tokens with the smallest (or largest) ``key``; among equal keys
    the first in (row, token) order, as a stable sort would take them.

    A partial selection, not a sort: ``torch.topk`` of ``k_max`` >= k (a static count, :func:`static_budget`;
    default all tokens) gives the k-th key; the tokens strictly beyond it are in, and of the tokens equal to it the
    first k - (#beyond) by position (a cumulative sum). k stays a tensor, so nothing is read back to the host.
    """
    far = -torch.inf if descending else torch.inf
    flat = torch.where(eligible, key, far).reshape(-1)
    n = flat.numel()
    k_max = n if k_max is None else min(k_max, n)
    if n == 0:
        return eligible.clone()
    kth_values = torch.topk(flat, k_max, largest=descending, sorted=True).values
    kth = kth_values.gather(0, (k.clamp(1, k_max) - 1).reshape(1))  # the k-th key (far if fewer are eligible)
    beyond = (flat > kth) if descending else (flat < kth)  # never an ineligible token: its key is far
    n_beyond = ((kth_values > kth) if descending else (kth_values < kth)).sum()  # all of them are in the top k_max
    tied = (flat == kth) & eligible.reshape(-1)
    chosen = beyond | (tied & (torch.cumsum(tied, 0) <= k - n_beyond))
    return chosen.view_as(key)


@register("clip_cov", hard_at_ratio_one=False, zero_at_zero_advantage=False)
def clip_cov(x: RuleInput) -> RuleOutput:
    """Clip-Cov (The Entropy Mechanism of RL for Reasoning LMs, arXiv 2505.22617): the PPO min-form, and k =
    max(floor(clip_cov_frac x n_valid), 1) tokens drawn at random among the unclipped valid tokens whose centred
    covariance lies in (clip_cov_lb, clip_cov_ub) get loss 0 (value and gradient), so the high-covariance tokens
    that drive entropy down are not pushed further.

    Checked against verl ``compute_policy_loss_clip_cov`` (verl/trainer/ppo/core_algos.py, commit b178a3c) and the
    authors' PRIME-RL/Entropy-Mechanism-of-RL (commit 8850579): the same eligibility (strict bounds, tokens PPO
    already clips excluded) and count; they draw the k tokens with ``randperm``, here k smallest uniform priorities
    (the same distribution: a uniformly random k-subset). Published: clip_cov_frac 2e-4, bounds (1, 5); the
    authors' recipes (recipe/dapo/7b_clip_cov.sh, 32b_clip_cov.sh) widen PPO's own bounds to eps 1 / 1 (any eps
    here: its region is [1 - eps_low, 1 + eps_high]).
    """
    r, A, cfg = x.ratio, x.adv, x.cfg
    low, high = theory.clip_sides(r.detach(), A, cfg)
    cov = centred_covariance(x)
    eligible = x.valid & ~(low | high) & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    priority = torch.rand(A.shape, generator=x.generator, device=A.device, dtype=A.dtype)
    k, k_max = token_budget(cfg.clip_cov_frac, x.valid), static_budget(cfg.clip_cov_frac, x.valid)
    detached = first_k(priority, eligible, k, descending=False, k_max=k_max)
    loss = torch.where(detached, 0.0, ppo_loss(r, A, cfg))
    return RuleOutput(loss, low, high, pushed=detached)


@register("kl_cov", zero_at_zero_advantage=False)
def kl_cov(x: RuleInput) -> RuleOutput:
    """KL-Cov (arXiv 2505.22617): no ratio clip; L = -A r, plus kl_cov_coef |log r| on the k = max(floor(kl_cov_frac
    x n_valid), 1) valid tokens with the largest centred covariance.

    Checked against verl ``compute_policy_loss_kl_cov`` (commit b178a3c) and the authors' ``compute_policy_loss_
    kl_cov`` (k_percent is a percentage there: 0.2 -> 2e-3 in recipe/dapo/7b_kl_cov.sh, 0.02 -> 2e-4 in 32b): the
    same top-k (``torch.topk`` there; here a partial selection, ties taken in position order) and penalty;
    ppo_kl_coef 1. LossConfig kl_cov_frac = 2e-3 (the 7B recipe, the scale of the cluster presets), kl_cov_coef = 1.
    """
    r, A, cfg = x.ratio, x.adv, x.cfg
    k, k_max = token_budget(cfg.kl_cov_frac, x.valid), static_budget(cfg.kl_cov_frac, x.valid)
    top = first_k(centred_covariance(x), x.valid, k, descending=True, k_max=k_max)
    loss = -A * r + torch.where(top, cfg.kl_cov_coef * x.log_ratio.abs(), 0.0)
    return RuleOutput(loss)


# ------------------------------------------------------------------ DPPO-TV
@register("dppo_tv")
def dppo_tv(x: RuleInput) -> RuleOutput:
    """DPPO-Binary-TV (Rethinking the Trust Region in LLM RL, arXiv 2602.04879): a trust region on the
    probability change (total variation of the token's binary distribution), one-sided by the advantage's sign.
    A > 0 drops a token when pi - q > dppo_delta, A < 0 when pi - q < -dppo_delta; a kept token has
    L = -A sg(min(r, C)) log r (truncated IS, C = dppo_cap), a dropped one L = 0.

    Checked against verl ``compute_policy_loss_dppo_tv`` (verl-project/verl after PR 5397, which cites the paper;
    sail-sg/Stable-RL points to it): the same masks (<= / >= delta kept) and truncation. verl writes the value with
    log pi; log r = log pi - log q differs by a constant, so the gradient is the same. Published delta 0.15 (both
    sides; examples/dppo_trainer/run_qwen30b_dppo.sh); C: the example scripts set 1e4
    (no truncation in practice; the paper's scripts disable it "for a fair comparison"). LossConfig keeps
    dppo_delta = 0.15, dppo_cap = 20; sweeps/related.yaml sets the published 1e4. The gradient carrier is the
    unclamped log-ratio, as verl's log pi, so a kept token beyond the loss path's +/-20 log-ratio clamp still
    gets its gradient.
    """
    A, cfg = x.adv, x.cfg
    change = x.log_probs.detach().exp() - x.old_log_probs.exp()  # pi - q
    keep = torch.where(A > 0, change <= cfg.dppo_delta, change >= -cfg.dppo_delta)
    weight = x.ratio.detach().clamp(max=cfg.dppo_cap)
    log_ratio = x.log_probs - x.old_log_probs  # unclamped (padding 0): a gradient at any ratio
    loss = torch.where(keep, -A * weight * log_ratio, 0.0)
    dropped = ~keep & (A != 0)
    return RuleOutput(loss, dropped & (A < 0), dropped & (A > 0))
