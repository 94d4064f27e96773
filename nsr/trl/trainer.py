"""NSRGRPOTrainer: TRL 1.16.0's ``GRPOTrainer`` with the clip rule and the advantage of ``nsr``
(docs/design.md, "Backends").

TRL has no loss registry: its users override ``_compute_loss``. This subclass keeps all of TRL's loop (generation,
reward functions, the buffered generation batch reused for ``num_iterations`` passes, evaluation, optimizer,
checkpoints) and changes two things:

* the per-token policy loss is ``nsr.policy_loss`` with ``loss`` (an ``nsr.LossConfig``: any rule of ``nsr.RULES``),
  reduced the way TRL reduces it for ``loss_type`` ``dapo`` (token sum over the generation batch's token count) or
  ``grpo`` (mean over sequences of each sequence's token mean), with TRL's own other terms: the k3 KL to the
  reference (``beta``, and ``use_bias_correction_kl``), the entropy bonus (``entropy_coef``) and a mixture-of-experts
  router's load-balancing loss (``router_aux_loss_coef``);
* advantages are ``nsr.compute_advantages`` of the rewards with ``advantages`` (an ``nsr.AdvantageConfig``: group_norm
  = (R - mean) / (std + 1e-9), no_std, positive_only, random_reward, noise), replacing TRL's (R - mean) / (std + 1e-4).
  TRL's ``scale_rewards`` maps onto them (:func:`scaled_advantages`: ``none`` = no_std, ``batch`` = no_std over the
  batch's reward std); ``multi_objective_aggregation`` other than ``sum_then_normalize`` is refused, not ignored.

With rule ``hard`` the loss and gradient equal TRL's own ``dapo`` / ``grpo`` loss (tests/test_trl.py,
tests/test_trl_parity.py) for every log-ratio |log r| <= ``nsr.LOG_RATIO_CLAMP`` (20). Beyond it the kit clamps log r
as OpenRLHF and verl do (zero gradient outside the clamp) where TRL does not. For the hard rule this matters where
the trust region does not clip: at log r = +50 with A < 0 TRL's token loss is e^50 |A| with gradient e^50 |A|, the
kit's e^20 |A| with gradient 0; at log r = -50 with A > 0 TRL's is -e^-50 A, the kit's -e^-20 A with gradient 0; the
two clipped cases are equal. tests/test_trl_parity.py pins this at |log r| = 50.

Randomness of the rule and of the advantage comes from generators seeded from (seed, optimizer step, ...), so a run
resumed from a TRL checkpoint draws what an uninterrupted one draws.

The trust region is TRL's own (``epsilon``, ``epsilon_high``): the LossConfig's eps_low / eps_high are taken from it
where left unset, and one that is set and differs is refused naming both (:func:`trust_region`).

Refused before any work, naming the option (``GRPOConfig.<key>=... is not valid with NSRGRPOTrainer; allowed: ...``):
a rule that needs stale ratios (``nsr.needs_stale_ratios``: every rule but hard, clip_cov and the decision rules
with ratio noise) with ``num_iterations`` 1 and one optimizer step per generation, where every ratio is 1 and the
rule is the hard clip (:func:`check_schedule`; ``allow_on_policy=True`` lets it run), loss types other than dapo /
grpo (the rule comes from ``loss.rule``), an importance-sampling level that disagrees with ``loss``, TRL's
``delta``, off-policy and entropy masks, adaptive entropy, a ``scale_rewards`` that contradicts ``advantages`` and
``multi_objective_aggregation`` (above), and multimodal inputs (image columns, a vision-language model or processor):
the kit's loss does not pass ``pixel_values`` and the like to the model.

Metrics (in TRL's log, each reduced over the logging window as declared once): every metric TRL's ``_compute_loss``
logs, under TRL's name and with TRL's definition and reduction (``kl``, ``entropy``, ``policy_loss`` and
``entropy_coef`` when the entropy bonus is on, ``aux_loss`` for MoE policies, ``clip_ratio/low_mean``,
``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_max``: trust-region
tokens of the ratio, as TRL counts them), and the kit's own: ``nsr/<key>`` for every ``nsr.METRIC_KEYS`` value
(reduced by ``nsr.METRIC_REDUCE``: means, ``nsr/ratio_min`` the minimum and ``nsr/ratio_max`` the maximum over the
window), ``nsr/policy_loss`` (the rule's loss of each micro-batch, without KL), ``nsr/adv_abs_mean``,
``nsr/mixed_group_frac``.

The premise meter (``premise=True``, the default, at token level): an ``nsr.PremiseMeter`` on every training
micro-batch (the rule's per-token loss and its autograd gradient; no host sync), read once per training log: the
window's counts in ``trainer.premise_counts`` (summed over processes; the trl backend writes them to
ratio_bins.jsonl) and per-token rates in TRL's log as ``premise/<key>`` (``nsr.premise.RATE_KEYS``: per side the
clipped tokens within the rescue zone and deeper, the rescued ones and their gradient weight, over the window's valid
tokens), with ``premise/tokens`` and ``premise/tokens_adv`` (the window's valid tokens and those with a nonzero
advantage), so the counts are rate x tokens. ``premise=False`` turns it off.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
from trl import GRPOTrainer

import nsr
from nsr.advantages import STD_EPS
from nsr.objectives import METRIC_REDUCE, reduce_metric
from nsr.premise import PremiseMeter, rates
from nsr.seeds import generator
from nsr.trl.checkpoint import checkpoint_mlps
from nsr.trl.logprobs import check_model, completion_logps, generate_with_shared_prefill

LOSS_TYPES = ("dapo", "grpo")
"""TRL loss types whose aggregation this trainer reproduces: dapo = token-mean, grpo = seq-mean-token-mean."""
AGG_MODE_OF_LOSS_TYPE = {"dapo": "token-mean", "grpo": "seq-mean-token-mean"}
TRL_VERSION = "1.16.0"
"""The TRL release this subclass is written and tested against (tests/test_trl_contract.py)."""
MULTIMODAL_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip
"""The inputs TRL 1.16.0 passes to a vision-language policy's forward (refused: the kit's loss does not pass them)."""


class NSRGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose clip rule is ``loss.rule`` and whose advantages are ``nsr.compute_advantages``.

    Args: those of ``GRPOTrainer``, plus keyword-only
        loss: the rule and its parameters. The trust region is TRL's: ``epsilon`` and ``epsilon_high`` of the
            GRPOConfig (None = ``epsilon``, as TRL) set loss.eps_low / eps_high where the LossConfig leaves them
            unset; one it sets must equal TRL's (a clash is refused naming both). Its level must match the
            GRPOConfig's ``importance_sampling_level``.
        advantages: the advantage kind and noise (default: group_norm).
        seed: seed of the rule's and the advantage's random streams (default: the GRPOConfig's seed).
        allow_on_policy: let a rule that needs stale ratios (nsr.needs_stale_ratios) run in a schedule where every
            ratio is 1 (num_iterations=1 and one optimizer step per generation), which is refused by default.
        compact_logprobs: send only the positions that predict a completion token through the LM head (TRL does so on
            CUDA / XPU only): log-probs bit-identical to TRL's, gradients to float32 rounding (nsr.trl.logprobs).
        share_prompt: also run each distinct prompt once per forward and the completions on its key/value cache
            (implies compact_logprobs): log-probs and gradients equal TRL's to float32 rounding.
        skip_zero_advantage: leave the sequences whose advantage is zero (a group whose rewards are all equal) out
            of the rollout's old-log-prob pass and out of every update's forward and backward. Exact where nothing
            in the loss reads them: refused unless the rule is inert at A = 0 (``nsr.objectives.
            zero_at_zero_advantage``: every rule but kl_cov and clip_cov) and beta, the entropy bonus and a MoE
            router loss are off. Every optimizer step is still taken (a micro-batch with nothing left backpropagates
            an exact zero, so AdamW's moments move as before), the loss keeps its normaliser (dapo: the generation
            batch's token count) and the rule's noise is drawn at the full batch shape. The clip and rescue
            fractions and the premise meter are unchanged (they count tokens with A != 0 over every valid token);
            ``entropy``, ``nsr/ratio_mean`` / ``ratio_min`` / ``ratio_max`` and ``nsr/approx_kl`` are then taken over
            the tokens of the sequences that were computed.
        rollout_bf16: generate the training rollouts under bfloat16 autocast (transformers' generate; refused with
            vLLM). The samples change (a bfloat16 policy draws them), the ratio arithmetic does not: the old
            log-probs are recomputed by the learner in its own precision before any update, or, with one update per
            rollout, are the learner's own (ratio 1). With share_prompt the generation's prefill is also run once
            per distinct prompt.
        checkpoint_mlp: recompute each decoder layer's MLP in the backward instead of keeping its activations
            (nsr.trl.checkpoint): every number bit for bit as without it, about 0.6 MB less per training token for
            SmolLM2-135M, one more MLP forward per update. Not with gradient_checkpointing (which recomputes whole
            layers already).
    """

    def __init__(
        self,
        *args,
        loss: nsr.LossConfig,
        advantages: nsr.AdvantageConfig | None = None,
        seed=None,
        premise: bool = True,
        allow_on_policy: bool = False,
        compact_logprobs: bool = False,
        share_prompt: bool = False,
        skip_zero_advantage: bool = False,
        rollout_bf16: bool = False,
        checkpoint_mlp: bool = False,
        **kw,
    ):
        if not isinstance(loss, nsr.LossConfig):
            raise TypeError(f"loss must be nsr.LossConfig, got {type(loss).__name__}")
        advantages = advantages or nsr.AdvantageConfig()
        if kw.get("args") is not None:  # before any model or data work; TRL's default GRPOConfig is checked below
            _check_args(kw["args"], loss, advantages, allow_on_policy)
        model = kw.get("model", args[0] if args else None)
        _check_text_only(kw.get("train_dataset"), kw.get("eval_dataset"), kw.get("processing_class"), model)
        super().__init__(*args, **kw)
        loss = _check_args(self.args, loss, advantages, allow_on_policy)  # the trust region now TRL's
        _check_text_only(None, None, self.processing_class, self.model)
        self.compact_logprobs = bool(compact_logprobs or share_prompt)
        self.share_prompt = bool(share_prompt)
        self.skip_zero_advantage = bool(skip_zero_advantage)
        self.rollout_bf16 = bool(rollout_bf16)
        self.checkpoint_mlp = bool(checkpoint_mlp)
        _check_speed_options(self, loss)
        if self.checkpoint_mlp:
            checkpoint_mlps(self.model)
        self._deferred_old = None  # while a rollout is scored: TRL's old-log-prob pass, recorded and put off
        self._old_pending = False  # a put-off pass waits for the rollout's split into micro-batches
        self.nsr_loss = loss
        self.nsr_advantages, self.nsr_batch_scale = scaled_advantages(self.args.scale_rewards, advantages)
        self.nsr_seed = self.args.seed if seed is None else seed
        self._rewards_per_func = None
        self._eval_micro = (None, 0)  # (global step, micro-batches evaluated at it): the eval loss streams
        self.premise = PremiseMeter(loss) if premise and loss.level == "token" else None
        self.premise_counts: torch.Tensor | None = None
        """The premise meter's (2, 3, N_BINS + 1) counts of the last logging window, summed over processes (host)."""
        self.premise_tokens: tuple[float, float] | None = None
        """That window's valid tokens and those with a nonzero advantage (logged as premise/tokens, tokens_adv)."""
        self.after_rollout = None
        """Called as ``after_rollout(trainer)`` once per RL step, after its rollout is generated, scored and split into
        the buffered minibatches and before its first update (experiments.mechanism.trl tests rules there); it must
        leave the trainer as it found it."""
        self.replaying = False
        """While True, a training micro-step reads the buffered rollout and never generates (experiments.mechanism.trl
        replays the RL step's updates on it)."""

    # ------------------------------------------------------------------ the rollout hook
    def _prepare_inputs(self, generation_batch):
        """TRL's: generate once per RL step, then hand out the buffered micro-batches; then ``after_rollout``, once
        per rollout. While ``replaying``, the buffered micro-batch of the current micro-step, without generating."""
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        if self.replaying:
            return self._buffered_inputs[self._step % self.args.steps_per_generation]
        every = self.args.steps_per_generation * self.num_iterations
        fresh = self._step % every == 0 or self._buffered_inputs is None
        out = super()._prepare_inputs(generation_batch)
        if fresh and self._old_pending:  # the deferred old-log-prob pass, on the buffered micro-batches
            self._old_pending = False
            for batch in self._buffered_inputs:
                batch["old_per_token_logps"] = self._old_logps_of(batch)
        if fresh and self.after_rollout is not None:
            self.after_rollout(self)
        return out

    # ------------------------------------------------------------------ advantages
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = out  # (N_all, n_funcs), gathered over processes
        return out

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal,
    ):  # fmt: skip
        """TRL's, with the kit's savings: while a training rollout is scored (with compact_logprobs or
        skip_zero_advantage), TRL's old-log-prob pass is recorded and answered with zeros, and computed once the
        rollout is split into its micro-batches (:meth:`_old_logps_of`); with compact_logprobs a text model's
        log-probs come from nsr.trl.logprobs."""
        if self._deferred_old is not None and model is self.model and not torch.is_grad_enabled():
            self._deferred_old.append(len(input_ids))
            return input_ids.new_zeros((len(input_ids), logits_to_keep), dtype=torch.float32), None, None
        plain = not compute_aux_loss and all(v is None for v in multimodal.values())
        if self.compact_logprobs and plain:
            logps, entropies = completion_logps(
                model, input_ids, attention_mask, logits_to_keep, temperature=self.temperature,
                share_prompt=self.share_prompt, batch_size=batch_size, entropy=compute_entropy,
                autocast=self.accelerator.autocast,
            )  # fmt: skip
            return logps, entropies, None
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
            **multimodal,
        )  # fmt: skip

    def _generate_single_turn(self, *args, **kwargs):
        """TRL's transformers generation of the training rollout, under bfloat16 autocast (rollout_bf16) and with each
        distinct prompt's prefill run once (share_prompt). Evaluation and vLLM generation are TRL's."""
        if self.use_vllm or not self.model.training or not (self.rollout_bf16 or self.share_prompt):
            return super()._generate_single_turn(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        original = model.generate
        if self.share_prompt:
            model.generate = functools.partial(generate_with_shared_prefill, model, original)
        autocast = torch.autocast(model.device.type, dtype=torch.bfloat16) if self.rollout_bf16 else nullcontext()
        try:
            with autocast:
                return super()._generate_single_turn(*args, **kwargs)
        finally:
            if self.share_prompt:
                del model.generate  # the class's method again

    def _old_logps_of(self, batch: dict) -> torch.Tensor:
        """The old log-probs of one buffered micro-batch, computed as its first update will compute the new ones:
        the same rows (with skip_zero_advantage the rows with a nonzero advantage; zeros on the others, never read)
        in the same composition and padded layout, so the first update of a rollout sees every ratio at exactly 1
        whatever is shared between rows (share_prompt)."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        n_completion = batch["completion_ids"].size(1)
        old = torch.zeros((len(input_ids), n_completion), device=input_ids.device)
        kept = _kept_rows(batch["advantages"]) if self.skip_zero_advantage else torch.arange(len(input_ids))
        if len(kept):
            with torch.no_grad():
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids[kept], attention_mask[kept], n_completion
                )
            old[kept] = logps.to(old.dtype)
        return old

    def _generate_and_score_completions(self, inputs):
        is_correction = self.use_vllm and self.vllm_importance_sampling_correction  # reads the old pass at once
        defer = self.model.training and (self.skip_zero_advantage or self.compact_logprobs) and not is_correction
        self._deferred_old = [] if defer else None
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            deferred, self._deferred_old = self._deferred_old, None
        if any(k in out for k in MULTIMODAL_KEYS):  # a backstop: __init__ refuses image data and VLMs
            raise ValueError(_MULTIMODAL_ERROR.format(what=f"inputs with {sorted(set(out) & set(MULTIMODAL_KEYS))}"))
        if not self.model.training:  # evaluation keeps TRL's advantages (they enter no update)
            return out
        rewards = (self._rewards_per_func * self.reward_weights.to(self._rewards_per_func.device)).nansum(dim=1)
        g = self.num_generations  # TRL's sampler puts the G samples of a prompt next to each other
        groups = torch.arange(rewards.numel(), device=rewards.device) // g
        gen = generator("trl-adv", self.nsr_seed, self.state.global_step)
        adv = nsr.compute_advantages(rewards.cpu(), groups.cpu(), self.nsr_advantages, generator=gen)
        if self.nsr_batch_scale:  # scale_rewards="batch": the group baseline over the batch's reward std
            adv = adv / (rewards.cpu().std() + STD_EPS)
        adv = adv.to(out["advantages"].device, out["advantages"].dtype)
        n = len(out["prompt_ids"])
        out["advantages"] = adv[self.accelerator.process_index * n : (self.accelerator.process_index + 1) * n]
        grouped = rewards.view(-1, g)
        self._metrics["train"]["nsr/adv_abs_mean"].append(adv.abs().mean().item())
        mixed = (grouped.amax(1) != grouped.amin(1)).float().mean()
        self._metrics["train"]["nsr/mixed_group_frac"].append(mixed.item())
        self._old_pending = bool(deferred)  # TRL's old-log-prob pass, computed after the split (_prepare_inputs)
        return out

    # ------------------------------------------------------------------ loss
    def _loss_generator(self, device, train: bool) -> torch.Generator:
        """Stream of this micro-batch on ``device``. Training: (seed, optimizer step, micro-step, process).
        Evaluation (also before the first training step, eval_on_start): (seed, step, n-th eval micro-batch at
        that step, process)."""
        rank = self.accelerator.process_index
        step = self.state.global_step
        if train:
            micro = self._step % self.current_gradient_accumulation_steps
            return generator("trl-loss", self.nsr_seed, step, micro, rank, device=device)
        n = self._eval_micro[1] if self._eval_micro[0] == step else 0
        self._eval_micro = (step, n + 1)
        return generator("trl-loss-eval", self.nsr_seed, step, n, rank, device=device)

    def _aggregate(self, loss_tok: torch.Tensor, mask: torch.Tensor, num_items, train: bool):
        """TRL 1.16.0's reduction of a (B, T) per-token loss for ``loss_type`` dapo or grpo (grpo_trainer.py):
        (loss to backpropagate, the loss before the gradient-accumulation scaling, which TRL logs as policy_loss).
        dapo divides by the generation batch's token count ``num_items`` over the optimizer steps it feeds."""
        if self.loss_type == "grpo":
            loss = ((loss_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
            return loss / (self.current_gradient_accumulation_steps if train else 1.0), loss.detach()
        normalizer = num_items.clamp(min=1.0) / self.accelerator.num_processes  # dapo
        if train:
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        loss = (loss_tok * mask).sum() / normalizer
        return loss, loss.detach()

    def _importance_weights(self, logps, old, mask) -> torch.Tensor:
        """TRL's ``coef_1``: exp of the token log-ratio, or (B, 1) of the sequence mean (``importance_sampling_level``);
        not clamped and not detached, as TRL weights its bias-corrected KL with it."""
        log_ratio = logps - old
        if self.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        return torch.exp(log_ratio)

    def _compute_loss(self, model, inputs):
        if any(inputs.get(k) is not None for k in MULTIMODAL_KEYS):
            raise ValueError(_MULTIMODAL_ERROR.format(what="multimodal inputs"))
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        adv = inputs["advantages"]
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        train = self.model.training
        computed = None  # rows whose log-probs were computed (None: all)
        if train and self.skip_zero_advantage:
            computed = (adv != 0).any(-1)
            logps, entropies, aux_loss, old = self._kept_rows_logps(model, input_ids, attention_mask, inputs,
                                                                    computed)  # fmt: skip
        else:
            logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled,
            )  # fmt: skip
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old  # one pass per generation: TRL leaves it out (ratio 1)
        mode = "train" if train else "eval"
        accum = self.current_gradient_accumulation_steps if train else 1.0
        num_items = inputs["num_items_in_batch"]

        gen = self._loss_generator(logps.device, train)
        units = None if computed is None else computed.unsqueeze(-1).expand_as(mask)
        loss_tok, met = nsr.policy_loss(logps, old, adv, mask.bool(), self.nsr_loss, gen, ratio_units=units)
        if train and self.premise is not None and logps.requires_grad:  # the rule's loss, before vLLM IS weights
            self.premise.add(loss_tok, logps, adv, mask.bool(), old_log_probs=old)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            loss_tok = loss_tok * inputs["importance_sampling_ratio"]
        per_token_loss = loss_tok
        if self.beta != 0.0:  # TRL's k3 KL to the reference, added per token before aggregation
            d = inputs["ref_per_token_logps"] - logps
            kl_tok = torch.exp(d) - d - 1
            if self.args.use_bias_correction_kl:  # TRL's importance-sampling correction of the KL term
                kl_tok = kl_tok * self._importance_weights(logps, old, mask)
            per_token_loss = per_token_loss + self.beta * kl_tok
        loss, trl_policy_loss = self._aggregate(per_token_loss, mask, num_items, train)
        rule_loss = loss if self.beta == 0.0 else self._aggregate(loss_tok, mask, num_items, train)[0]
        rule_loss = rule_loss.detach() * accum  # nsr/policy_loss: the rule's loss of this micro-batch, without KL
        if self._entropy_bonus_enabled:  # TRL's entropy bonus: mean token entropy, scaled for accumulation only
            loss = loss - self.entropy_coef * _masked_mean(entropies, mask) / accum
        if self.aux_loss_enabled:  # TRL's MoE load-balancing loss, scaled for accumulation as the policy loss
            loss = loss + self.router_aux_loss_coef * aux_loss / accum
        if computed is not None and not bool(computed.any()):  # nothing left: an exact zero gradient on every
            loss = loss + _zero_through(model)  # parameter, so the optimizer step moves AdamW's moments as before

        # metrics: one gather for all of them, then each reduced over processes as _reduce declares
        with torch.no_grad():
            coef = self._importance_weights(logps.detach(), old, mask)  # TRL's coef_1
            low = (coef < 1 - self.epsilon_low) & (adv < 0)
            high = (coef > 1 + self.epsilon_high) & (adv > 0)
            local = {f"nsr/{k}": met[k] for k in nsr.METRIC_KEYS}
            local["nsr/policy_loss"] = rule_loss
            local.update(_masked_sums("entropy", entropies, mask if units is None else mask * units))
            for name, x in (("low", low), ("high", high), ("region", low | high)):
                local.update(_masked_sums(f"clip_ratio/{name}_mean", x.float(), mask))
            local["clip_ratio/low_min"] = _seq_means(low.float(), mask).nan_to_num(torch.inf).min()
            local["clip_ratio/high_max"] = _seq_means(high.float(), mask).nan_to_num(-torch.inf).max()
            if self.beta != 0.0:
                local.update(_masked_sums("kl", kl_tok, mask))
            if self._entropy_bonus_enabled:
                local["policy_loss"] = trl_policy_loss
            if self.aux_loss_enabled:
                local["aux_loss"] = aux_loss
            names = list(local)
            rows = self.accelerator.gather(torch.stack([local[k].detach().float().reshape(()) for k in names])[None])
        for name, value in _reduce(names, rows.tolist()).items():
            self._metrics[mode][name].append(value)
        if self._entropy_bonus_enabled and train and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return loss

    def _kept_rows_logps(self, model, input_ids, attention_mask, inputs, computed):
        """(log-probs, entropies, aux loss, old log-probs), each (B, T), with only the ``computed`` rows sent
        through the model (skip_zero_advantage): the other rows hold log-prob = old log-prob = 0 (ratio 1, no
        gradient), so the rule, drawn at the full shape, gives them loss 0 as it would at A = 0."""
        n_completion = inputs["completion_ids"].size(1)
        old = inputs.get("old_per_token_logps")
        kept = computed.nonzero().squeeze(-1)
        shape = (len(input_ids), n_completion)
        logps = torch.zeros(shape, device=input_ids.device)
        entropies = torch.zeros(shape, device=input_ids.device)
        if len(kept):
            lp, ent, _ = self._get_per_token_logps_and_entropies(
                model, input_ids[kept], attention_mask[kept], n_completion, compute_entropy=True
            )
            logps = logps.to(lp.dtype).index_put((kept,), lp)
            entropies = entropies.to(ent.dtype).index_put((kept,), ent.detach())
        else:  # the meter and the metrics read a graph; the loss gets its zero gradient in _compute_loss
            logps = logps.requires_grad_()
        if old is None:  # one update per rollout: TRL's old log-prob is the new one, detached (ratio 1)
            old = logps.detach()
        else:
            old = torch.where(computed.unsqueeze(-1), old, 0.0)
        return logps, entropies, None, old

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log (the mean of each metric over the logging window), except the ``nsr/`` metrics that
        ``nsr.METRIC_REDUCE`` declares min or max: their window's min or max."""
        mode = "train" if self.model.training else "eval"
        if mode == "train" and self.premise is not None:
            self._log_premise(logs)
        for key, values in self._metrics[mode].items():
            k = key.removeprefix("nsr/")
            if key.startswith("nsr/") and METRIC_REDUCE.get(k, "mean") != "mean" and values:
                values[:] = [reduce_metric(k, values)]
        super().log(logs, start_time)

    def _log_premise(self, logs: dict) -> None:
        """The premise meter's window (the updates since the last training log), summed over processes and read
        once: kept in ``premise_counts`` (the run folder's ratio_bins.jsonl row) and logged as ``premise/<key>``
        per-token rates (nsr.premise.rates); then the meter restarts. A window without tokens (TRL's end-of-training
        summary) logs nothing and leaves ``premise_counts`` as it was."""
        counts, tokens, tokens_adv = self.premise.counts(), self.premise.tokens, self.premise.tokens_adv
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts.clone(), "sum")
            tokens = self.accelerator.reduce(tokens.clone(), "sum")
            tokens_adv = self.accelerator.reduce(tokens_adv.clone(), "sum")
        counts, tokens, tokens_adv = counts.cpu(), tokens.cpu(), tokens_adv.cpu()
        self.premise.reset()
        if tokens.item() == 0:
            return
        self.premise_counts = counts
        self.premise_tokens = (tokens.item(), tokens_adv.item())
        logs.update({f"premise/{k}": v.item() for k, v in rates(counts, tokens).items()})
        logs.update({"premise/tokens": tokens.item(), "premise/tokens_adv": tokens_adv.item()})


_MULTIMODAL_ERROR = (
    "NSRGRPOTrainer does not support multimodal policies ({what}): its loss does not pass pixel_values and the other "
    "vision inputs to the model; allowed: a text-only causal LM with a tokenizer and text prompts (use TRL's "
    "GRPOTrainer for vision-language models)"
)


def _kept_rows(advantages: torch.Tensor) -> torch.Tensor:
    """Indices of the rows of a (B,) or (B, T) advantage tensor with any nonzero value."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    return (adv != 0).any(-1).nonzero().squeeze(-1)


def _zero_through(model) -> torch.Tensor:
    """0, with a gradient of exact zeros on every trainable parameter of ``model`` (one element read from each)."""
    return sum(p.reshape(-1)[:1].sum() for p in model.parameters() if p.requires_grad) * 0.0


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _masked_sums(name: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's global_masked_mean in two parts, summed over processes: the sum over valid tokens (a (B, 1) sequence-level
    value counts once per sequence) and their count."""
    if x.shape[1] == 1:
        return {f"{name}@sum": x.sum(), f"{name}@count": torch.tensor(float(x.shape[0]), device=x.device)}
    return {f"{name}@sum": (x * mask).sum(), f"{name}@count": mask.sum().float()}


def _seq_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's masked_seq_mean: one value per sequence (NaN for a sequence without valid tokens)."""
    return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)


