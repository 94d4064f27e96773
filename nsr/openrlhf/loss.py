"""NSRPolicyLoss: OpenRLHF 0.11.2's ``PolicyLoss`` with every clip rule of ``nsr`` (docs/method.md).

Same constructor, same ``forward`` signature, same 5-tuple ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``,
so it drops into ``ActorPPOTrainer.actor_loss_fn`` (trainer/ray/ppo_actor.py:76). ``rule="hard"`` delegates to the
parent: baselines are OpenRLHF bit for bit. Other rules compute the per-token loss with ``nsr.policy_loss`` and
reduce it with OpenRLHF's own ``aggregate_loss`` (global token-mean across gradient accumulation and DP ranks).

Randomness: a ``torch.Generator`` on the loss device, seeded from (train seed, data-parallel rank, RL step,
micro-step) (:func:`nsr.seeds.derive_seed`); the actor sets the RL step before each ``fit`` (nsr/openrlhf/actors.py).
Ring attention and DeepSpeed tensor parallelism (several ranks per sample) are refused by the launcher
(nsr/openrlhf/mapping.py), so the data-parallel rank is the global rank.
Metrics: every ``nsr.METRIC_KEYS`` value goes into ``self.sink`` (the micro-batch's ``experience.info``, set by the
actor's ``training_step`` wrapper) as ``nsr_<key>``; OpenRLHF logs it as ``train/nsr_<key>``. Also
``nsr_entropy_mc``: the masked mean of -old_log_probs, a Monte-Carlo estimate of the rollout policy's token entropy
(the tokens were sampled from it at temperature 1), free where OpenRLHF's own entropy needs a full-vocabulary tensor.
Premise meter (token level): ``self.premise``, an ``nsr.PremiseMeter`` that every micro-batch with a gradient is added
to (the rule's per-token loss and its autograd gradient; for ``hard``, nsr's hard rule on a detached copy, the same
loss as the parent's); the actor reads it once per RL step (nsr/openrlhf/actors.py).

On a GPU node the parent is the real ``openrlhf.models.loss.PolicyLoss``; where that package cannot be imported
(no flash-attn, e.g. CPU CI) it is OpenRLHF's same file loaded by path (nsr.openrlhf.reference).
"""

from __future__ import annotations

import sys
from importlib.util import find_spec

import torch

import nsr
from nsr.openrlhf.mapping import check_is_correction, level_of
from nsr.openrlhf.reference import load_loss_module
from nsr.openrlhf.settings import NSRSettings
from nsr.premise import PremiseMeter
from nsr.seeds import derive_seed


def _loss_module():
    """The real ``openrlhf.models.loss`` where it imports (flash-attn and DeepSpeed present, or already imported),
    else OpenRLHF's same file by path; checked first so a CPU import does not pay for transformers + peft."""

    def present(name):
        try:
            return find_spec(name) is not None
        except ValueError:  # a module without a spec in sys.modules (a test's stand-in)
            return False

    real = "openrlhf.models.loss" in sys.modules or all(present(m) for m in ("flash_attn", "deepspeed"))
    return load_loss_module(prefer_real=real)


_orl = _loss_module()
PolicyLoss = _orl.PolicyLoss
aggregate_loss = _orl.aggregate_loss


