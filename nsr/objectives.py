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

Speed (``python -m experiments.bench_loss``; tests/test_bench_loss.py checks the rescue and push-out paths bit
for bit against a plain implementation). On CPU, ops that make or read bool tensors (``where``, ``masked_fill``,
comparisons into bool) cost 3-8 times a float multiply, so masks are float 0/1 tensors from comparisons written
into float tensors (``lt_``), and a choice between two values is ``lerp`` with a 0/1 weight (exact). The rules
that rework a few % of the tokens (the clipped ones for nsr / soft, those within reach for push-out) gather them
by flat index (numpy's ``nonzero`` on CPU, faster than torch's) and touch only those. Padded tokens get log-ratio 0 (one
``where``); the min / max metrics correct for that fill only when it could be the extreme.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from nsr.config import AGG_MODES, LossConfig
from nsr.registry import Registry

try:  # only to find the clipped tokens faster on CPU (see _flat_nonzero); torch is enough without it
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

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
    """(B, T) contiguous advantages, zero at padded tokens (so padded tokens have zero loss under every rule)."""
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
        return t.take(idx)


class Subset(NamedTuple):
    """Some tokens, by flat (row-major) index ``idx`` (1-D int64), narrowed by the float 0/1 ``keep``."""

    idx: torch.Tensor
    pos: torch.Tensor
    """Float 1.0 where the token's advantage is positive, else 0.0 (same shape as idx)."""
    keep: torch.Tensor | None = None
    """Float 0/1, same shape as idx: 1.0 for the tokens in the subset; None: every token of ``idx``."""

    def count(self, pos_only: bool = False) -> int:
        """Number of tokens in the subset (with A > 0 only, if ``pos_only``)."""
        if self.keep is None and not pos_only:
            return self.idx.numel()
        f = self.pos if self.keep is None else self.keep * self.pos if pos_only else self.keep
        return int(f.sum(dtype=_count_dtype(f)))

    def without(self, drop: torch.Tensor) -> Subset:
        """The subset minus the tokens where the (B, T) bool ``drop`` is True."""
        out = (~drop.reshape(-1)[self.idx]).to(self.pos.dtype)
        return Subset(self.idx, self.pos, out if self.keep is None else self.keep * out)


class RuleOutput(NamedTuple):
    loss: torch.Tensor
    """(B, T) per-token loss value, 0 at padded tokens."""
    coef: torch.Tensor
    """(B, T) d loss / d u per token (u the unit's log-ratio), 0 at padded tokens."""
    clipped: torch.Tensor | Subset
    """Tokens the judge dropped (for clip_frac_low / clip_frac_high): a (B, T) float 0/1 mask, or a Subset."""
    rescued: Subset | None = None
    """Clipped tokens that the rule rescued, or None."""
    pushed: Subset | None = None
    """Unclipped tokens that push-out dropped, or None."""


Rule = Callable[[RuleInput], RuleOutput]
RULES: Registry[Rule] = Registry("LossConfig.rule")


def _uniform(shape, half_width: float, like: torch.Tensor, generator) -> torch.Tensor:
    z = torch.rand(shape, generator=generator, device=like.device, dtype=like.dtype)
    # (2h) * z + (1 - h): exactly 1 when h == 0, so delta = 0 reproduces hard clipping bit for bit.
    return z.mul_(2.0 * half_width).add_(1.0 - half_width)


def _count_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulator that sums 0/1 floats exactly: float32 below 2**24 elements, else float64."""
    return t.dtype if t.dtype == torch.float64 or (t.dtype == torch.float32 and t.numel() < 2**24) else torch.float64


class _Surrogates(NamedTuple):
    surr1: torch.Tensor
    """(B, T) r A (fresh: callers may reuse it in place)."""
    surr2: torch.Tensor
    """(B, T) clip(r, 1 - eps_low, 1 + eps_high) A."""
    loss: torch.Tensor
    """(B, T) -min(surr1, surr2): the PPO/DAPO min-form."""


def _times_adv(t: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """``t * adv``, in place when ``t`` has adv's (B, T) shape (a fresh temporary), else broadcast (GSPO's (B, 1))."""
    return t.mul_(adv) if t.shape == adv.shape else t * adv


def _surr12(x: RuleInput, ratio: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(r A, clip(r, lo, hi) A) with r = ``ratio`` (default: the clean ratio)."""
    r = x.ratio if ratio is None else ratio
    return r * x.adv, _times_adv(r.clamp(x.cfg.low, x.cfg.high), x.adv)