def _reduce(names: list[str], rows: list[list[float]]) -> dict[str, float]:
    """Each metric of one micro-batch combined over the processes' rows, as TRL combines its own: token-weighted
    means (``@sum`` / ``@count``), ``clip_ratio/low_min`` the min, ``clip_ratio/high_max`` the max, ``policy_loss``
    and ``aux_loss`` the (nan)mean; the ``nsr/`` metrics by ``nsr.METRIC_REDUCE``."""
    cols = dict(zip(names, zip(*rows)))
    out = {}
    for name, col in cols.items():
        if name.endswith("@count"):
            continue
        if name.endswith("@sum"):
            base = name.removesuffix("@sum")
            out[base] = sum(col) / max(sum(cols[f"{base}@count"]), 1.0)
        elif name.startswith("nsr/") and name[4:] in METRIC_REDUCE:
            out[name] = reduce_metric(name[4:], col)
        elif name == "clip_ratio/low_min":
            finite = [v for v in col if v != float("inf")]
            out[name] = min(finite) if finite else float("nan")
        elif name == "clip_ratio/high_max":
            finite = [v for v in col if v != float("-inf")]
            out[name] = max(finite) if finite else float("nan")
        else:  # policy_loss, aux_loss, nsr/policy_loss
            valid = [v for v in col if v == v]
            out[name] = sum(valid) / len(valid) if valid else float("nan")
    return out


