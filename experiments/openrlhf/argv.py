"""RunConfig -> the launcher command ``python -m nsr.openrlhf.launch --nsr.* ... <OpenRLHF 0.11.2 flags>``.

Pure: imports neither openrlhf, Ray nor vLLM, so ``python -m experiments.run --sweep S --dry-run`` works anywhere.
Every RunConfig field that matters on the cluster maps to one OpenRLHF dotted flag (docs/cluster.md) or to one
``--nsr.*`` flag (nsr/openrlhf/settings.py; the level and estimator maps are nsr/openrlhf/mapping.py); the tests parse
``openrlhf_argv`` with OpenRLHF's real parser and compare every value with the RunConfig.

    from experiments.openrlhf.argv import build_command
    cmd = build_command(cfg, run_dir="results/runs/main/<run_id>", run_id="<run_id>")
    cmd.argv            # [python, "-m", "nsr.openrlhf.launch", "--nsr.rule", "nsr", ..., "--actor.adam.lr", ...]
    cmd.openrlhf_argv   # exactly what OpenRLHF's parser receives

Refused with a ConfigError naming the keys (before anything starts): one optimizer step per rollout (the clip never
fires, so every arm would equal the baseline), batch sizes OpenRLHF/DeepSpeed cannot split, GSPO with token-mean,
colocation with a GPU count vLLM does not fill, extra_args that repeat a flag set from a field, a random-reward
control with dynamic filtering or the overlong penalty, an eval.every that is not a checkpoint step, a decaying
learning-rate schedule stretched by the prompt rows dynamic filtering needs (experiments/openrlhf/plan.py), and a
CPU run (``openrlhf.cpu``) without the settings a CPU run needs (:data:`CPU_SETTINGS`).

A CPU run (``openrlhf.cpu: true``, set by the CPU presets; not the model's name) runs with the CPU shim switched on:
``LaunchCommand.env`` then holds ``NSR_OPENRLHF_CPU=1`` (nsr/openrlhf/cpu_shim.py) and the compute threads of each of
its processes (:func:`cpu_threads`); on the cluster it is empty.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from experiments.config import ConfigError, RunConfig
from experiments.models.qwen2 import model_path
from experiments.openrlhf.plan import ARITHMETIC, CKPT_MAX_NUM, rows_needed, train_data_path
from nsr.openrlhf.launch import CPU_ENV
from nsr.openrlhf.mapping import ESTIMATOR, LOSS_TYPE, check_random_reward
from nsr.openrlhf.settings import NSRSettings

LAUNCHER = "nsr.openrlhf.launch"
REWARD_FILE = Path(__file__).resolve().parents[1] / "rewards" / "math.py"
INPUT_KEY, LABEL_KEY = "prompt", "label"  # the keys experiments.openrlhf.data writes
CONSTANT_SCHEDULES = ("constant", "constant_with_warmup")
CPU_SETTINGS = {
    "--vllm.sync_backend": "gloo",  # OpenRLHF's nccl path (PyNccl, CUDA IPC) needs GPUs; the CPU shim syncs on gloo
    "--vllm.enforce_eager": None,  # no torch.compile of the vLLM model (tens of seconds per engine on a CPU)
    "--ds.attn_implementation": "eager",  # OpenRLHF's default is flash_attention_2
}
"""OpenRLHF flags a CPU model's ``openrlhf.extra_args`` must hold (flag: value, None for a switch)."""


@dataclass(frozen=True)
class LaunchCommand:
    argv: list[str]
    """The full command: python -m nsr.openrlhf.launch, the --nsr.* flags, then ``openrlhf_argv``."""
    openrlhf_argv: list[str]
    """Exactly the flags OpenRLHF 0.11.2's parser receives."""
    nsr_argv: list[str]
    """The launcher's own --nsr.* flags."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment the command needs on top of the caller's: the CPU shim's switch and the processes' thread count
    (unless the caller set ``OMP_NUM_THREADS``) for a CPU model, else empty."""


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def optimizer_steps_per_rollout(cfg: RunConfig) -> float:
    """prompts_per_step x samples_per_prompt / openrlhf.train_batch_size x train.epochs."""
    samples = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    return samples / cfg.openrlhf.train_batch_size * cfg.train.epochs