def _surrogates(x: RuleInput, ratio: torch.Tensor | None = None) -> _Surrogates:
    """PPO/DAPO min-form with judge = executor = ``ratio`` (default: the clean ratio)."""
    surr1, surr2 = _surr12(x, ratio)
    return _Surrogates(surr1, surr2, torch.minimum(surr1, surr2).neg_())


def _drop_mask(s: _Surrogates) -> torch.Tensor:
    """Float 1.0 where the judge drops the unit, i.e. ``surr2 < surr1`` (method.md: A > 0 and r > 1 + eps_high,
    or A < 0 and r < 1 - eps_low), else 0.0 (NaN too). Written over ``s.surr2``: on CPU a comparison into a float
    tensor costs a third of one that makes a bool tensor, and float masks are cheap to use."""
    return s.surr2.lt_(s.surr1)


def _dense_hard(x: RuleInput, ratio: torch.Tensor | None = None):
    """(loss, coef, drop): the hard clip with coef = -r A on kept units and 0 on dropped ones."""
    s = _surrogates(x, ratio)
    drop = _drop_mask(s)
    coef = s.surr1.mul_(drop - 1.0)  # -r A where kept (exact: times -1), 0 where dropped
    return s.loss, coef, drop


def _flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Flat (row-major) int64 indices of the nonzero entries of a bool or float 0/1 mask (on CPU, float -> bool is
    cheaper than making the mask with a bool comparison).

    On CPU this asks numpy, whose ``nonzero`` of a bool array is faster than torch's: inside the benchmark's
    loop (262k entries, 2.6 % True, one thread) about 125 us against 200 us; on a repeated call, where the branch
    predictor learns the mask, 30 us against 190 us (torch 2.13, numpy 2.4). The views share memory.
    """
    flat = mask.to(torch.bool).reshape(-1)
    if _np is None or flat.device.type != "cpu":
        return flat.nonzero().squeeze(1)
    return torch.from_numpy(_np.flatnonzero(flat.numpy())).long()


class _Clipped(NamedTuple):
    """The clipped tokens of a sparse rule, by flat (row-major) index, with their values there."""

    idx: torch.Tensor
    adv: torch.Tensor
    """A."""
    ratio: torch.Tensor
    """r of the token's unit."""
    pos: torch.Tensor
    """Float 1.0 where A > 0, else 0.0 (a clipped token has A != 0)."""
    loss: torch.Tensor
    """The hard-clip value -clip(r) A."""


def _sparse_hard(x: RuleInput):
    """(loss, coef, drop, clipped) for rules that rework the clipped units. ``loss`` and ``coef`` hold the kept
    value -r A everywhere: the caller must set both on every clipped token (``clipped``, a :class:`_Clipped`);
    ``drop`` is the float clipped mask."""
    cfg = x.cfg
    surr1, surr2 = _surr12(x)
    drop = surr2.lt_(surr1)
    idx = _flat_nonzero(drop)
    coef = surr1.neg_()
    adv, r = x.adv.take(idx), x.at(x.ratio, idx)
    hard_value = r.clamp(cfg.low, cfg.high).mul_(adv).neg_()  # -clip(r) A, as -min(r A, clip(r) A) there
    clipped = _Clipped(idx, adv, r, adv.sign().clamp_(min=0.0), hard_value)
    return coef.clone(), coef, drop, clipped  # a kept token's min-form value -min(r A, clip(r) A) is -r A