def _check_text_only(train_dataset, eval_dataset, processing_class, model=None) -> None:
    """Refuse multimodal training before any work: image columns, a processor, or a vision-language model."""
    from transformers import ProcessorMixin

    datasets = [train_dataset, *(eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset])]
    for data in datasets:
        columns = getattr(data, "column_names", None) or []
        image_cols = [c for c in ("image", "images") if c in columns]
        if image_cols:
            raise ValueError(_MULTIMODAL_ERROR.format(what=f"a dataset with column(s) {image_cols}"))
    if isinstance(processing_class, ProcessorMixin):
        raise ValueError(_MULTIMODAL_ERROR.format(what=f"processing_class {type(processing_class).__name__}"))
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "vision_config", None) is not None:
        raise ValueError(_MULTIMODAL_ERROR.format(what=f"model {type(model).__name__} has a vision_config"))


SCALE_REWARDS = ("group", "none", "batch")
"""TRL's ``scale_rewards`` values (GRPOConfig turns True / False into "group" / "none")."""


def scaled_advantages(scale_rewards: str, advantages: nsr.AdvantageConfig) -> tuple[nsr.AdvantageConfig, bool]:
    """TRL's ``scale_rewards`` on the kit's advantage transforms: (the AdvantageConfig to compute, whether to divide
    by the batch's reward std afterwards). ``group``: ``advantages`` as given (group_norm by default: (R - mean_g) /
    (std_g + 1e-9)); ``none``: group_norm becomes no_std (R - mean_g); ``batch``: no_std, then / (std of the batch's
    rewards + 1e-9) (TRL's formula with the kit's epsilon; TRL adds 1e-4). ``none`` and ``batch`` change only
    group_norm (or keep no_std for none): another kind, or noise with batch, is refused naming both options."""
    if scale_rewards not in SCALE_REWARDS:
        allowed = ", ".join(SCALE_REWARDS)
        raise ValueError(f"GRPOConfig.scale_rewards={scale_rewards!r} is not valid; allowed: {allowed}")
    if scale_rewards == "group":
        return advantages, False
    ok = advantages.kind == "group_norm" or (scale_rewards == "none" and advantages.kind == "no_std")
    if not ok or (scale_rewards == "batch" and advantages.noise):
        raise ValueError(
            f"GRPOConfig.scale_rewards={scale_rewards!r} is not valid with advantages.kind={advantages.kind!r} and "
            f"advantages.noise={advantages.noise} in NSRGRPOTrainer; allowed: scale_rewards='group' with any "
            "advantages.kind, 'none' with kind group_norm or no_std (both mean R - group mean), 'batch' with kind "
            "group_norm and noise 0"
        )
    return advantages.replace(kind="no_std"), scale_rewards == "batch"