def batch_fields(samples: int, minibatches: int, world: int, o) -> str:
    """The batch fields that give ``minibatches`` optimizer steps per pass, as overrides to set (or why none can)."""
    if samples % minibatches or (samples // minibatches) % world:
        return (
            f"no batch for train.minibatches={minibatches}: {samples} samples do not split into {minibatches} "
            f"minibatches over {world} rank(s)"
        )
    batch = samples // minibatches
    micro = max(d for d in range(1, min(o.micro_train_batch_size, batch // world) + 1) if (batch // world) % d == 0)
    return f"for train.minibatches={minibatches}: openrlhf.train_batch_size={batch} " + (
        f"openrlhf.micro_train_batch_size={micro}"
    )


def check(cfg: RunConfig) -> None:
    """Raise ConfigError for a config the cluster backend cannot run as intended."""
    o, r, t = cfg.openrlhf, cfg.rollout, cfg.train
    if cfg.backend != "openrlhf":
        _fail(f"backend={cfg.backend!r} is not valid here; allowed: openrlhf")
    if cfg.task.name == ARITHMETIC:  # generated on first use (experiments/tasks/arithmetic.py): its own files
        from experiments.tasks.arithmetic import check_task

        check_task(cfg.task)
        if cfg.task.train_data:
            _fail(
                f"task.train_data={cfg.task.train_data!r} is not valid with task.name='arithmetic'; allowed: '' "
                "(the task writes its own files)"
            )
    elif not cfg.task.train_data:
        _fail("task.train_data='' is not valid; allowed: a prompt JSONL made by python -m experiments.openrlhf.data")
    if cfg.model.name == "tiny-gpt2":
        _fail("model.name='tiny-gpt2' is the CPU testbed's model; allowed: a HF model id or local path")
    if o.cpu:
        check_cpu(cfg)
    samples = r.prompts_per_step * r.samples_per_prompt
    if o.train_batch_size < 1 or samples % o.train_batch_size:
        _fail(
            f"openrlhf.train_batch_size={o.train_batch_size} is not valid; allowed: a divisor of "
            f"rollout.prompts_per_step x rollout.samples_per_prompt = {samples}"
        )
    steps = optimizer_steps_per_rollout(cfg)
    if steps <= 1 and not t.allow_on_policy:
        _fail(
            f"one optimizer step per rollout (rollout.prompts_per_step x rollout.samples_per_prompt / "
            f"openrlhf.train_batch_size x train.epochs = {samples} / {o.train_batch_size} x {t.epochs} = {steps:g}): "
            "OpenRLHF recomputes old_log_probs before the update, so every ratio is 1, no token is clipped and every "
            "clip rule equals the baseline; allowed: > 1 (smaller openrlhf.train_batch_size or more train.epochs), "
            "or train.allow_on_policy=true"
        )
    world = o.nodes * o.gpus_per_node
    if samples // o.train_batch_size != t.minibatches:
        _fail(
            f"train.minibatches={t.minibatches} does not match the cluster batch: rollout.prompts_per_step x "
            f"rollout.samples_per_prompt / openrlhf.train_batch_size = {samples} / {o.train_batch_size} = "
            f"{samples // o.train_batch_size} optimizer steps per pass; allowed: "
            f"train.minibatches={samples // o.train_batch_size}, or {batch_fields(samples, t.minibatches, world, o)} "
            "(or openrlhf.train_batch_size=0: derived from train.minibatches, as the presets do)"
        )
    if o.micro_train_batch_size < 1 or o.train_batch_size % (o.micro_train_batch_size * world):
        _fail(
            f"openrlhf.train_batch_size={o.train_batch_size} is not valid for DeepSpeed with "
            f"openrlhf.micro_train_batch_size={o.micro_train_batch_size}; allowed: a multiple of "
            f"openrlhf.micro_train_batch_size x nodes x gpus_per_node = {o.micro_train_batch_size} x {world}, "
            f"e.g. {batch_fields(samples, t.minibatches, world, o)}"
        )
    if o.micro_rollout_batch_size < 1 or samples // o.micro_rollout_batch_size < world:
        _fail(
            f"openrlhf.micro_rollout_batch_size={o.micro_rollout_batch_size} is not valid; allowed: 1 .. "
            f"{samples // world} (every one of the {world} actor ranks needs a rollout micro-batch)"
        )
    if o.colocate_all and o.vllm_engines * o.vllm_tensor_parallel != world:
        _fail(
            f"openrlhf.vllm_engines x vllm_tensor_parallel = {o.vllm_engines} x {o.vllm_tensor_parallel} must equal "
            f"nodes x gpus_per_node = {world} with openrlhf.colocate_all=true; allowed: vllm_engines = "
            f"{world // max(o.vllm_tensor_parallel, 1)}"
        )
    if o.vllm_engines < 1:
        _fail(f"openrlhf.vllm_engines={o.vllm_engines} is not valid; allowed: >= 1 (rollouts are generated by vLLM)")
    if cfg.loss.level == "sequence" and t.agg_mode != "seq-mean-token-mean":
        _fail(
            f"train.agg_mode={t.agg_mode!r} is not valid with loss.level='sequence': OpenRLHF's gspo always uses "
            "the sequence mean; allowed: seq-mean-token-mean"
        )
    if o.zero_stage not in (0, 1, 2, 3):
        _fail(f"openrlhf.zero_stage={o.zero_stage} is not valid; allowed: 0, 1, 2, 3")
    if t.dgg and o.zero_stage == 0:
        _fail(
            "openrlhf.zero_stage=0 with train.dgg=true: DGG skips a step through the ZeRO optimizer "
            "(nsr/openrlhf/gate.py); allowed: 1, 2, 3"
        )
    if not o.bf16 and not o.cpu:
        _fail(
            "openrlhf.bf16=false is not valid on a GPU run: OpenRLHF 0.11.2's --ds.param_dtype takes bf16 or fp16 "
            "only; float32 is the CPU path's (openrlhf.cpu=true: nsr/openrlhf/cpu_shim.py) and fp16 (DeepSpeed's "
            "loss scaling) is not offered; allowed: true"
        )
    if t.dgg and not o.bf16:
        _fail(
            "openrlhf.bf16=false with train.dgg=true: DGG's skipped step (the ZeRO optimizer's overflow path, "
            "nsr/openrlhf/gate.py) is tested in bfloat16 only; allowed: true"
        )
    if not 0 < o.vllm_gpu_memory_utilization <= 1:
        _fail(f"openrlhf.vllm_gpu_memory_utilization={o.vllm_gpu_memory_utilization} is not valid; allowed: (0, 1]")
    if o.overlong_buffer_len < 0 or o.overlong_buffer_len >= r.max_new_tokens:
        _fail(
            f"openrlhf.overlong_buffer_len={o.overlong_buffer_len} is not valid; allowed: 0 (off) .. "
            f"rollout.max_new_tokens - 1 = {r.max_new_tokens - 1}"
        )
    try:
        check_random_reward(cfg.advantages.kind, o.dynamic_filtering, o.overlong_buffer_len)
    except ValueError as e:
        _fail(str(e))
    if cfg.eval.every and cfg.eval.every % o.save_steps:
        _fail(
            f"eval.every={cfg.eval.every} is not valid with openrlhf.save_steps={o.save_steps}: the evaluator reads "
            f"the HF checkpoints written every save_steps; allowed: a multiple of {o.save_steps}, or 0 (last step only)"
        )
    if o.dynamic_filtering and o.lr_scheduler not in CONSTANT_SCHEDULES:
        _fail(
            f"openrlhf.lr_scheduler={o.lr_scheduler!r} with openrlhf.dynamic_filtering: OpenRLHF sizes the schedule "
            f"from the prompt rows (x{rows_needed(cfg) // (t.steps * r.prompts_per_step)} train.steps with the "
            f"filter's headroom), so a decay would stop early; allowed: {', '.join(CONSTANT_SCHEDULES)}"
        )


def check_cpu(cfg: RunConfig) -> None:
    """A CPU run (``openrlhf.cpu``) runs OpenRLHF's loop on this machine's CPU: one node, no colocation (vLLM has
    no sleep mode on CPU), no packing (flash-attention only), and :data:`CPU_SETTINGS`."""
    o, name = cfg.openrlhf, "openrlhf.cpu=true"
    for key, value, allowed, why in (
        ("nodes", o.nodes, 1, "the CPU run is one machine"),
        ("colocate_all", o.colocate_all, False, "vLLM has no sleep mode on CPU"),
        ("packing_samples", o.packing_samples, False, "OpenRLHF packs with flash-attention only"),
    ):
        if value != allowed:
            _fail(f"openrlhf.{key}={value!r} is not valid with {name} (a CPU run): {why}; allowed: {allowed!r}")
    extra = list(o.extra_args)
    for flag, value in CPU_SETTINGS.items():
        want = [flag] if value is None else [flag, value]
        if not any(extra[i : i + len(want)] == want for i in range(len(extra))) and f"{flag}={value}" not in extra:
            _fail(
                f"openrlhf.extra_args lacks {' '.join(want)}, which a CPU run ({name}) needs; allowed: extra_args "
                f"holding {' '.join(f if v is None else f'{f} {v}' for f, v in CPU_SETTINGS.items())}"
            )


def warmup_ratio(cfg: RunConfig) -> float:
    """``--actor.lr_warmup_ratio``: OpenRLHF takes the ratio of its schedule length, which it computes from
    ``--data.max_samples`` (the rows, with the filter's headroom); rescaled so the warmup lasts
    ``openrlhf.lr_warmup_ratio`` x ``train.steps`` RL steps."""
    planned = cfg.train.steps * cfg.rollout.prompts_per_step
    return cfg.openrlhf.lr_warmup_ratio * planned / rows_needed(cfg)


def _num(v) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def openrlhf_flags(cfg: RunConfig, run_dir: Path, run_id: str) -> list[tuple[str, list[str]]]:
    """(flag, values) pairs of the OpenRLHF command; ``values`` is [] for a store_true flag."""
    o, r, t, loss = cfg.openrlhf, cfg.rollout, cfg.train, cfg.loss
    data = train_data_path(cfg)
    flags: list[tuple[str, list[str]]] = [
        # model, data, reward
        ("--actor.model_name_or_path", [model_path(cfg)]),
        ("--data.prompt_dataset", [str(data)]),
        ("--data.input_key", [INPUT_KEY]),
        ("--data.label_key", [LABEL_KEY]),
        ("--data.max_len", [str(cfg.task.max_prompt_len + r.max_new_tokens)]),
        # RL steps: the launcher stops at train.steps (--nsr.max_steps); the loader holds enough prompts for that
        # even when dynamic filtering replaces filtered prompts (experiments/openrlhf/plan.py rows_needed)
        ("--data.max_samples", [str(rows_needed(cfg))]),
        ("--train.num_episodes", ["1"]),
        ("--reward.remote_url", [str(REWARD_FILE)]),
        # rollout
        ("--rollout.batch_size", [str(r.prompts_per_step)]),
        ("--rollout.n_samples_per_prompt", [str(r.samples_per_prompt)]),
        ("--rollout.temperature", [_num(r.temperature)]),
        ("--rollout.max_new_tokens", [str(r.max_new_tokens)]),
        ("--rollout.micro_batch_size", [str(o.micro_rollout_batch_size)]),
        # updates
        ("--train.seed", [str(cfg.seed)]),
        ("--train.batch_size", [str(o.train_batch_size)]),
        ("--train.micro_batch_size", [str(o.micro_train_batch_size)]),
        ("--train.max_epochs", [str(t.epochs)]),
        ("--actor.adam.lr", [_num(t.lr)]),
        ("--actor.adam.betas", [_num(float(b)) for b in t.adam_betas]),
        ("--actor.adam.weight_decay", [_num(t.weight_decay)]),
        ("--actor.max_norm", [_num(t.grad_clip)]),
        ("--actor.lr_scheduler", [o.lr_scheduler]),
        ("--actor.lr_warmup_ratio", [_num(warmup_ratio(cfg))]),
        # policy loss (the region, level and dual clip drive NSRPolicyLoss too)
        ("--actor.policy_loss_type", [LOSS_TYPE[loss.level]]),
        ("--actor.loss_agg_mode", [t.agg_mode]),
        ("--actor.eps_clip_low_high", [_num(loss.eps_low), _num(loss.eps_high)]),
        ("--algo.advantage.estimator", [ESTIMATOR[cfg.advantages.kind]]),
        ("--algo.kl.init_coef", [_num(t.kl_coef)]),
        # resources
        ("--actor.num_nodes", [str(o.nodes)]),
        ("--actor.num_gpus_per_node", [str(o.gpus_per_node)]),
        ("--vllm.num_engines", [str(o.vllm_engines)]),
        ("--vllm.tensor_parallel_size", [str(o.vllm_tensor_parallel)]),
        ("--vllm.gpu_memory_utilization", [_num(o.vllm_gpu_memory_utilization)]),
        ("--ds.zero_stage", [str(o.zero_stage)]),
        # float32 (a CPU run's openrlhf.bf16=false) is the launcher's --nsr.fp32: OpenRLHF's flag has no such choice
        *([("--ds.param_dtype", ["bf16"])] if o.bf16 else []),
        # run folder: checkpoints (DeepSpeed for resume, HF for the offline evaluator) and TensorBoard
        ("--ckpt.path", [str(run_dir / "ckpt")]),
        ("--ckpt.output_dir", [str(run_dir / "ckpt" / "final_hf")]),
        ("--ckpt.save_steps", [str(o.save_steps)]),
        ("--ckpt.save_hf", []),
        ("--ckpt.max_num", [str(CKPT_MAX_NUM)]),
        ("--ckpt.load_enable", []),
        ("--ckpt.best_metric_key", ["none"]),
        ("--logger.tensorboard_dir", [str(run_dir / "tensorboard")]),
        ("--logger.wandb.run_name", [run_id]),
    ]
    if t.entropy_coef > 0:
        # Only with a bonus: any value, 0 included, makes OpenRLHF keep a (tokens x vocabulary) fp32 entropy tensor
        # through backward (~10 GB per micro-batch at 7B). The logged entropy is then NSRPolicyLoss's free
        # Monte-Carlo estimate nsr_entropy_mc (nsr/openrlhf/metrics.py).
        flags.append(("--actor.entropy_coef", [_num(t.entropy_coef)]))
    if cfg.task.chat_template:
        flags.append(("--data.apply_chat_template", []))
    if loss.dual_clip is not None:
        flags.append(("--actor.dual_clip", [_num(loss.dual_clip)]))
    if t.kl_coef > 0:  # a KL-to-reference loss (k3, as GRPO) needs the reference model on the actor's GPUs
        flags += [
            ("--algo.kl.use_loss", []),
            ("--algo.kl.estimator", ["k3"]),
            ("--ref.num_nodes", [str(o.nodes)]),
            ("--ref.num_gpus_per_node", [str(o.gpus_per_node)]),
        ]
    if o.gradient_checkpointing:
        flags.append(("--actor.gradient_checkpointing_enable", []))
    if o.packing_samples:
        flags.append(("--ds.packing_samples", []))
    if o.colocate_all:
        flags += [("--train.colocate_all", []), ("--vllm.enable_sleep", []), ("--ds.enable_sleep", [])]
    if o.dynamic_filtering:
        flags += [("--algo.dynamic_filtering_enable", []), ("--algo.dynamic_filtering_range", ["0", "1"])]
    if o.overlong_buffer_len:
        flags += [
            ("--reward.overlong_buffer_len", [str(o.overlong_buffer_len)]),
            ("--reward.overlong_penalty_factor", [_num(o.overlong_penalty_factor)]),
        ]
    return flags


def nsr_settings(cfg: RunConfig, run_dir: Path) -> NSRSettings:
    t = cfg.train
    return NSRSettings.from_configs(
        cfg.loss,
        cfg.advantages,
        metrics_path=str(run_dir / "metrics.jsonl"),
        max_steps=t.steps,
        **({"dgg": True, "dgg_k": t.dgg_k, "dgg_window": t.dgg_window} if t.dgg else {}),
        **({"allow_on_policy": True} if t.allow_on_policy else {}),
        **({} if cfg.openrlhf.bf16 else {"fp32": True}),
        **(
            {"record_steps": ",".join(map(str, rec)), "record_dir": str(run_dir / "batches")}
            if (rec := cfg.logging.record_batches)
            else {}
        ),
    )


def cpu_threads(cfg: RunConfig) -> int:
    """Compute threads (``OMP_NUM_THREADS``) of each process of a CPU run: the run's threads (``NSR_THREADS``, default
    1; a SLURM job sets its CPUs) shared by the processes that compute at the same time. OpenRLHF's loop is
    synchronous: the vLLM engines generate while the policy ranks wait, then the ranks train while the engines wait, so
    the ranks share the run's threads with each other and the engines with each other, never ranks with engines.
    Measured on SmolLM2 (docs/testbed.md, "OpenRLHF on SmolLM2"): the 16 updates of a rollout took 59 s with one thread
    and 36-40 s with two. The thread count changes float rounding, never a run id (experiments/threads.py)."""
    from experiments.threads import threads

    o = cfg.openrlhf
    ranks = o.nodes * o.gpus_per_node
    return max(1, threads() // max(ranks, o.vllm_engines * o.vllm_tensor_parallel))


def build_command(cfg: RunConfig, run_dir: str | Path, run_id: str, python: str = sys.executable) -> LaunchCommand:
    """The launcher command for ``cfg`` writing into ``run_dir`` (made absolute: Ray workers have another cwd)."""
    check(cfg)
    run_dir = Path(run_dir).absolute()
    pairs = openrlhf_flags(cfg, run_dir, run_id)
    ours = {f for f, _ in pairs}
    extra = list(cfg.openrlhf.extra_args)
    for a in extra:
        name = a.split("=", 1)[0]
        if name in ours:
            _fail(
                f"openrlhf.extra_args sets {name}, which the run config already sets; allowed: change the RunConfig "
                f"field behind it instead (see experiments/openrlhf/argv.py)"
            )
        if name.startswith("--nsr."):
            _fail(f"openrlhf.extra_args holds {name}; allowed: OpenRLHF flags only (the loss comes from loss.*)")
    orl = [x for f, vals in pairs for x in (f, *vals)] + extra
    nsr = nsr_settings(cfg, run_dir).to_argv()
    env = {CPU_ENV: "1"} if cfg.openrlhf.cpu else {}
    if cfg.openrlhf.cpu and "OMP_NUM_THREADS" not in os.environ:  # a value the caller set wins
        env["OMP_NUM_THREADS"] = str(cpu_threads(cfg))
    return LaunchCommand(argv=[python, "-m", LAUNCHER, *nsr, *orl], openrlhf_argv=orl, nsr_argv=nsr, env=env)