def _inside(pos: torch.Tensor, r: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Float 1.0 where ratio ``r`` is inside the region on the advantage's side (pos = 1.0, A > 0: r <= hi;
    pos = 0.0, A < 0: r >= lo), else 0.0. No bool ``where``: ``lerp`` with weight exactly 0 or 1 returns the
    start or end exactly (finite values), so it selects."""
    gap = torch.lerp(r - cfg.low, cfg.high - r, pos)  # hi - r (A > 0) or r - lo (A < 0)
    return gap.ge_(0.0)  # 1.0 iff gap >= 0 (a NaN ratio is outside)


def _inside_region(r: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Float 1.0 where lo <= r <= hi, else 0.0 (NaN too)."""
    return r.clamp(cfg.low, cfg.high).eq_(r)


def _rescue(x: RuleInput, loss: torch.Tensor, coef: torch.Tensor, cl: _Clipped) -> Subset:
    """method.md, NSR steps 1-4, on the clipped tokens ``cl`` only, in place on ``loss`` and ``coef``: sets both
    on every clipped token (rescued: -A r~; still clipped: the hard-clip value, zero gradient)."""
    idx = cl.idx
    if idx.numel() == 0:
        return Subset(idx, cl.pos)
    cfg, d = x.cfg, x.cfg.delta
    z = x.uniform(d, idx)  # NSR step 1: z ~ U(1 - delta, 1 + delta), per token (per sequence for GSPO)
    rz = z.mul_(cl.ratio)  # NSR step 2: candidate ratio
    # NSR step 3: back inside on the clipped side -> rescued. Unless delta is large, r z of a clipped token cannot
    # cross the other bound (A > 0: r > hi gives r z > hi (1 - d) > lo; A < 0: r z < lo (1 + d) < hi).
    if cfg.high * (1 - d) > cfg.low * (1 + 1e-4) and cfg.low * (1 + d) < cfg.high * (1 - 1e-4):
        ok = _inside_region(rz, cfg)
    else:
        ok = _inside(cl.pos, rz, cfg)
    exec_ratio = rz if cfg.executor == "noisy" else cl.ratio
    value = torch.mul(exec_ratio, cl.adv).neg_()  # loss -A r~ (z detached), which is also its d/du
    loss.put_(idx, torch.lerp(cl.loss, value, ok))  # rescued: -A r~; else the hard-clip value
    coef.put_(idx, value.mul_(ok))  # NSR step 4: not rescued -> stays clipped (zero gradient)
    return Subset(idx, cl.pos, ok)


def _pushout(x: RuleInput, coef: torch.Tensor, drop: torch.Tensor) -> Subset:
    """method.md intervention 4: an unclipped token with A != 0 is dropped iff r z would be clipped.

    Only tokens within reach of the boundary (A > 0: r > hi / (1 + delta); A < 0: r < lo / (1 - delta)) can be
    dropped, so z is drawn for those alone, in row-major order (at sequence level: one z per sequence); the
    others would be kept whatever their z. ``coef``: -r A on the tokens the judge kept, set to 0 in place on the
    pushed-out ones; ``drop``: (B, T) float, 1.0 on the tokens the judge dropped.
    """
    cfg = x.cfg
    d = cfg.delta
    if d == 0:
        return Subset(coef.new_zeros(0, dtype=torch.long), coef.new_zeros(0), coef.new_zeros(0))
    reach_lo, reach_hi = cfg.low / (1 - d), cfg.high / (1 + d)
    if reach_lo < reach_hi:
        # within reach iff clip(r, reach_lo, reach_hi) A < r A, i.e. (where coef = -r A exactly) gap < 0
        reach = _times_adv(x.ratio.clamp(reach_lo, reach_hi), x.adv)
        reach = reach.add_(coef).lt_(0.0)  # float 1.0 / 0.0; a NaN ratio is out of reach
    else:  # delta so large that every token with A != 0 is within reach
        reach = torch.ne(x.adv, 0.0, out=torch.empty_like(x.adv))
    idx = _flat_nonzero(reach.gt_(drop))  # within reach and kept (1 > 0)
    adv = x.adv.take(idx)
    pos = adv.sign().clamp_(min=0.0)
    if idx.numel() == 0:
        return Subset(idx, pos, pos)
    r = x.at(x.ratio, idx)
    rz = x.uniform(d, idx).mul_(r)
    if reach_lo < reach_hi * (1 - 1e-4):
        # then r z of a token within reach cannot cross the other bound (A > 0: r > hi / (1 + d) gives r z >
        # hi (1 - d) / (1 + d) > lo; A < 0: r z < hi likewise), so "inside on its side" is "inside"
        keep = _inside_region(rz, cfg)
    else:
        keep = _inside(pos, rz, cfg)
    coef.put_(idx, r.mul_(adv).neg_().mul_(keep))  # -A r (as before) if kept; dropped: loses its gradient only
    return Subset(idx, pos, 1.0 - keep)


