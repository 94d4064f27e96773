"""Policy-gradient objectives: every clip rule of method.md, pure torch.

Each rule sees one batch of *units* (tokens, or sequences for GSPO) and returns, per token, the loss value and
its derivative with respect to the unit's log-ratio ``u = log r``. A single ``torch.autograd.Function`` turns
that pair into a differentiable per-token loss, so autograd keeps no graph for the rule itself: the backward
pass is one multiply. This is what makes the stochastic rules cost about the same as hard clipping.

Conventions shared by every rule (method.md, "Setting"):

* ``r = exp(clamp(u, -20, 20))``; the clamp kills the gradient outside that range, as OpenRLHF does.
* A unit is *clipped* (judge says drop) iff ``A > 0 and r > 1 + eps_high`` or ``A < 0 and r < 1 - eps_low``.
* For a kept unit the loss is ``-A * r_exec`` with ``r_exec`` the executor ratio and noise detached, so
  its gradient with respect to ``u`` equals the loss value. A dropped unit keeps the hard-clip value
  ``-A * clip(r)`` (or ``-A * r`` for push-out) with zero gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from nsr.config import AGG_MODES, LossConfig
from nsr.registry import Registry

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


class RuleInput(NamedTuple):
    """What a rule sees. All tensors are (B, T) token views; at sequence level ``ratio`` is the (B, 1)
    sequence ratio broadcast over T and the noise helpers draw one value per sequence."""

    ratio: torch.Tensor
    """(B, T) or broadcastable (B, 1): r = exp(clamped log-ratio)."""
    log_ratio: torch.Tensor
    """Same shape as ratio: the clamped log-ratio u."""
    adv: torch.Tensor
    """(B, T) advantages, zero at padded tokens (so padded tokens have zero loss under every rule)."""
    valid: torch.Tensor
    """(B, T) bool mask of real tokens."""
    cfg: LossConfig
    generator: torch.Generator | None

    @property
    def sequence(self) -> bool:
        return self.cfg.level == "sequence"

    def uniform(self, half_width: float, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Samples of U(1 - h, 1 + h): one per unit, dense (B, T) or (B, 1), or at flat token indices ``idx``.

        At sequence level one value is drawn per sequence and shared by its tokens (method.md, GSPO variant).
        """
        B, T = self.adv.shape
        if self.sequence:
            z = _uniform((B, 1), half_width, self.adv, self.generator)
            return z if idx is None else z.view(-1)[torch.div(idx, T, rounding_mode="floor")]
        shape = (B, T) if idx is None else idx.shape
        return _uniform(shape, half_width, self.adv, self.generator)

    def at(self, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Values of a (B, T) or (B, 1) tensor at flat token indices."""
        if self.sequence and t.shape[-1] == 1:
            return t.view(-1)[torch.div(idx, self.adv.shape[-1], rounding_mode="floor")]
        return t.reshape(-1)[idx]


class RuleOutput(NamedTuple):
    loss: torch.Tensor
    """(B, T) per-token loss value, 0 at padded tokens."""
    coef: torch.Tensor
    """(B, T) d loss / d u per token (u the unit's log-ratio), 0 at padded tokens."""
    clipped: torch.Tensor
    """(B, T) bool: the judge dropped this token (for clip_frac_low / clip_frac_high)."""
    rescued: torch.Tensor | None = None
    """Flat token indices of clipped tokens that the rule rescued, or None."""
    pushed: torch.Tensor | None = None
    """Flat token indices of unclipped tokens that push-out dropped, or None."""


Rule = Callable[[RuleInput], RuleOutput]
RULES: Registry[Rule] = Registry("LossConfig.rule")


def _uniform(shape, half_width: float, like: torch.Tensor, generator) -> torch.Tensor:
    z = torch.rand(shape, generator=generator, device=like.device, dtype=like.dtype)
    # (2h) * z + (1 - h): exactly 1 when h == 0, so delta = 0 reproduces hard clipping bit for bit.
    return z.mul_(2.0 * half_width).add_(1.0 - half_width)


def _hard(x: RuleInput, ratio: torch.Tensor | None = None):
    """PPO/DAPO min-form with judge = executor = ``ratio`` (default: the clean ratio).

    Returns (loss, coef, clipped, surr1): loss = -min(r A, clip(r) A); coef = -r A where kept, else 0.
    """
    r = x.ratio if ratio is None else ratio
    cfg = x.cfg
    surr1 = r * x.adv
    surr2 = r.clamp(cfg.low, cfg.high) * x.adv
    clipped = surr2 < surr1  # method.md: clipped iff A>0 & r>1+eps_high or A<0 & r<1-eps_low
    loss = torch.minimum(surr1, surr2).neg_()
    coef = surr1.neg_().masked_fill_(clipped, 0.0)  # for a kept unit d(-r A)/du = -r A
    return loss, coef, clipped


def _side_ok(adv: torch.Tensor, r: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """True where ratio ``r`` is inside the region on the advantage's clipped side (A > 0: r <= hi; A < 0: r >= lo)."""
    return torch.where(adv > 0, r <= cfg.high, r >= cfg.low)


def _rescue(x: RuleInput, loss: torch.Tensor, coef: torch.Tensor, clipped: torch.Tensor) -> torch.Tensor:
    """method.md, NSR steps 1-4, on the clipped tokens only (in place on ``loss`` and ``coef``)."""
    idx = clipped.view(-1).nonzero().squeeze(1)
    if idx.numel() == 0:
        return idx
    r = x.at(x.ratio, idx)
    adv = x.adv.view(-1)[idx]
    z = x.uniform(x.cfg.delta, idx)  # NSR step 1: z ~ U(1 - delta, 1 + delta), per token (per sequence for GSPO)
    rz = r * z  # NSR step 2: candidate ratio
    ok = _side_ok(adv, rz, x.cfg)  # NSR step 3: back inside on the clipped side -> rescued
    sel = idx[ok]
    exec_ratio = rz[ok] if x.cfg.executor == "noisy" else r[ok]
    value = exec_ratio.mul_(adv[ok]).neg_()  # loss -A r~ (z detached); its d/du is the same value
    loss.view(-1)[sel] = value
    coef.view(-1)[sel] = value
    return sel


def _pushout(x: RuleInput, coef: torch.Tensor, clipped: torch.Tensor) -> torch.Tensor:
    """method.md intervention 4: an unclipped token with A != 0 is dropped iff r z would be clipped.

    Only tokens within reach of the boundary (A > 0: r > hi / (1 + delta); A < 0: r < lo / (1 - delta)) can be
    dropped, so z is drawn for those alone; the others would be kept whatever their z.
    """
    cfg = x.cfg
    d = cfg.delta
    if d == 0:
        return clipped.new_zeros(0, dtype=torch.long)
    reach_lo, reach_hi = cfg.low / (1 - d), cfg.high / (1 + d)
    if reach_lo < reach_hi:
        reach = x.ratio.clamp(reach_lo, reach_hi) * x.adv < x.ratio * x.adv
    else:  # delta so large that every token with A != 0 is within reach
        reach = (x.adv != 0).expand_as(clipped)
    idx = (reach & ~clipped).view(-1).nonzero().squeeze(1)
    if idx.numel() == 0:
        return idx
    rz = x.at(x.ratio, idx) * x.uniform(d, idx)
    drop = ~_side_ok(x.adv.view(-1)[idx], rz, cfg)
    sel = idx[drop]
    coef.view(-1)[sel] = 0.0  # dropped: keeps its loss value -A r, loses its gradient
    return sel


@RULES.register("hard")
def hard(x: RuleInput) -> RuleOutput:
    """PPO/GRPO/DAPO clipping: L = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    loss, coef, clipped = _hard(x)
    return RuleOutput(loss, coef, clipped)


@RULES.register("nsr")
def nsr(x: RuleInput) -> RuleOutput:
    """Near-boundary Stochastic Rescue: a clipped token is rescued iff r z is back inside (method.md, NSR)."""
    loss, coef, clipped = _hard(x)
    return RuleOutput(loss, coef, clipped, rescued=_rescue(x, loss, coef, clipped))


@RULES.register("soft")
def soft(x: RuleInput) -> RuleOutput:
    """Deterministic twin of nsr: a clipped token's unclipped gradient times NSR's expected weight w(r).

    Its loss value is NSR's expected value too: -w A r + (1 - P(rescue)) * (hard-clip value), so soft with
    delta = 0 equals hard in value and gradient.
    """
    from nsr.theory import rescue_weight, side_expectation

    loss, coef, clipped = _hard(x)
    idx = clipped.view(-1).nonzero().squeeze(1)
    if idx.numel():
        cfg = x.cfg
        r, adv = x.at(x.ratio, idx), x.adv.view(-1)[idx]
        w = rescue_weight(r, adv, cfg)  # method.md intervention 3: w(r) of the configured executor
        p = w if cfg.executor == "clean" else side_expectation(r, adv, cfg, cfg.delta, 0)
        grad_value = (r * adv).mul_(w).neg_()  # -w A r with w constant: its d/du is itself
        flat = loss.view(-1)
        flat[idx] = grad_value + (1.0 - p) * flat[idx]
        coef.view(-1)[idx] = grad_value
    return RuleOutput(loss, coef, clipped)


@RULES.register("pushout")
def pushout(x: RuleInput) -> RuleOutput:
    """Push-out only: unclipped tokens may be dropped when r z crosses the boundary; clipped stay clipped."""
    loss, coef, clipped = _hard(x)
    return RuleOutput(loss, coef, clipped, pushed=_pushout(x, coef, clipped))


@RULES.register("nsr_pushout")
def nsr_pushout(x: RuleInput) -> RuleOutput:
    """Both directions: NSR rescue of clipped tokens and push-out of unclipped ones (independent draws)."""
    loss, coef, clipped = _hard(x)
    rescued = _rescue(x, loss, coef, clipped)
    return RuleOutput(loss, coef, clipped, rescued=rescued, pushed=_pushout(x, coef, clipped))


@RULES.register("noisy_decision")
def noisy_decision(x: RuleInput) -> RuleOutput:
    """Judge = executor = r xi, xi ~ U(1 - sigma, 1 + sigma) (method.md intervention 2)."""
    noisy = x.ratio * x.uniform(x.cfg.ratio_noise)
    loss, coef, clipped = _hard(x, noisy)
    return RuleOutput(loss, coef, clipped)


@RULES.register("clean_decision")
def clean_decision(x: RuleInput) -> RuleOutput:
    """Judge = clean r, executor = r xi: a kept token's loss is -A r xi (method.md intervention 2)."""
    loss, _, clipped = _hard(x)
    value = (x.ratio * x.uniform(x.cfg.ratio_noise) * x.adv).neg_()
    loss = torch.where(clipped, loss, value)
    coef = value.masked_fill_(clipped, 0.0)
    return RuleOutput(loss, coef, clipped)


@RULES.register("cispo")
def cispo(x: RuleInput) -> RuleOutput:
    """CISPO (MiniMax-M1): L = -sg(clip(r)) A log r; the IS weight is clipped, no token is dropped.

    The value uses log r instead of log pi: the two differ by a constant, so the gradient is MiniMax's.
    """
    cfg = x.cfg
    w = x.ratio.clamp(cfg.low, cfg.high) * x.adv
    clipped = w < x.ratio * x.adv  # out of region on the advantage's side, for the clip metrics only
    loss = (w * x.log_ratio).neg_()
    return RuleOutput(loss, w.neg_(), clipped)


@RULES.register("sapo")
def sapo(x: RuleInput) -> RuleOutput:
    """SAPO soft gate: L = -(4 / tau) sigmoid(tau (r - 1)) A, tau = sapo_tau_pos (A > 0) or sapo_tau_neg."""
    cfg = x.cfg
    tau = torch.where(x.adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(x.adv.dtype)
    s = torch.sigmoid(tau * (x.ratio - 1.0))
    loss = (4.0 / tau * s * x.adv).neg_()
    coef = (4.0 * s * (1.0 - s) * x.ratio * x.adv).neg_()  # d/du of the gate: sigma'(.) tau r
    clipped = x.ratio.clamp(cfg.low, cfg.high) * x.adv < x.ratio * x.adv
    return RuleOutput(loss, coef, clipped)


def _check(log_probs, old_log_probs, advantages, mask):
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
    valid = mask if mask.dtype == torch.bool else mask.bool()
    adv = torch.where(valid, advantages.to(log_probs.dtype), 0.0)  # zero A -> zero loss and gradient on padding
    return adv, valid


def _stats(u_raw: torch.Tensor, valid: torch.Tensor, n: int, weights: torch.Tensor | None = None):
    """(sum, min, max) of ``u_raw`` over valid units. Token level: ``u_raw`` is (B, T) with padded entries
    filled by a valid value, so min/max need no mask; sequence level: (B, 1) with token counts as weights."""
    if weights is None:
        lo, hi = torch.aminmax(u_raw)
        return u_raw.sum(dtype=torch.float64), lo, hi
    has = weights > 0
    if not bool(has.any()):
        z = u_raw.new_zeros(())
        return z.double(), z, z
    vals = u_raw.view(-1)[has.view(-1)]
    return (u_raw.view(-1).double() * weights.view(-1)).sum(), vals.min(), vals.max()


def _run_rule(u_unit, lr_tok, adv, valid, cfg, generator, sink, token_fill=None):
    """Forward work shared by both levels. ``u_unit``: raw log-ratio per unit, (B, T) or (B, 1)."""
    B, T = adv.shape
    n = int(valid.sum())
    seq = cfg.level == "sequence"
    counts = valid.sum(-1, keepdim=True) if seq else None
    usum, umin, umax = _stats(u_unit, valid, n, counts)
    clamp_needed = bool(umin < -LOG_RATIO_CLAMP) or bool(umax > LOG_RATIO_CLAMP)
    u = u_unit.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clamp_needed else u_unit
    r = torch.exp(u)
    out = RULES[cfg.rule](RuleInput(r, u, adv, valid, cfg, generator))
    loss, coef, clipped = out.loss, out.coef, out.clipped  # padded tokens have A = 0, hence loss = coef = 0
    if clamp_needed:  # clamp's gradient is zero outside [-20, 20], as in OpenRLHF
        coef = coef.masked_fill(((u_unit < -LOG_RATIO_CLAMP) | (u_unit > LOG_RATIO_CLAMP)).expand_as(coef), 0.0)
    rescued, pushed = out.rescued, out.pushed
    if cfg.dual_clip is not None:  # method.md: dual clip applies after the rule, and is neither rescue nor clip
        dual = (adv < 0) & (r > cfg.dual_clip)
        if bool(dual.any()):
            loss = torch.where(dual, -cfg.dual_clip * adv, loss)
            coef = coef.masked_fill(dual, 0.0)
            clipped = clipped & ~dual
            flat = dual.view(-1)
            rescued = None if rescued is None else rescued[~flat[rescued]]
            pushed = None if pushed is None else pushed[~flat[pushed]]
    # metrics (method.md / design.md): fractions of valid tokens
    denom = max(n, 1)
    n_clip = int(clipped.sum())
    n_high = int((clipped & (adv > 0)).sum()) if n_clip else 0
    ratio_mean = (r.double() * counts).sum() if seq else r.sum(dtype=torch.float64)  # token-weighted
    if token_fill is not None:  # token level: padded entries hold a copy of one valid value, remove them
        n_pad = valid.numel() - n
        usum = usum - n_pad * token_fill.double()
        ratio_mean = ratio_mean - n_pad * torch.exp(token_fill.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).double()
    kl_sum = usum if lr_tok is None else torch.where(valid, lr_tok, 0.0).sum(dtype=torch.float64)
    clampf = lambda v: torch.exp(v.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # noqa: E731
    dt = adv.dtype
    sink.update(
        clip_frac_low=torch.tensor((n_clip - n_high) / denom, dtype=dt),
        clip_frac_high=torch.tensor(n_high / denom, dtype=dt),
        clip_frac=torch.tensor(n_clip / denom, dtype=dt),
        rescue_frac=torch.tensor(0 if rescued is None else rescued.numel() / denom, dtype=dt),
        pushout_frac=torch.tensor(0 if pushed is None else pushed.numel() / denom, dtype=dt),
        ratio_mean=(ratio_mean / denom).to(dt) if n else torch.ones((), dtype=dt),
        ratio_min=clampf(umin).to(dt) if n else torch.ones((), dtype=dt),
        ratio_max=clampf(umax).to(dt) if n else torch.ones((), dtype=dt),
        approx_kl=(-kl_sum / denom).to(dt),
    )
    return loss, coef


class _TokenRule(torch.autograd.Function):
    """Per-token ratio. Forward runs the rule without a graph; backward is ``grad * coef``."""

    @staticmethod
    def forward(ctx, log_probs, old_log_probs, adv, valid, cfg, generator, sink):
        lr = log_probs.detach() - old_log_probs.detach()
        n = int(valid.sum())
        fill = None
        if n < valid.numel():
            # Padded entries take the value of one real token, so min/max need no mask and stay finite.
            first = lr.view(-1)[valid.view(-1).to(torch.uint8).argmax()] if n else lr.new_zeros(())
            fill = first
            u = torch.where(valid, lr, first)
        else:
            u = lr
        loss, coef = _run_rule(u, None, adv, valid, cfg, generator, sink, token_fill=fill)
        ctx.save_for_backward(coef)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (coef,) = ctx.saved_tensors
        return grad * coef, None, None, None, None, None, None


class _SeqRule(torch.autograd.Function):
    """Sequence ratio (GSPO): the rule acts on the (B, 1) log-ratio; its gradient sums over the tokens."""

    @staticmethod
    def forward(ctx, u_seq, lr_tok, adv, valid, cfg, generator, sink):
        loss, coef = _run_rule(u_seq.detach(), lr_tok, adv, valid, cfg, generator, sink)
        ctx.save_for_backward(coef)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (coef,) = ctx.saved_tensors
        return (grad * coef).sum(-1, keepdim=True), None, None, None, None, None, None


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    cfg: LossConfig,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss of ``cfg.rule``.

    Args:
        log_probs: (B, T) float, log pi_theta of the sampled tokens; gradients flow here only.
        old_log_probs: (B, T) float, log pi_old (behaviour policy), treated as constant.
        advantages: (B, T) float (or (B,) / (B, 1), broadcast over tokens).
        mask: (B, T) bool, True on real response tokens (None = all real).
        cfg: the rule and its parameters.
        generator: torch.Generator on the tensors' device for every random draw (None = torch's global RNG).

    Returns:
        loss_tok: (B, T), zero where mask is False; reduce it with :func:`aggregate`.
        metrics: dict of 0-dim tensors, keys ``METRIC_KEYS``: clip_frac_low / clip_frac_high / clip_frac
            (tokens the judge dropped, by side), rescue_frac, pushout_frac (fractions of valid tokens),
            ratio_mean / ratio_min / ratio_max over valid units, approx_kl = mean(old - logp) over valid tokens.
    """
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"cfg must be nsr.LossConfig, got {type(cfg).__name__}")
    adv, valid = _check(log_probs, old_log_probs, advantages, mask)
    sink: dict[str, torch.Tensor] = {}
    if cfg.level == "token":
        loss = _TokenRule.apply(log_probs, old_log_probs, adv, valid, cfg, generator, sink)
    else:  # GSPO: s_i = exp(mean_t log r_t); the gradient flows through the mean (OpenRLHF's gspo)
        lr = torch.where(valid, log_probs - old_log_probs.detach(), 0.0)
        u_seq = lr.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
        loss = _SeqRule.apply(u_seq, lr.detach(), adv, valid, cfg, generator, sink)
    return loss, sink


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
        return masked.sum() / m.sum().clamp(min=1)
    counts = m.sum(-1)
    seq = masked.sum(-1) / counts.clamp(min=1)
    return seq.sum() / (counts > 0).sum().clamp(min=1)
