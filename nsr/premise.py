"""The premise meter: where a run's clipped tokens lie relative to NSR's rescue zone, and what the rule did with them.

NSR can only act on clipped tokens whose ratio lies within its rescue zone (docs/method.md): a run whose clipped
tokens all lie deeper has no near-boundary signal for NSR to recover. The meter measures this in any trainer, for
any rule, at token level:

    meter = nsr.PremiseMeter(cfg)                     # cfg: the run's nsr.LossConfig (trust region, delta)
    loss_tok, met = nsr.policy_loss(logp, old, adv, mask, cfg, generator=g)
    meter.add(loss_tok, logp, adv, mask, old_log_probs=old)   # every update / micro-batch; no host sync
    row = meter.row(step)                             # once per step: one read of the device; then meter.reset()

Per advantage sign (``pos``: A > 0, ``neg``: A < 0) and depth bin, it counts

* ``clipped``: tokens the hard clip drops (:func:`nsr.theory.is_clipped`: A > 0 and r > 1 + eps_high, or A < 0 and
  r < 1 - eps_low), whatever the rule;
* ``rescued``: those of them whose per-token loss still has a gradient (d loss_t / d log pi_t != 0);
* ``weight``: the sum of that gradient relative to the unclipped one, d loss_t / d log pi_t / (-A r), measured from
  the loss's own autograd gradient, so it can be compared with :func:`nsr.expected_weight`.

Depth (:func:`nsr.theory.rescue_depth`) is 0 at the clip boundary and 1 at the far edge of the rescue zone of
``cfg.delta``; :data:`N_BINS` equal bins cover [0, 1), one more bin holds the deeper violations. ``row`` is one
line of a run folder's ratio_bins.jsonl (docs/design.md); :func:`rates` turns counts into the numbers that answer
"does my run have near-boundary signal": per side the *reach* (:func:`reach`: the share of clipped tokens within the
zone) and the in-zone clipped tokens per token.

Sync-free: ``add`` runs only fixed-shape tensor ops on the inputs' device (no ``.item()``, boolean indexing or
bincount), so a GPU trainer never waits for the host inside its update loop; the counts stay on the device until
``row`` / ``counts`` reads them (tests/test_premise.py checks it as tests/test_no_sync.py checks the loss).
"""

from __future__ import annotations

import torch

from nsr import theory
from nsr.config import LossConfig
from nsr.objectives import LOG_RATIO_CLAMP

N_BINS = 10
"""Equal depth bins over the rescue zone [0, 1); bin N_BINS holds the deeper violations."""
SIDES = ("pos", "neg")
"""Advantage signs, in the order of the meter's first axis: A > 0, A < 0."""
FIELDS = ("clipped", "rescued", "weight")
"""What each bin holds, in the order of the meter's second axis."""