def _check_speed_options(trainer: NSRGRPOTrainer, loss: nsr.LossConfig) -> None:
    """The compact / shared-prompt log-probs and the zero-advantage skip where they are exact, or a ValueError
    naming the option and what is allowed."""
    from nsr.objectives import zero_at_zero_advantage

    if trainer.compact_logprobs:
        check_model(trainer.model, trainer.share_prompt, trainer.args.gradient_checkpointing)
    if trainer.checkpoint_mlp and trainer.args.gradient_checkpointing:
        raise ValueError(
            "checkpoint_mlp=True is not valid with GRPOConfig.gradient_checkpointing=True: that recomputes every "
            "layer already, the MLP included; allowed: one of the two"
        )
    if trainer.rollout_bf16 and trainer.use_vllm:
        raise ValueError(
            "rollout_bf16=True is not valid with GRPOConfig.use_vllm=True: it sets the precision of transformers' "
            "generate; vLLM's is its own (vllm_model_impl / dtype); allowed: rollout_bf16=False with vLLM"
        )
    if not trainer.skip_zero_advantage:
        return
    reads = []
    if not zero_at_zero_advantage(loss.rule):
        reads.append(f"loss.rule={loss.rule!r} (it acts on or selects among tokens with A = 0)")
    if trainer.beta != 0.0:
        reads.append(f"GRPOConfig.beta={trainer.beta} (the KL term acts at A = 0)")
    if trainer._entropy_bonus_enabled:
        reads.append(f"GRPOConfig.entropy_coef={trainer.entropy_coef} (the entropy bonus acts at A = 0)")
    if trainer.aux_loss_enabled:
        reads.append("a MoE router loss (router_aux_loss_coef != 0)")
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        reads.append("GRPOConfig.vllm_importance_sampling_correction=True (it reads every old log-prob)")
    if reads:
        raise ValueError(
            "skip_zero_advantage=True is not valid with " + "; ".join(reads) + ": the sequences it leaves out would "
            "change the update; allowed: skip_zero_advantage=False, or a rule inert at A = 0 with beta 0, "
            "entropy_coef 0 and no router loss"
        )