class NSRPolicyLoss(PolicyLoss):
    """OpenRLHF's PolicyLoss whose clip rule is ``nsr.rule``.

    Args: those of ``PolicyLoss`` (positional order kept), plus keyword-only
        settings: the run's NSRSettings (None = rule hard, i.e. exactly ``PolicyLoss``).
        seed, rank: the training seed and this process's data-parallel rank, for the random streams.
    """

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: list = (0.5, 5.0),
        *,
        settings: NSRSettings | None = None,
        seed: int = 0,
        rank: int = 0,
    ) -> None:
        super().__init__(
            clip_eps_low=clip_eps_low,
            clip_eps_high=clip_eps_high,
            dual_clip=dual_clip,
            token_level_loss=token_level_loss,
            policy_loss_type=policy_loss_type,
            is_correction_level=is_correction_level,
            is_correction_mode=is_correction_mode,
            is_correction_gating=is_correction_gating,
            is_correction_threshold=is_correction_threshold,
        )
        settings = settings or NSRSettings()
        self.cfg = settings.loss_config(clip_eps_low, clip_eps_high, dual_clip, level=level_of(policy_loss_type))
        check_is_correction(self.cfg.rule, is_correction_level)
        self.seed, self.rank = int(seed), int(rank)
        self.rl_step = 0
        self.micro_step = 0
        self.sink: dict | None = None
        """The current micro-batch's experience.info (set by the actor's training_step wrapper), or None."""
        self.premise = PremiseMeter(self.cfg) if self.cfg.level == "token" else None
        """The premise meter (token level): every training micro-batch is added; the actor reads it once per RL
        step (nsr/openrlhf/actors.py) and restarts it."""

    def start_step(self, rl_step: int) -> None:
        """Called by the actor before each RL step's updates: restarts the micro-step count of the streams."""
        self.rl_step, self.micro_step = int(rl_step), 0

    def generator(self, device: torch.device) -> torch.Generator:
        """The seeded stream of the next micro-batch (advances the micro-step)."""
        g = torch.Generator(device=device)
        g.manual_seed(derive_seed("loss", self.seed, self.rank, self.rl_step, self.micro_step))
        self.micro_step += 1
        return g

    def _log(self, metrics: dict[str, torch.Tensor], old_log_probs: torch.Tensor, mask: torch.Tensor) -> None:
        if self.sink is not None:
            for k, v in metrics.items():
                self.sink[f"nsr_{k}"] = v.detach()
            m = mask.to(old_log_probs.dtype)
            self.sink["nsr_entropy_mc"] = (-(old_log_probs.detach() * m).sum() / m.sum().clamp(min=1)).float()

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | None = None,
        global_batch_size: float | None = None,
    ):
        """(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio), as ``PolicyLoss.forward``; tensors (B, A), padded."""
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask.bool()
        if self.cfg.rule == "hard":
            out = super().forward(
                log_probs,
                old_log_probs,
                advantages,
                action_mask=action_mask,
                rollout_log_probs=rollout_log_probs,
                dp_size=dp_size,
                batch_num_tokens=batch_num_tokens,
                global_batch_size=global_batch_size,
            )
            meter = self.premise if log_probs.requires_grad else None
            if self.sink is not None or meter is not None:  # the metrics of every other rule, and the meter
                # nsr's hard rule is the parent's loss (tests/test_openrlhf_loss.py): its gradient on a detached copy
                lp = log_probs.detach().requires_grad_(meter is not None)
                with torch.set_grad_enabled(meter is not None):
                    loss_tok, metrics = nsr.policy_loss(lp, old_log_probs, advantages, mask, self.cfg)
                if meter is not None:
                    meter.add(loss_tok, lp, advantages, mask, old_log_probs=old_log_probs)
                if self.sink is not None:
                    self._log({k: v.detach() for k, v in metrics.items()}, old_log_probs, mask)
            return out
        loss_tok, metrics = nsr.policy_loss(
            log_probs, old_log_probs, advantages, mask, self.cfg, generator=self.generator(log_probs.device)
        )
        loss = aggregate_loss(
            loss_tok,
            mask if action_mask is None else action_mask,
            token_level_loss=self.token_level_loss,
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
        )
        if self.premise is not None and log_probs.requires_grad:
            self.premise.add(loss_tok, log_probs, advantages, mask, old_log_probs=old_log_probs)
        self._log(metrics, old_log_probs, mask)
        clip_ratio = metrics["clip_frac"].to(device=log_probs.device, dtype=torch.float32)
        ppo_kl = metrics["approx_kl"].to(log_probs.device)
        return loss, clip_ratio, ppo_kl, None, None
