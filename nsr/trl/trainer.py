"""NSRGRPOTrainer: TRL 1.16.0's ``GRPOTrainer`` with the clip rule and the advantage of ``nsr``
(docs/design.md, "Backends").

TRL has no loss registry: its users override ``_compute_loss``. This subclass keeps all of TRL's loop (generation,
reward functions, the buffered generation batch reused for ``num_iterations`` passes, optimizer, checkpoints) and
changes two things:

* the per-token policy loss is ``nsr.policy_loss`` with ``loss`` (an ``nsr.LossConfig``: any rule of ``nsr.RULES``),
  reduced the way TRL reduces it for ``loss_type`` ``dapo`` (token sum over the generation batch's token count) or
  ``grpo`` (mean over sequences of each sequence's token mean), then TRL's KL and entropy terms;
* advantages are ``nsr.compute_advantages`` of the rewards with ``advantages`` (an ``nsr.AdvantageConfig``: group_norm
  = (R - mean) / (std + 1e-9), no_std, positive_only, random_reward, noise), replacing TRL's (R - mean) / (std + 1e-4).

With rule ``hard`` the loss equals TRL's own ``dapo`` / ``grpo`` loss (tests/test_trl.py). Randomness of the rule and
of the advantage comes from generators seeded from (seed, optimizer step, ...), so a run resumed from a TRL checkpoint
draws what an uninterrupted one draws.

Metrics (in TRL's log, averaged over the logging window as TRL averages its own): TRL's names where the meaning is
the same (``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``: tokens the trust region
clipped, by side), and ``nsr/<key>`` for every ``nsr.METRIC_KEYS`` value plus ``nsr/policy_loss``,
``nsr/adv_abs_mean``, ``nsr/mixed_group_frac``; the ratio extremes are in :attr:`NSRGRPOTrainer.ratio_extremes`.
"""

from __future__ import annotations

import math

import torch
from trl import GRPOTrainer

import nsr
from nsr.seeds import derive_seed

LOSS_TYPES = ("dapo", "grpo")
"""TRL loss types whose aggregation this trainer reproduces: dapo = token-mean, grpo = seq-mean-token-mean."""
AGG_MODE_OF_LOSS_TYPE = {"dapo": "token-mean", "grpo": "seq-mean-token-mean"}
TRL_VERSION = "1.16.0"
"""The TRL release this subclass is written and tested against (tests/test_trl_contract.py)."""


class NSRGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose clip rule is ``loss.rule`` and whose advantages are ``nsr.compute_advantages``.

    Args: those of ``GRPOTrainer``, plus keyword-only
        loss: the rule and its parameters; its level, eps_low and eps_high must match the GRPOConfig's
            ``importance_sampling_level``, ``epsilon`` and ``epsilon_high`` (so TRL's own settings do not disagree).
        advantages: the advantage kind and noise (default: group_norm).
        seed: seed of the rule's and the advantage's random streams (default: the GRPOConfig's seed).
    """

    def __init__(self, *args, loss: nsr.LossConfig, advantages: nsr.AdvantageConfig | None = None, seed=None, **kw):
        if not isinstance(loss, nsr.LossConfig):
            raise TypeError(f"loss must be nsr.LossConfig, got {type(loss).__name__}")
        if kw.get("args") is not None:  # before any model or data work; TRL's default GRPOConfig is checked below
            _check_args(kw["args"], loss)
        super().__init__(*args, **kw)
        self.nsr_loss = loss
        self.nsr_advantages = advantages or nsr.AdvantageConfig()
        self.nsr_seed = self.args.seed if seed is None else seed
        self.ratio_extremes = [math.inf, -math.inf]
        """[min, max] of the token (unit) ratios since :meth:`pop_ratio_extremes` was last called."""
        self._rewards_per_func = None
        _check_args(self.args, loss)

    # ------------------------------------------------------------------ advantages
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = out  # (N_all, n_funcs), gathered over processes
        return out

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation keeps TRL's advantages (they enter no update)
            return out
        rewards = (self._rewards_per_func * self.reward_weights.to(self._rewards_per_func.device)).nansum(dim=1)
        g = self.num_generations  # TRL's sampler puts the G samples of a prompt next to each other
        groups = torch.arange(rewards.numel(), device=rewards.device) // g
        gen = torch.Generator().manual_seed(derive_seed("trl-adv", self.nsr_seed, self.state.global_step))
        adv = nsr.compute_advantages(rewards.cpu(), groups.cpu(), self.nsr_advantages, generator=gen)
        adv = adv.to(out["advantages"].device, out["advantages"].dtype)
        n = len(out["prompt_ids"])
        out["advantages"] = adv[self.accelerator.process_index * n : (self.accelerator.process_index + 1) * n]
        grouped = rewards.view(-1, g)
        self._metrics["train"]["nsr/adv_abs_mean"].append(adv.abs().mean().item())
        mixed = (grouped.amax(1) != grouped.amin(1)).float().mean()
        self._metrics["train"]["nsr/mixed_group_frac"].append(mixed.item())
        return out

    # ------------------------------------------------------------------ loss
    def _loss_generator(self, device) -> torch.Generator:
        """Stream of this optimizer step's micro-batch on ``device``: (seed, step, micro-step, process)."""
        micro = self._step % self.current_gradient_accumulation_steps
        parts = ("trl-loss", self.nsr_seed, self.state.global_step, micro, self.accelerator.process_index)
        return torch.Generator(device=device).manual_seed(derive_seed(*parts))

    def _aggregate(self, loss_tok: torch.Tensor, mask: torch.Tensor, num_items, train: bool) -> torch.Tensor:
        """TRL 1.16.0's reduction of a (B, T) per-token loss for ``loss_type`` dapo or grpo (grpo_trainer.py):
        dapo divides by the generation batch's token count ``num_items`` over the optimizer steps it feeds."""
        accum = self.current_gradient_accumulation_steps if train else 1.0
        if self.loss_type == "grpo":
            return ((loss_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accum
        normalizer = num_items.clamp(min=1.0) / self.accelerator.num_processes  # dapo
        if train:
            normalizer = normalizer * accum / self.args.steps_per_generation
        return (loss_tok * mask).sum() / normalizer

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True
        )
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old  # one pass per generation: TRL leaves it out (ratio 1)
        adv = inputs["advantages"]
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv

        loss_tok, met = nsr.policy_loss(logps, old, adv, mask.bool(), self.nsr_loss, self._loss_generator(logps.device))
        if self.use_vllm and self.vllm_importance_sampling_correction:
            loss_tok = loss_tok * inputs["importance_sampling_ratio"]
        train = self.model.training
        num_items = inputs["num_items_in_batch"]
        pg_loss = self._aggregate(loss_tok, mask, num_items, train)
        loss = pg_loss
        mode = "train" if train else "eval"
        if self.beta != 0.0:  # TRL's k3 KL to the reference, added per token before aggregation
            d = inputs["ref_per_token_logps"] - logps
            kl_tok = torch.exp(d) - d - 1
            loss = loss + self.beta * self._aggregate(kl_tok, mask, num_items, train)
            self._metrics[mode]["kl"].append(_masked_mean(kl_tok, mask).item())
        if self.args.entropy_coef:  # TRL's entropy bonus: mean token entropy, scaled for accumulation only
            accum = self.current_gradient_accumulation_steps if train else 1.0
            loss = loss - self.args.entropy_coef * _masked_mean(entropies, mask) / accum

        # metrics: one host transfer for all of them; means over processes, extremes over all
        keys = (*nsr.METRIC_KEYS[:6], "approx_kl")  # clip_frac_low ... ratio_mean: means over the log window
        scale = self.current_gradient_accumulation_steps if train else 1.0  # the micro-batch's own pg loss
        local = [*(met[k] for k in (*keys, "ratio_min", "ratio_max")), _masked_mean(entropies, mask), pg_loss * scale]
        rows = self.accelerator.gather(torch.stack([v.detach().float() for v in local])[None]).tolist()
        mean = [sum(col) / len(col) for col in zip(*rows)]
        for j, k in enumerate(keys):
            self._metrics[mode][f"nsr/{k}"].append(mean[j])
        for j, name in enumerate(("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")):
            self._metrics[mode][name].append(mean[j])  # TRL's names: the same tokens as clip_frac_low/high/clip_frac
        self._metrics[mode]["entropy"].append(mean[9])
        self._metrics[mode]["nsr/policy_loss"].append(mean[10])
        lo, hi = self.ratio_extremes
        self.ratio_extremes = [min(lo, *(r[7] for r in rows)), max(hi, *(r[8] for r in rows))]
        return loss

    def pop_ratio_extremes(self) -> tuple[float, float]:
        """(min, max) ratio since the last call, then reset."""
        lo, hi = self.ratio_extremes
        self.ratio_extremes = [math.inf, -math.inf]
        return lo, hi


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _check_args(args, loss: nsr.LossConfig) -> None:
    """TRL options this subclass does not reproduce, or that would disagree with ``loss``: a clear error."""

    def refuse(key, value, allowed):
        raise ValueError(f"GRPOConfig.{key}={value!r} is not valid with NSRGRPOTrainer; allowed: {allowed}")

    if args.loss_type not in LOSS_TYPES:
        refuse("loss_type", args.loss_type, ", ".join(LOSS_TYPES) + " (the rule comes from loss.rule)")
    if args.importance_sampling_level != loss.level:
        refuse("importance_sampling_level", args.importance_sampling_level, f"{loss.level} (loss.level)")
    if args.epsilon != loss.eps_low:
        refuse("epsilon", args.epsilon, f"{loss.eps_low} (loss.eps_low)")
    if (args.epsilon_high if args.epsilon_high is not None else args.epsilon) != loss.eps_high:
        refuse("epsilon_high", args.epsilon_high, f"{loss.eps_high} (loss.eps_high)")
    for key, off in (("delta", None), ("off_policy_mask_threshold", None), ("top_entropy_quantile", 1.0)):
        if getattr(args, key) != off:
            refuse(key, getattr(args, key), repr(off))
    if args.multi_objective_aggregation != "sum_then_normalize":  # the advantage is nsr's, of the weighted sum
        refuse("multi_objective_aggregation", args.multi_objective_aggregation, "sum_then_normalize")
    if args.use_adaptive_entropy:
        refuse("use_adaptive_entropy", True, "False (a fixed entropy_coef)")