def trust_region(args, loss: nsr.LossConfig) -> nsr.LossConfig:
    """``loss`` with TRL's trust region: eps_low = GRPOConfig.epsilon, eps_high = GRPOConfig.epsilon_high (None =
    epsilon, as TRL's GRPOTrainer). A value the LossConfig sets itself (not left None) must equal TRL's: the trust
    region has one source, and a clash between the two is refused naming both."""
    trl_eps = {"eps_low": ("epsilon", args.epsilon)}
    trl_eps["eps_high"] = ("epsilon_high", args.epsilon_high if args.epsilon_high is not None else args.epsilon)
    for ours, (key, value) in trl_eps.items():
        if loss.was_set(ours) and getattr(loss, ours) != value:
            raise ValueError(
                f"loss.{ours}={getattr(loss, ours)!r} and GRPOConfig.{key}={getattr(args, key)!r} set the trust region "
                f"twice and disagree; NSRGRPOTrainer takes it from the GRPOConfig: allowed: leave loss.{ours} unset "
                f"(None), or set it to {value!r}, or set GRPOConfig.{key}={getattr(loss, ours)!r}"
            )
    try:
        return loss.replace(eps_low=trl_eps["eps_low"][1], eps_high=trl_eps["eps_high"][1])
    except ValueError as e:  # TRL accepts an epsilon the rule cannot use (e.g. 1.0): name TRL's key
        msg = (
            str(e)
            .replace("LossConfig.eps_low=", "GRPOConfig.epsilon=")
            .replace("LossConfig.eps_high=", "GRPOConfig.epsilon_high=")
        )
        raise ValueError(f"{msg} (NSRGRPOTrainer's trust region)") from None


