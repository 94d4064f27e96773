"""trl-backend checks of a RunConfig, run at its construction (before any run folder exists). Each raises
ConfigError naming the key and the allowed values."""

from __future__ import annotations

import experiments.models.qwen2  # noqa: F401  registers tiny-qwen2 with the testbed's models (its SFT builds it)
from experiments.config_errors import check_field, check_verifier_reward
from experiments.tasks.countdown import TASKS as TINY_TASKS
from experiments.tasks.countdown import check_task_fits

TINY_MODELS = ("tiny-qwen2",)
"""Models built in code on the tiny testbed's vocabulary; any other model.name is a HF model id or local path."""
TASKS = ("countdown3", "add3", "math", "arithmetic")
HF_TASKS = ("math", "arithmetic")
"""Tasks of a HF model: math (prompt files made by experiments.openrlhf.data), arithmetic (generated on first use)."""


def check_config(cfg) -> None:
    """trl-backend checks of a RunConfig, run at its construction (before any run folder exists).

    Raises ConfigError naming the key and the allowed values.
    """
    ro, tr = cfg.rollout, cfg.train
    tiny = cfg.model.name in TINY_MODELS
    check_field("task", "name", cfg.task.name in TASKS, ", ".join(TASKS), cfg.task.name)
    if tiny or cfg.task.name not in HF_TASKS:
        allowed = f"{', '.join(TINY_MODELS)} with task countdown3 / add3; a HF model with task {' / '.join(HF_TASKS)}"
        check_field("model", "name", tiny and cfg.task.name not in HF_TASKS, allowed, cfg.model.name)
        check_task_fits(cfg, TINY_TASKS[cfg.task.name])
    elif cfg.task.name == "arithmetic":  # generated on first use: no train_data
        from experiments.tasks.arithmetic import check_task

        check_task(cfg.task)
        allowed = "'' (the arithmetic task writes its own files)"
        check_field("task", "train_data", not cfg.task.train_data, allowed, cfg.task.train_data)
    else:
        check_field("task", "train_data", bool(cfg.task.train_data), "a prompt JSONL (experiments.openrlhf.data)", "")
    samples = ro.prompts_per_step * ro.samples_per_prompt
    allowed = f"a divisor of prompts_per_step x samples_per_prompt = {samples}"
    check_field("train", "minibatches", samples % tr.minibatches == 0, allowed, tr.minibatches)
    per_step = samples // tr.minibatches
    micro = cfg.trl.micro_batch_size or per_step
    allowed = f"0 or a divisor of the minibatch size {per_step} (samples / train.minibatches)"
    check_field("trl", "micro_batch_size", per_step % micro == 0, allowed, cfg.trl.micro_batch_size)
    allowed = "a number in (0, 1]"
    check_field("trl", "vllm_gpu_memory_utilization", 0 < cfg.trl.vllm_gpu_memory_utilization <= 1, allowed,
           cfg.trl.vllm_gpu_memory_utilization)  # fmt: skip
    allowed = "false (DGG is an option of the tiny and openrlhf backends)"
    check_field("train", "dgg", not cfg.train.dgg, allowed, cfg.train.dgg)
    check_verifier_reward(cfg)
    check_speed_fields(cfg)


def check_speed_fields(cfg) -> None:
    """trl.skip_zero_adv only where leaving zero-advantage sequences out is exact (NSRGRPOTrainer's
    skip_zero_advantage); trl.share_prompt and trl.checkpoint_mlp not with gradient checkpointing."""
    from nsr.objectives import zero_at_zero_advantage

    if cfg.trl.share_prompt:
        allowed = "false with trl.share_prompt=true (the prompt reaches the completions through its key/value cache)"
        check_field("trl", "gradient_checkpointing", not cfg.trl.gradient_checkpointing, allowed, True)
    if cfg.trl.checkpoint_mlp:
        allowed = "false with trl.checkpoint_mlp=true (it recomputes every layer, the MLP included)"
        check_field("trl", "gradient_checkpointing", not cfg.trl.gradient_checkpointing, allowed, True)
    if cfg.trl.rollout_bf16:
        allowed = "false with trl.rollout_bf16=true (vLLM's precision is its own)"
        check_field("trl", "use_vllm", not cfg.trl.use_vllm, allowed, True)
    if not cfg.trl.skip_zero_adv:
        return
    off = "or trl.skip_zero_adv=false"
    allowed = f"with trl.skip_zero_adv=true a rule inert at A = 0 (every rule but kl_cov and clip_cov), {off}"
    check_field("loss", "rule", zero_at_zero_advantage(cfg.loss.rule), allowed, cfg.loss.rule)
    allowed = f"0 with trl.skip_zero_adv=true (the KL term acts at A = 0), {off}"
    check_field("train", "kl_coef", cfg.train.kl_coef == 0, allowed, cfg.train.kl_coef)
    allowed = f"0 with trl.skip_zero_adv=true (the entropy bonus acts at A = 0), {off}"
    check_field("train", "entropy_coef", cfg.train.entropy_coef == 0, allowed, cfg.train.entropy_coef)