@RULES.register("hard")
def hard(x: RuleInput) -> RuleOutput:
    """PPO/GRPO/DAPO clipping: L = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    return RuleOutput(*_dense_hard(x))


@RULES.register("nsr")
def nsr(x: RuleInput) -> RuleOutput:
    """Near-boundary Stochastic Rescue: a clipped token is rescued iff r z is back inside (method.md, NSR)."""
    loss, coef, _, cl = _sparse_hard(x)
    return RuleOutput(loss, coef, Subset(cl.idx, cl.pos), rescued=_rescue(x, loss, coef, cl))


@RULES.register("soft")
def soft(x: RuleInput) -> RuleOutput:
    """Deterministic twin of nsr: a clipped token's unclipped gradient times NSR's expected weight w(r).

    Its loss value is NSR's expected value too: -w A r + (1 - P(rescue)) * (hard-clip value), so soft with
    delta = 0 equals hard in value and gradient.
    """
    from nsr.theory import clipped_expectations

    loss, coef, _, cl = _sparse_hard(x)
    if cl.idx.numel():
        cfg = x.cfg
        # method.md intervention 3: w(r) of the configured executor, and P(rescue)
        p, w = clipped_expectations(cl.ratio, cl.pos, cfg, cfg.delta, 1 if cfg.executor == "noisy" else 0)
        grad_value = torch.mul(cl.ratio, cl.adv).mul_(w).neg_()  # -w A r with w constant: its d/du is itself
        loss.put_(cl.idx, grad_value + (1.0 - p) * cl.loss)
        coef.put_(cl.idx, grad_value)
    return RuleOutput(loss, coef, Subset(cl.idx, cl.pos))


@RULES.register("pushout")
def pushout(x: RuleInput) -> RuleOutput:
    """Push-out only: unclipped tokens may be dropped when r z crosses the boundary; clipped stay clipped."""
    loss, coef, drop = _dense_hard(x)
    return RuleOutput(loss, coef, drop, pushed=_pushout(x, coef, drop))


@RULES.register("nsr_pushout")
def nsr_pushout(x: RuleInput) -> RuleOutput:
    """Both directions: NSR rescue of clipped tokens and push-out of unclipped ones (independent draws)."""
    loss, coef, drop, cl = _sparse_hard(x)
    rescued = _rescue(x, loss, coef, cl)
    return RuleOutput(loss, coef, Subset(cl.idx, cl.pos), rescued=rescued, pushed=_pushout(x, coef, drop))


@RULES.register("noisy_decision")
def noisy_decision(x: RuleInput) -> RuleOutput:
    """Judge = executor = r xi, xi ~ U(1 - sigma, 1 + sigma) (method.md intervention 2)."""
    noisy = x.uniform(x.cfg.ratio_noise)
    noisy = noisy.mul_(x.ratio) if noisy.shape == x.adv.shape else noisy * x.ratio
    return RuleOutput(*_dense_hard(x, noisy))


@RULES.register("clean_decision")
def clean_decision(x: RuleInput) -> RuleOutput:
    """Judge = clean r, executor = r xi: a kept token's loss is -A r xi (method.md intervention 2)."""
    s = _surrogates(x)
    drop = _drop_mask(s)
    value = x.uniform(x.cfg.ratio_noise).mul_(x.ratio)  # r xi
    value = _times_adv(value, x.adv).neg_()
    loss = torch.lerp(value, s.loss, drop)  # hard-clip value where dropped, -A r xi where kept
    coef = value.mul_(1.0 - drop)  # -A r xi where kept, 0 where dropped (exact: times 1 or 0)
    return RuleOutput(loss, coef, drop)