def check_schedule(args, loss: nsr.LossConfig) -> None:
    """Refuse a rule that needs stale ratios (nsr.needs_stale_ratios) in a schedule without a stale update: with
    ``num_iterations`` 1 and ``steps_per_generation`` dividing ``gradient_accumulation_steps`` every optimizer step
    trains on a fresh generation whose old log-probs are the learner's own (TRL recomputes them with the training
    model, with vLLM too), so every ratio is 1, no token is clipped and the rule's update is the hard clip's."""
    spg, accum = args.steps_per_generation, args.gradient_accumulation_steps
    if nsr.needs_stale_ratios(loss) and args.num_iterations == 1 and accum % spg == 0:
        raise ValueError(
            f"GRPOConfig.num_iterations=1 with GRPOConfig.steps_per_generation={spg} and gradient_accumulation_steps="
            f"{accum} is not valid with loss.rule={loss.rule!r}: each optimizer step trains on a fresh generation "
            "whose old log-probs are the policy's own, so every ratio is 1, no token is clipped and the rule equals "
            "the hard clip; allowed: num_iterations >= 2, or steps_per_generation a multiple of "
            f"gradient_accumulation_steps >= {2 * accum} (several optimizer steps per generation), or "
            "NSRGRPOTrainer(..., allow_on_policy=True) to run it anyway"
        )


