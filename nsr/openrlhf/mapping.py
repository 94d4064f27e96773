"""Every correspondence between the NSR configs and OpenRLHF 0.11.2's flags, and every refusal of an OpenRLHF option
the NSR layer does not support: one module, used by the argv builder (experiments/openrlhf/argv.py), the launcher
(nsr/openrlhf/launch.py), the loss adapter (nsr/openrlhf/loss.py) and the loss benchmark.

Imports neither openrlhf nor torch, so a dry run works anywhere. Each ``check_*`` raises ``ValueError`` whose message
names the flag (OpenRLHF's dotted name, or the RunConfig key in brackets) and the allowed values; callers re-raise it
as their own error type (ConfigError before submission, LaunchError in the launcher, ValueError in the loss).
"""

from __future__ import annotations

LOSS_TYPE: dict[str, str] = {"token": "ppo", "sequence": "gspo"}
"""nsr level (``LossConfig.level``) -> ``--actor.policy_loss_type``. OpenRLHF's gspo is the sequence ratio
exp(mean_t log r_t); its other types (e.g. cispo) have no nsr level."""

LEVEL: dict[str, str] = {v: k for k, v in LOSS_TYPE.items()}
"""``--actor.policy_loss_type`` -> nsr level."""

ESTIMATOR: dict[str, str] = {
    "group_norm": "group_norm",
    "no_std": "dr_grpo",  # Dr. GRPO's r - mean
    "positive_only": "group_norm",  # + the controller's A < 0 -> 0 (nsr/openrlhf/interventions.py)
    "random_reward": "group_norm",  # the controller's coin flips first, then group_norm
}
"""``AdvantageConfig.kind`` -> ``--algo.advantage.estimator``."""

FROM_OPENRLHF = ("level", "eps_low", "eps_high", "dual_clip")
"""LossConfig fields set by OpenRLHF's own flags (--actor.policy_loss_type, --actor.eps_clip_low_high,
--actor.dual_clip): one value drives both OpenRLHF and the rule, so they have no --nsr.* flag."""


def level_of(policy_loss_type: str) -> str:
    """The nsr level of ``--actor.policy_loss_type``."""
    if policy_loss_type not in LEVEL:
        raise ValueError(
            f"--actor.policy_loss_type={policy_loss_type!r} is not supported by the NSR layer; "
            f"allowed: {', '.join(LEVEL)}"
        )
    return LEVEL[policy_loss_type]


def check_estimator(kind: str, estimator: str) -> None:
    """``--algo.advantage.estimator`` must be the one ``AdvantageConfig.kind`` maps to."""
    want = ESTIMATOR[kind]
    if estimator != want:
        raise ValueError(
            f"--nsr.adv_kind {kind} needs --algo.advantage.estimator {want}, got {estimator}; allowed: {want}"
        )


def check_is_correction(rule: str, is_correction_level: str) -> None:
    """vLLM importance-sampling correction lives inside OpenRLHF's PolicyLoss.forward; only ``hard`` delegates to
    it, so every other rule would silently drop it."""
    if rule != "hard" and is_correction_level != "off":
        raise ValueError(
            f"--algo.advantage.is_correction_level={is_correction_level!r} (vLLM IS correction) is only supported "
            f"with --nsr.rule hard, got rule {rule!r}; allowed: off"
        )


def check_parallelism(ring_attn_size: int, tensor_parallel_size: int) -> None:
    """The loss's random stream (z) is seeded by the data-parallel rank. With ring attention or DeepSpeed tensor
    parallelism several ranks hold pieces of the same sample and would need the same z; the layer does not
    supply it, so those options are refused."""
    if ring_attn_size != 1:
        raise ValueError(
            f"--ds.ring_attn_size={ring_attn_size} is not supported by the NSR layer (ranks of one ring would draw "
            "different z for the same sample); allowed: 1"
        )
    if tensor_parallel_size != 1:
        raise ValueError(
            f"--ds.tensor_parallel_size={tensor_parallel_size} is not supported by the NSR layer (tensor-parallel "
            "ranks would draw different z for the same sample); allowed: 1"
        )


def check_random_reward(kind: str, dynamic_filtering: bool, overlong_buffer_len: int) -> None:
    """The random-reward control must be prompt- and length-neutral: OpenRLHF's dynamic filtering drops groups by
    their true scores before the coin flips, and its overlong penalty is added to the flips."""
    if kind != "random_reward":
        return
    if dynamic_filtering:
        raise ValueError(
            "advantages.kind=random_reward with dynamic filtering (--algo.dynamic_filtering_enable, "
            "[openrlhf.dynamic_filtering]): the filter keeps prompts by their true scores, so the control is not "
            "prompt-neutral; allowed: openrlhf.dynamic_filtering=false"
        )
    if overlong_buffer_len:
        raise ValueError(
            f"advantages.kind=random_reward with an overlong penalty (--reward.overlong_buffer_len="
            f"{overlong_buffer_len}, [openrlhf.overlong_buffer_len]): the penalty is added to the coin flips, so the "
            "control is not length-neutral; allowed: openrlhf.overlong_buffer_len=0"
        )
