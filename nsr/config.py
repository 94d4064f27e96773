"""The two configs of the method: :class:`LossConfig` (clip rule) and :class:`AdvantageConfig`.

Both are frozen dataclasses validated at construction, so a bad sweep value fails before any work starts,
with a ``ValueError`` that names the field and the allowed values. Every number must be finite (NaN and inf are
refused) and inside the range its docstring gives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from nsr.registry import ADVANTAGES, RULES
from nsr.value_checks import check_choice, check_number

# Level-dependent defaults (docs/method.md, "Setting" and the GSPO [choice] on delta):
# token level = DAPO (eps 0.2 / 0.28, delta 0.2); sequence level = GSPO (eps 3e-4 / 4e-4, delta 4e-4).
LEVEL_DEFAULTS = {
    "token": {"eps_low": 0.2, "eps_high": 0.28, "delta": 0.2},
    "sequence": {"eps_low": 3e-4, "eps_high": 4e-4, "delta": 4e-4},
}
LEVELS = tuple(LEVEL_DEFAULTS)
EXECUTORS = ("noisy", "clean")
DECISION_RULES = ("noisy_decision", "clean_decision")
AGG_MODES = ("token-mean", "seq-mean-token-mean")


def _number(cls: str, field: str, value, allowed: str, ok) -> None:
    check_number(f"{cls}.{field}", value, allowed, ok)


def _choice(cls: str, field: str, value, allowed) -> None:
    check_choice(f"{cls}.{field}", value, allowed)


@dataclass(frozen=True)
class LossConfig:
    """Which policy-gradient objective to use, and its parameters (docs/method.md)."""

    rule: str = "hard"
    """Clip rule, one of ``nsr.RULES`` (docs/method.md, "Every rule"): hard, nsr, soft, pushout, nsr_pushout,
    noisy_decision, clean_decision, cispo, sapo, noclip (nsr/objectives.py); gppo, ce_gppo, dcpo, clip_cov, kl_cov,
    dppo_tv (nsr/related.py)."""
    level: Literal["token", "sequence"] = "token"
    """token: per-token ratio (PPO/GRPO/DAPO). sequence: GSPO ratio exp(mean_t log r_t) with sequence bounds."""
    eps_low: float | None = None
    """Lower trust-region width: region is [1 - eps_low, 1 + eps_high]. None -> 0.2 (token) or 3e-4 (sequence)."""
    eps_high: float | None = None
    """Upper trust-region width. None -> 0.28 (token) or 4e-4 (sequence)."""
    delta: float | None = None
    """Half-width of z ~ U(1 - delta, 1 + delta) used by nsr, soft, pushout, nsr_pushout.
    None -> 0.2 (token) or 4e-4 (sequence, where delta lives on the eps scale)."""
    executor: Literal["noisy", "clean"] = "noisy"
    """Ratio that multiplies A for a rescued token: noisy = r*z (paper default, ~1/r^2 decay) or clean = r."""
    ratio_noise: float = 0.0
    """sigma of xi ~ U(1 - sigma, 1 + sigma) for noisy_decision / clean_decision; must be 0 for other rules."""
    dual_clip: float | None = None
    """Dual-clip constant (> 1): tokens with A < 0 and r > dual_clip get zero gradient. None = off."""
    sapo_tau_pos: float = 1.0
    """SAPO gate temperature for A > 0."""
    sapo_tau_neg: float = 1.05
    """SAPO gate temperature for A < 0."""
    cispo_cap: float | None = 5.0
    """CISPO's upper bound on its IS weight min(r, cispo_cap) (>= 1); CISPO has no lower bound. MiniMax-M1
    (arXiv 2506.13585) sets no effective lower bound and tunes only the upper one; verl's CISPO example sets
    clip_ratio_low 10 for that reason. The default 5.0 is the absolute cap TRL recommends for loss_type="cispo"
    (its epsilon_high). None = 1 + eps_high, the cap of verl's cispo (clip_ratio_high on the eps scale).
    Used by rule cispo only."""
    ce_gppo_beta1: float = 0.5
    """CE-GPPO (arXiv 2509.20712): scale of the kept gradient of clipped A < 0 units (r < 1 - eps_low), in
    [0, 10]; published 0.5 or 0.75. Used by rule ce_gppo only (nsr/related.py, as the fields below)."""
    ce_gppo_beta2: float = 1.0
    """CE-GPPO: scale of the kept gradient of clipped A > 0 units (r > 1 + eps_high), in [0, 10]; published 1."""
    dcpo_cap: float = 10.0
    """DCPO (arXiv 2509.02333): cap of the dynamic upper bound hi(q) (> 1); the authors' max(clip_ratio_c, 10)."""
    clip_cov_frac: float = 2e-4
    """Clip-Cov (arXiv 2505.22617): fraction of the valid tokens detached, in (0, 1]; published 2e-4 (the tiny
    presets use 1e-2: docs/method.md [choice])."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower bound of the covariance band of the tokens it may detach (published 1)."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound of that band (> clip_cov_lb; published 5)."""
    kl_cov_frac: float = 2e-3
    """KL-Cov (arXiv 2505.22617): fraction of the valid tokens penalized, in (0, 1]; published 2e-3 (Qwen2.5-7B
    recipe; 2e-4 for 32B and verl's default; the tiny presets use 1e-2)."""
    kl_cov_coef: float = 1.0
    """KL-Cov: coefficient of |log r| on the penalized tokens (>= 0; published 1)."""
    dppo_delta: float = 0.15
    """DPPO-TV (arXiv 2602.04879): threshold on the probability change pi - pi_old, in (0, 1); published 0.15."""
    dppo_cap: float = 20.0
    """DPPO-TV: truncation C of its IS weight min(r, C) (>= 1); verl's fallback 20 (its example script: 1e4)."""

    def __post_init__(self):
        name = type(self).__name__
        if not isinstance(self.rule, str) or not self.rule:
            raise ValueError(f"{name}.rule={self.rule!r} is not valid; allowed: {', '.join(RULES)}")
        RULES[self.rule]  # raises ValueError listing the valid rules
        _choice(name, "level", self.level, LEVELS)
        levels = RULES.info(self.rule).get("levels", LEVELS)
        if self.level not in levels:
            raise ValueError(
                f"{name}.level={self.level!r} is not valid for rule={self.rule!r}; allowed: {', '.join(levels)}"
            )
        # which level-dependent fields were left unset (None): a plug-in takes those from its framework's own keys
        # (nsr.trl: the trust region from GRPOConfig) and refuses a clash only with a value that was given
        unset = frozenset(key for key in LEVEL_DEFAULTS[self.level] if getattr(self, key) is None)
        object.__setattr__(self, "_unset", unset)
        for key, default in LEVEL_DEFAULTS[self.level].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, default)
        _number(name, "eps_low", self.eps_low, "0 < eps_low < 1", lambda v: 0 < v < 1)
        _number(name, "eps_high", self.eps_high, "eps_high > 0", lambda v: v > 0)
        _number(name, "delta", self.delta, "0 <= delta < 1", lambda v: 0 <= v < 1)
        _choice(name, "executor", self.executor, EXECUTORS)
        _number(name, "ratio_noise", self.ratio_noise, "0 <= ratio_noise < 1", lambda v: 0 <= v < 1)
        if self.ratio_noise and self.rule not in DECISION_RULES:
            raise ValueError(
                f"{name}.ratio_noise={self.ratio_noise!r} is only used by rules {', '.join(DECISION_RULES)}; "
                f"allowed for rule={self.rule!r}: 0"
            )
        if self.dual_clip is not None:
            _number(name, "dual_clip", self.dual_clip, "dual_clip > 1, or None (off)", lambda v: v > 1)
        _number(name, "sapo_tau_pos", self.sapo_tau_pos, "sapo_tau_pos > 0", lambda v: v > 0)
        _number(name, "sapo_tau_neg", self.sapo_tau_neg, "sapo_tau_neg > 0", lambda v: v > 0)
        if self.cispo_cap is not None:
            _number(name, "cispo_cap", self.cispo_cap, "cispo_cap >= 1, or None (1 + eps_high)", lambda v: v >= 1)
        for key in ("ce_gppo_beta1", "ce_gppo_beta2"):
            _number(name, key, getattr(self, key), f"0 <= {key} <= 10", lambda v: 0 <= v <= 10)
        _number(name, "dcpo_cap", self.dcpo_cap, "dcpo_cap > 1", lambda v: v > 1)
        for key in ("clip_cov_frac", "kl_cov_frac"):
            _number(name, key, getattr(self, key), f"0 < {key} <= 1", lambda v: 0 < v <= 1)
        _number(name, "clip_cov_lb", self.clip_cov_lb, "any clip_cov_lb < clip_cov_ub", lambda v: True)
        _number(name, "clip_cov_ub", self.clip_cov_ub, "clip_cov_ub > clip_cov_lb", lambda v: v > self.clip_cov_lb)
        _number(name, "kl_cov_coef", self.kl_cov_coef, "kl_cov_coef >= 0", lambda v: v >= 0)
        _number(name, "dppo_delta", self.dppo_delta, "0 < dppo_delta < 1", lambda v: 0 < v < 1)
        _number(name, "dppo_cap", self.dppo_cap, "dppo_cap >= 1", lambda v: v >= 1)

    def was_set(self, key: str) -> bool:
        """Whether the level-dependent field ``key`` (eps_low, eps_high, delta) was given, not left at None (its
        level's default). ``replace`` gives every field, so a replaced config has them all set."""
        return key not in self.__dict__.get("_unset", frozenset())

    @property
    def low(self) -> float:
        """Lower bound of the trust region, 1 - eps_low."""
        return 1.0 - self.eps_low

    @property
    def high(self) -> float:
        """Upper bound of the trust region, 1 + eps_high."""
        return 1.0 + self.eps_high

    def replace(self, **changes) -> LossConfig:
        return dataclasses.replace(self, **changes)