def _check_args(
    args, loss: nsr.LossConfig, advantages: nsr.AdvantageConfig | None = None, allow_on_policy: bool = False
) -> nsr.LossConfig:
    """TRL options this subclass does not reproduce, or that would disagree with ``loss``: a clear error. Returns
    ``loss`` with the GRPOConfig's trust region (:func:`trust_region`)."""

    def refuse(key, value, allowed):
        raise ValueError(f"GRPOConfig.{key}={value!r} is not valid with NSRGRPOTrainer; allowed: {allowed}")

    if args.loss_type not in LOSS_TYPES:
        refuse("loss_type", args.loss_type, ", ".join(LOSS_TYPES) + " (the rule comes from loss.rule)")
    if args.importance_sampling_level != loss.level:
        refuse("importance_sampling_level", args.importance_sampling_level, f"{loss.level} (loss.level)")
    loss = trust_region(args, loss)
    if not allow_on_policy:
        check_schedule(args, loss)
    for key, off in (("delta", None), ("off_policy_mask_threshold", None), ("top_entropy_quantile", 1.0)):
        if getattr(args, key) != off:
            refuse(key, getattr(args, key), repr(off))
    scaled_advantages(args.scale_rewards, advantages or nsr.AdvantageConfig())  # ValueError naming both options
    if args.multi_objective_aggregation != "sum_then_normalize":  # the advantage is nsr's, of the weighted sum
        refuse("multi_objective_aggregation", args.multi_objective_aggregation, "sum_then_normalize")
    if args.use_adaptive_entropy:
        refuse("use_adaptive_entropy", True, "False (a fixed entropy_coef)")
    return loss