@RULES.register("cispo")
def cispo(x: RuleInput) -> RuleOutput:
    """CISPO (MiniMax-M1): L = -sg(clip(r)) A log r; the IS weight is clipped, no token is dropped.

    The value uses log r instead of log pi: the two differ by a constant, so the gradient is MiniMax's.
    """
    surr1, w = _surr12(x)
    loss = (w * x.log_ratio).neg_()
    coef = w.neg()
    drop = w.lt_(surr1)  # out of region on the advantage's side, for the clip metrics only
    return RuleOutput(loss, coef, drop)


@RULES.register("sapo")
def sapo(x: RuleInput) -> RuleOutput:
    """SAPO soft gate: L = -(4 / tau) sigmoid(tau (r - 1)) A, tau = sapo_tau_pos (A > 0) or sapo_tau_neg."""
    cfg = x.cfg
    tau = torch.where(x.adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(x.adv.dtype)
    s = torch.sigmoid(tau * (x.ratio - 1.0))
    loss = (4.0 / tau * s * x.adv).neg_()
    coef = (4.0 * s * (1.0 - s) * x.ratio * x.adv).neg_()  # d/du of the gate: sigma'(.) tau r
    return RuleOutput(loss, coef, _drop_mask(_surrogates(x)))


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


def _count(s: torch.Tensor | Subset) -> int:
    """Number of tokens in a set given as a Subset or a (B, T) float 0/1 mask."""
    return s.count() if isinstance(s, Subset) else int(s.sum(dtype=_count_dtype(s)))


def _without(s: torch.Tensor | Subset, drop: torch.Tensor) -> torch.Tensor | Subset:
    """The set minus the tokens where the (B, T) bool ``drop`` is True."""
    return s.without(drop) if isinstance(s, Subset) else s.masked_fill(drop, 0.0)


def _clip_counts(clipped: torch.Tensor | Subset, adv: torch.Tensor) -> tuple[int, int]:
    """(clipped units, clipped units with A > 0); a clipped unit always has A != 0."""
    if isinstance(clipped, Subset):
        return clipped.count(), clipped.count(pos_only=True)
    n = _count(clipped)
    if n == 0:
        return 0, 0
    acc = _count_dtype(clipped)
    n_pos_minus_neg = int(torch.dot(clipped.reshape(-1).to(acc), adv.reshape(-1).sign().to(acc)))  # sum of sign(A)
    return n, (n + n_pos_minus_neg) // 2


def _token_minmax(u: torch.Tensor, valid: torch.Tensor, n: int):
    """min and max of the (B, T) log-ratio over valid tokens, where padded entries hold 0."""
    lo, hi = torch.aminmax(u)
    if 0 < n < valid.numel():  # a fill of 0 is the min (max) only if no real value is below (above) it
        if bool(lo >= 0):
            lo = torch.where(valid, u, float("inf")).amin()
        if bool(hi <= 0):
            hi = torch.where(valid, u, float("-inf")).amax()
    return lo, hi


def _seq_stats(u_seq: torch.Tensor, counts: torch.Tensor):
    """(sum weighted by token counts, min, max) of the (B, 1) sequence log-ratio over sequences with a token."""
    has = counts > 0
    if not bool(has.any()):
        z = u_seq.new_zeros(())
        return z.double(), z, z
    vals = u_seq.view(-1)[has.view(-1)]
    return (u_seq.view(-1).double() * counts.view(-1)).sum(), vals.min(), vals.max()


def _run_rule(u_unit, lr_tok, adv, valid, n, cfg, generator, sink):
    """Forward work shared by both levels. ``u_unit``: raw log-ratio per unit, (B, T) with padded entries 0,
    or (B, 1). ``n``: number of valid tokens."""
    seq = cfg.level == "sequence"
    if seq:
        counts = valid.sum(-1, keepdim=True)
        usum, umin, umax = _seq_stats(u_unit, counts)
    else:
        umin, umax = _token_minmax(u_unit, valid, n)
        usum = u_unit.sum(dtype=torch.float64)  # padded entries are 0
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
            clipped = _without(clipped, dual)
            rescued = None if rescued is None else _without(rescued, dual)
            pushed = None if pushed is None else _without(pushed, dual)
    # metrics (method.md / design.md): fractions of valid tokens
    denom = max(n, 1)
    n_clip, n_high = _clip_counts(clipped, adv)
    if seq:
        ratio_sum = (r.double() * counts).sum()  # token-weighted
        kl_sum = torch.where(valid, lr_tok, 0.0).sum(dtype=torch.float64)
    else:  # padded entries hold u = 0, r = 1
        ratio_sum = r.sum(dtype=torch.float64) - (valid.numel() - n)
        kl_sum = usum
    clampf = lambda v: torch.exp(v.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # noqa: E731
    dt = adv.dtype
    fracs = torch.tensor(
        [
            (n_clip - n_high) / denom,
            n_high / denom,
            n_clip / denom,
            0 if rescued is None else _count(rescued) / denom,
            0 if pushed is None else _count(pushed) / denom,
        ],
        dtype=dt,
    )
    one = torch.ones((), dtype=dt)
    sink.update(zip(("clip_frac_low", "clip_frac_high", "clip_frac", "rescue_frac", "pushout_frac"), fracs.unbind()))
    sink.update(
        ratio_mean=(ratio_sum / denom).to(dt) if n else one,
        ratio_min=clampf(umin).to(dt) if n else one,
        ratio_max=clampf(umax).to(dt) if n else one,
        approx_kl=(-kl_sum / denom).to(dt),
    )
    return loss, coef


class _TokenRule(torch.autograd.Function):
    """Per-token ratio. Forward runs the rule without a graph; backward is ``grad * coef``."""

    @staticmethod
    def forward(ctx, log_probs, old_log_probs, adv, valid, n, cfg, generator, sink):
        lr = log_probs.detach() - old_log_probs.detach()
        # padded entries get u = 0 (r = 1, and A = 0 there): finite whatever garbage the padding holds
        u = torch.where(valid, lr, 0.0) if n < valid.numel() else lr
        loss, coef = _run_rule(u, None, adv, valid, n, cfg, generator, sink)
        ctx.save_for_backward(coef)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (coef,) = ctx.saved_tensors
        return grad * coef, None, None, None, None, None, None, None


class _SeqRule(torch.autograd.Function):
    """Sequence ratio (GSPO): the rule acts on the (B, 1) log-ratio; its gradient sums over the tokens."""

    @staticmethod
    def forward(ctx, u_seq, lr_tok, adv, valid, n, cfg, generator, sink):
        loss, coef = _run_rule(u_seq.detach(), lr_tok, adv, valid, n, cfg, generator, sink)
        ctx.save_for_backward(coef)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (coef,) = ctx.saved_tensors
        return (grad * coef).sum(-1, keepdim=True), None, None, None, None, None, None, None


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
    n = int(torch.count_nonzero(valid))
    sink: dict[str, torch.Tensor] = {}
    if cfg.level == "token":
        loss = _TokenRule.apply(log_probs, old_log_probs, adv, valid, n, cfg, generator, sink)
    else:  # GSPO: s_i = exp(mean_t log r_t); the gradient flows through the mean (OpenRLHF's gspo)
        lr = torch.where(valid, log_probs - old_log_probs.detach(), 0.0)
        u_seq = lr.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
        loss = _SeqRule.apply(u_seq, lr.detach(), adv, valid, n, cfg, generator, sink)
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
        return masked.sum() / torch.count_nonzero(m).clamp(min=1)
    counts = m.sum(-1)
    seq = masked.sum(-1) / counts.clamp(min=1)
    return seq.sum() / (counts > 0).sum().clamp(min=1)