def premise_counts(
    grad: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> torch.Tensor:
    """(2, 3, N_BINS + 1) float64 counts of one batch on its device: side (pos, neg) x (clipped, rescued, weight)
    x depth bin. ``grad``: d loss_t / d log pi_t; ``ratio``: the token ratios r (detached); ``adv``: (B, T), or
    (B,) / (B, 1) per sequence; ``mask``: (B, T) bool, True on real tokens. Fixed shapes only (no host sync)."""
    n = N_BINS + 1
    with torch.no_grad():
        adv = adv.reshape(len(adv), -1).expand_as(ratio)  # one advantage per response, over its tokens
        clipped = mask & theory.is_clipped(ratio, adv, cfg)
        depth = theory.rescue_depth(ratio, adv, cfg)
        b = (depth * N_BINS).floor().clamp(0, N_BINS).long()
        pos, neg = clipped & (adv > 0), clipped & (adv < 0)
        # one cell per (side, bin); tokens that are not clipped go to a last cell that is dropped
        cell = torch.where(pos, b, torch.where(neg, b + n, 2 * n)).reshape(-1)
        kept = (pos | neg) & (grad != 0)
        weight = torch.where(kept, grad / (-adv * ratio), 0.0).double().reshape(-1)
        out = torch.zeros(3, 2 * n + 1, dtype=torch.float64, device=ratio.device)
        out[0].index_add_(0, cell, (pos | neg).reshape(-1).double())
        out[1].index_add_(0, cell, kept.reshape(-1).double())
        out[2].index_add_(0, cell, weight)
        return out[:, : 2 * n].reshape(3, 2, n).transpose(0, 1)


def token_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    """r = exp(clamp(log pi - log pi_old, -20, 20)), detached: the ratio ``nsr.policy_loss`` clips at token level."""
    return torch.exp((log_probs.detach() - old_log_probs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


class PremiseMeter:
    """Per-step counts of clipped tokens by depth into NSR's rescue zone, and what the rule did with them (see the
    module docstring). One meter per run (and process); :meth:`reset` after each step's :meth:`row`.

    Args:
        cfg: the run's LossConfig (its trust region and delta set the zone; token level: at sequence level a token's
            ratio is not what the rule clips, so the meter refuses it).
        device: where the counts live (default: the device of the first batch added).
    """

    N_BINS = N_BINS

    def __init__(self, cfg: LossConfig, device: torch.device | str | None = None):
        if not isinstance(cfg, LossConfig):
            raise TypeError(f"cfg must be nsr.LossConfig, got {type(cfg).__name__}")
        if cfg.level != "token":
            raise ValueError(f"PremiseMeter: LossConfig.level={cfg.level!r} is not valid; allowed: token")
        self.cfg = cfg
        self.device = None if device is None else torch.device(device)
        self.acc: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None
        """Valid tokens added since the last reset (0-dim, on the meter's device)."""
        self.tokens_adv: torch.Tensor | None = None
        """Those of them with a nonzero advantage (the tokens a policy-gradient update moves)."""
        if self.device is not None:
            self.reset()

    def reset(self) -> None:
        """Zero the counts (the start of a step)."""
        shape = (2, 3, N_BINS + 1)  # side (pos, neg) x (clipped, rescued, weight) x bin
        dev = self.device if self.device is not None else (self.acc.device if self.acc is not None else "cpu")
        self.acc = torch.zeros(shape, dtype=torch.float64, device=dev)
        self.tokens = torch.zeros((), dtype=torch.float64, device=dev)
        self.tokens_adv = torch.zeros((), dtype=torch.float64, device=dev)

    def add(
        self,
        loss_tok: torch.Tensor,
        log_probs: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        *,
        old_log_probs: torch.Tensor | None = None,
        ratio: torch.Tensor | None = None,
        grad: torch.Tensor | None = None,
    ) -> None:
        """Add one batch (an update or micro-batch). ``loss_tok``: the rule's (B, T) per-token loss, a function of
        ``log_probs`` (B, T); ``adv``: (B, T), (B,) or (B, 1); ``mask``: (B, T) bool. The token ratios are ``ratio``
        if given, else computed from ``old_log_probs`` (:func:`token_ratio`). ``grad``: d loss_t / d log pi_t if the
        caller has it, else taken here with autograd (through the loss only, not the model; graph retained)."""
        if ratio is None:
            if old_log_probs is None:
                raise ValueError("PremiseMeter.add needs old_log_probs or ratio")
            ratio = token_ratio(log_probs, old_log_probs)
        if grad is None:
            (grad,) = torch.autograd.grad(loss_tok.sum(), log_probs, retain_graph=True)  # d loss_t / d log pi_t
        counts = premise_counts(grad, ratio, adv, mask.bool(), self.cfg)
        if self.acc is None:
            self.device = counts.device
            self.reset()
        self.acc += counts
        self.tokens += mask.sum()
        self.tokens_adv += (mask.bool() & (adv.reshape(len(adv), -1).expand_as(mask) != 0)).sum()

    def counts(self) -> torch.Tensor:
        """The (2, 3, N_BINS + 1) float64 counts so far (on the meter's device, not copied)."""
        if self.acc is None:
            self.reset()
        return self.acc

    def row(self, step: int) -> dict:
        """The ratio_bins.jsonl row of ``step`` (one read of the counts): step, delta, executor, and per side the
        clipped and rescued counts and the weight sums (rounded to 6 decimals) of the N_BINS + 1 bins; the valid
        tokens and those with a nonzero advantage."""
        packed = torch.cat([self.counts().reshape(-1), self.tokens.reshape(1), self.tokens_adv.reshape(1)]).cpu()
        return counts_row(packed[:-2].reshape(self.acc.shape), step, self.cfg, packed[-2], packed[-1])


def counts_row(counts: torch.Tensor, step: int, cfg: LossConfig, tokens=None, tokens_adv=None) -> dict:
    """The ratio_bins.jsonl row of (2, 3, N_BINS + 1) ``counts`` (host tensor) at ``step``; with ``tokens`` (the
    valid tokens the counts are over) and ``tokens_adv`` (those with a nonzero advantage) when given (older rows
    have neither)."""
    out = {"step": step, "delta": cfg.delta, "executor": cfg.executor}
    for side, name in enumerate(SIDES):
        for j, what in enumerate(FIELDS):
            vals = counts[side, j]
            out[f"{name}_{what}"] = (
                [round(v, 6) for v in vals.tolist()] if what == "weight" else [int(v) for v in vals.tolist()]
            )
    for key, value in (("tokens", tokens), ("tokens_adv", tokens_adv)):
        if value is not None:
            out[key] = int(round(float(value)))
    return out


RATE_KEYS = tuple(f"{side}_{what}" for side in SIDES for what in ("clipped_zone", "clipped_deep", "rescued", "weight"))
"""The per-token rates of :func:`rates`, per side: clipped tokens within the rescue zone and deeper, rescued tokens,
and their summed gradient weight, each over the valid tokens."""


def rates(counts: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """{RATE_KEYS: 0-dim tensors} of (2, 3, N_BINS + 1) ``counts`` over ``tokens`` valid tokens, on their device (no
    host read): what the verl plug-in logs per micro-batch. Reach per side is clipped_zone / (clipped_zone +
    clipped_deep); clipped_zone is the in-zone clipped mass per token."""
    t = tokens.to(counts.dtype).clamp(min=1.0)
    out = {}
    for side, name in enumerate(SIDES):
        out[f"{name}_clipped_zone"] = counts[side, 0, :N_BINS].sum() / t
        out[f"{name}_clipped_deep"] = counts[side, 0, N_BINS] / t
        out[f"{name}_rescued"] = counts[side, 1].sum() / t
        out[f"{name}_weight"] = counts[side, 2].sum() / t
    return out


def reach(clipped_zone: float, clipped_deep: float) -> float:
    """Reach of one side: the share of its clipped tokens within the rescue zone (NaN when none is clipped)."""
    total = clipped_zone + clipped_deep
    return clipped_zone / total if total else float("nan")
