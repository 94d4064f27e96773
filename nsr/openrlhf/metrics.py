"""OpenRLHF 0.11.2's logged ``train/*`` scalars, mapped onto the run folder's metrics.jsonl names (docs/design.md).

Part of the plug-in: the launcher's ``--nsr.metrics_path`` writes one such row per RL step from the controller
(:class:`nsr.openrlhf.actors.NSRPPOTrainer`); ``experiments.openrlhf.tensorboard`` rebuilds the same rows from
TensorBoard event files.

OpenRLHF's controller logs one dict per RL step (``PPOTrainer.save_logs_and_checkpoints``); its TensorBoard logger
writes every key ``k`` as the scalar tag ``train/<k>`` at step ``global_step`` (so ``rollout/reward_mean`` becomes
``train/rollout/reward_mean``), and wandb logs the same names. The NSR layer adds its own keys through
``experience.info`` (``nsr_clip_frac_low``, ``nsr_rescue_frac``, ...; nsr/openrlhf/loss.py), which OpenRLHF logs the
same way. Every value is already a mean over the step's micro-batches and ranks (token-weighted for the 0-dim
per-micro-batch metrics), so one logged dict is one metrics.jsonl row.

    from nsr.openrlhf.metrics import row_from_logs
    row = row_from_logs(3, {"policy_loss": 0.1, "rollout/reward_mean": 0.4, ...})

Keys a run did not log (e.g. ``rescue_frac`` in a plain OpenRLHF run) are ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# Our metrics.jsonl name -> OpenRLHF logged keys (without the ``train/`` prefix), first present wins.
REQUIRED: dict[str, tuple[str, ...]] = {
    # rollout/* is computed over every sample of the rollout before any split; reward / response_length are the
    # per-sample means over the micro-batches the actor trained on (drop_last may skip a few), used as fallback.
    "reward_mean": ("rollout/reward_mean", "reward"),
    # mean token entropy: OpenRLHF's (only with --actor.entropy_coef, a full-vocabulary tensor) or NSRPolicyLoss's
    # Monte-Carlo estimate, the mean of -log p of the sampled tokens (free; what the cluster presets log)
    "entropy": ("entropy_loss", "nsr_entropy_mc"),
    "response_len": ("rollout/response_length_mean", "response_length"),
    "clip_frac_low": ("nsr_clip_frac_low",),
    "clip_frac_high": ("nsr_clip_frac_high",),
    "rescue_frac": ("nsr_rescue_frac",),
    "pushout_frac": ("nsr_pushout_frac",),
    "ppo_kl": ("ppo_kl",),  # masked mean of old_logp - logp, as nsr's approx_kl
    "policy_loss": ("policy_loss",),
    "grad_norm": ("actor_grad_norm",),  # the last optimizer step's norm of the RL step (OpenRLHF keeps the last)
    "wall_s": ("timing/step_total",),  # seconds this RL step took (generation + experience + train + sync)
}

EXTRAS: dict[str, tuple[str, ...]] = {
    "clip_frac": ("nsr_clip_frac", "ppo_clip_ratio"),  # OpenRLHF's own clip ratio = our clip_frac
    "ratio_mean": ("nsr_ratio_mean",),
    "ratio_min": ("nsr_ratio_min",),  # mean over micro-batches of each micro-batch's min
    "ratio_max": ("nsr_ratio_max",),  # mean over micro-batches of each micro-batch's max
    "lr": ("actor_lr",),
    "kl_ref": ("kl",),
    "reward_std": ("rollout/reward_std",),
    "group_reward_std": ("group_reward_std",),
    "truncated_frac": ("rollout/truncated_rate", "truncated"),
    "num_samples": ("rollout/num_samples",),
    "dynamic_filtering_pass_rate": ("dynamic_filtering_pass_rate",),
    "generation_s": ("timing/generation",),
    "train_s": ("timing/ppo_train",),
    "dgg_gated": ("nsr_dgg_gated",),  # --nsr.dgg: gated optimizer steps of the RL step (as the tiny loop logs)
    "lm_head_grad_norm": ("nsr_lm_head_grad_norm",),  # --nsr.dgg: their mean lm_head gradient norm
    # with importance-sampling correction: masked mean of log pi_vLLM - log pi_actor over the sampled tokens, the
    # weight-sync health check (near 0 when vLLM generates with the actor's weights)
    "vllm_kl": ("vllm_kl",),
}

METRIC_KEYS = ("step", *REQUIRED)
"""The docs/design.md metrics.jsonl fields, in order."""

TB_PREFIX = "train/"


def _scalar(value) -> float | None:
    """A finite-or-not float from a logged value (python number, 0-dim tensor, numpy scalar), else None."""
    if value is None or isinstance(value, (str, bytes, list, tuple, dict)):
        return None
    try:
        out = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def row_from_logs(step: int, logs: Mapping[str, object]) -> dict:
    """One metrics.jsonl row from OpenRLHF's per-step log dict (keys as the controller logs them, no prefix).

    Args:
        step: OpenRLHF's global_step (1 for the first RL step).
        logs: {key: value}; keys may also carry the ``train/`` prefix of the TensorBoard tags.

    Returns:
        {"step": step, <REQUIRED keys>, <EXTRAS keys that were logged>}; a required key that was not logged is None.
    """
    flat = {(k[len(TB_PREFIX) :] if k.startswith(TB_PREFIX) else k): v for k, v in logs.items()}
    row: dict = {"step": int(step)}
    for ours, theirs in REQUIRED.items():
        row[ours] = next((_scalar(flat[k]) for k in theirs if k in flat), None)
    for ours, theirs in EXTRAS.items():
        for k in theirs:
            if k in flat and _scalar(flat[k]) is not None:
                row[ours] = _scalar(flat[k])
                break
    return row
