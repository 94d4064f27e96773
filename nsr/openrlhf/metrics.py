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

The premise meter (nsr.premise, at token level): the actor adds the RL step's counts, summed over its micro-batches
and data-parallel ranks, to the status it returns as ``nsr_premise_<side>_<field>_<bin>`` scalars (66) and
``nsr_premise_tokens``, ``nsr_premise_tokens_adv`` (:func:`premise_logs`); OpenRLHF logs them as
``train/nsr_premise_*``, and
:func:`premise_row_from_logs` turns one step's log back into the run folder's ratio_bins.jsonl row.
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


PREMISE_PREFIX = "nsr_premise_"
"""OpenRLHF log keys of the premise meter: ``nsr_premise_<pos|neg>_<clipped|rescued|weight>_<bin>`` and
``nsr_premise_tokens`` (the valid tokens the counts are over)."""


def premise_logs(counts: list, tokens: float, tokens_adv: float | None = None) -> dict[str, float]:
    """The premise meter's (2, 3, N_BINS + 1) ``counts`` (nested lists, one read of the device) as flat log scalars,
    with the valid tokens they are over and (``tokens_adv``) those with a nonzero advantage."""
    from nsr.premise import FIELDS, SIDES

    out = {}
    for side, s_vals in zip(SIDES, counts):
        for what, vals in zip(FIELDS, s_vals):
            out.update({f"{PREMISE_PREFIX}{side}_{what}_{b}": float(v) for b, v in enumerate(vals)})
    out[f"{PREMISE_PREFIX}tokens"] = float(tokens)
    if tokens_adv is not None:
        out[f"{PREMISE_PREFIX}tokens_adv"] = float(tokens_adv)
    return out


def premise_row_from_logs(step: int, logs: Mapping[str, object], cfg) -> dict | None:
    """The ratio_bins.jsonl row of one RL step from OpenRLHF's log dict (``train/`` prefix or not), in the tiny
    backend's format (nsr.premise.counts_row) with ``cfg`` (the run's nsr.LossConfig) for delta and executor;
    None when the step logged no premise meter (sequence level, or a plain OpenRLHF run)."""
    import torch

    from nsr.premise import FIELDS, N_BINS, SIDES, counts_row

    flat = {(k[len(TB_PREFIX) :] if k.startswith(TB_PREFIX) else k): v for k, v in logs.items()}
    keys = [[[f"{PREMISE_PREFIX}{s}_{w}_{b}" for b in range(N_BINS + 1)] for w in FIELDS] for s in SIDES]
    if not all(k in flat for side in keys for what in side for k in what):
        return None
    counts = torch.tensor([[[_scalar(flat[k]) or 0.0 for k in what] for what in side] for side in keys])
    tokens, tokens_adv = (_scalar(flat.get(f"{PREMISE_PREFIX}{k}")) for k in ("tokens", "tokens_adv"))
    return counts_row(counts.double(), int(step), cfg, tokens, tokens_adv)
