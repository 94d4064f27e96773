"""NSR: Near-boundary Stochastic Rescue and the clip rules it is compared with, in pure torch.

Public API (docs/design.md): ``LossConfig``, ``policy_loss``, ``aggregate``, ``expected_weight``, ``RULES``,
``AdvantageConfig``, ``compute_advantages``, ``PremiseMeter`` (nsr.premise), ``needs_stale_ratios``. Nothing here
imports a trainer framework; the OpenRLHF adapter lives in ``nsr.openrlhf`` and is imported only on demand.
"""

from nsr import related  # noqa: F401  (registers gppo, ce_gppo, dcpo, clip_cov, kl_cov, dppo_tv in RULES)
from nsr.advantages import ADVANTAGES, compute_advantages
from nsr.config import AdvantageConfig, LossConfig
from nsr.objectives import (
    LOG_RATIO_CLAMP,
    METRIC_KEYS,
    METRIC_REDUCE,
    RULES,
    aggregate,
    needs_stale_ratios,
    policy_loss,
)
from nsr.premise import PremiseMeter
from nsr.theory import expected_weight

__all__ = [
    "ADVANTAGES",
    "LOG_RATIO_CLAMP",
    "METRIC_KEYS",
    "METRIC_REDUCE",
    "RULES",
    "AdvantageConfig",
    "LossConfig",
    "PremiseMeter",
    "aggregate",
    "compute_advantages",
    "expected_weight",
    "needs_stale_ratios",
    "policy_loss",
]