NOISE_MODES = ("mult", "add", "add_all")


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages (docs/method.md, intervention 1 and the related controls)."""

    kind: Literal["group_norm", "no_std", "positive_only", "random_reward"] = "group_norm"
    """group_norm: (R - mean_g) / (std_g + 1e-9) (GRPO/DAPO). no_std: R - mean_g (Dr. GRPO).
    positive_only: group_norm, then A < 0 -> 0 (WAPO). random_reward: rewards replaced by seeded
    Bernoulli(0.5) coin flips, then group_norm (control)."""
    noise: float = 0.0
    """sigma of the per-response Gaussian noise applied after normalization (0 = off)."""
    noise_mode: Literal["mult", "add", "add_all"] = "mult"
    """eps ~ N(0, 1), one per response. mult: A * (1 + sigma * eps). add: A + sigma * eps on the responses of groups
    with a nonzero advantage, A unchanged (0) in groups without one, so the noise changes the magnitude of a signal
    and never injects one. add_all: A + sigma * eps on every response, also giving random-sign advantages to groups
    whose rewards were all equal (the other reading of additive noise)."""

    def __post_init__(self):
        name = type(self).__name__
        _choice(name, "kind", self.kind, tuple(ADVANTAGES))
        _number(name, "noise", self.noise, "noise >= 0", lambda v: v >= 0)
        _choice(name, "noise_mode", self.noise_mode, NOISE_MODES)

    def replace(self, **changes) -> AdvantageConfig:
        return dataclasses.replace(self, **changes)
