"""The trl backend of ``experiments.run``: a RunConfig run by TRL's GRPOTrainer loop (nsr.trl.NSRGRPOTrainer).

    python -m experiments.run sweeps/presets/trl-tiny.yaml loss.rule=nsr --out /tmp/trl-nsr

RunConfig -> GRPOConfig: one RL step = one TRL generation batch of rollout.prompts_per_step x samples_per_prompt
completions (``generation_batch_size``), split into train.minibatches optimizer steps (``steps_per_generation``,
gradient accumulation over trl.micro_batch_size sequences) and reused for train.epochs passes (``num_iterations``),
so K = minibatches x epochs optimizer steps per RL step and ``max_steps`` = train.steps x K. TRL logs every K
optimizer steps, i.e. once per RL step, averaging its metrics over the step: each log becomes one metrics.jsonl row.

Run folder (experiments/rundir.py): config.yaml and status.json by ``experiments.run``; metrics.jsonl per RL step
(the clip and rescue fractions of nsr.METRIC_KEYS, as the tiny backend names them); ratio_bins.jsonl per RL step at
token level (NSRGRPOTrainer's premise meter, nsr.premise, the tiny backend's format); eval.jsonl at step 0, every
eval.every steps and at the last step, with per-sample labels (tiny tasks: the testbed's evaluator and eval set;
math: the offline evaluator's benchmarks and scorer); TRL's checkpoints in ``trl_checkpoints/`` every
logging.checkpoint_every RL steps. A folder with a checkpoint resumes from the latest one (TRL restores model,
optimizer, scheduler and RNG states), its logs cut back to that step. Tiny models start from the testbed's cached SFT
warm start (experiments/sft.py).

Stopping without loss: SIGUSR1 (``kill -USR1 PID``; on SLURM ``scancel --signal=USR1 JOB``) makes the run finish the
RL step under way, save a TRL checkpoint at its end, stop and record ``cancelled``; the rerun resumes from that step.
(SIGTERM stops at once; the rerun resumes from the last periodic checkpoint.)
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import torch

from experiments import stop_request
from experiments.config import RunConfig
from experiments.rundir import Cancelled, RunDir
from experiments.stop_request import SaveRequest
from experiments.trl.config_checks import HF_TASKS

CHECKPOINT_DIR = "trl_checkpoints"
SAVE_SIGNAL = signal.SIGUSR1
"""What run_trl listens for when called directly (tests, probes); under experiments.run the backend's
``save_signal`` (experiments/backends.py) is listened for from before the attempt starts."""


def optimizer_steps_per_rl_step(cfg: RunConfig) -> int:
    return cfg.train.minibatches * cfg.train.epochs


def grpo_config(cfg: RunConfig, output_dir: str | Path, progress: bool = False):
    """The GRPOConfig of ``cfg`` (every value from the RunConfig; TRL defaults only where the RunConfig is silent)."""
    from trl import GRPOConfig

    from nsr.trl import AGG_MODE_OF_LOSS_TYPE, LOSS_TYPES

    ro, tr, lo = cfg.rollout, cfg.train, cfg.loss
    samples = ro.prompts_per_step * ro.samples_per_prompt
    per_step = samples // tr.minibatches
    micro = cfg.trl.micro_batch_size or per_step
    k = optimizer_steps_per_rl_step(cfg)
    every = cfg.logging.checkpoint_every
    cuda = torch.cuda.is_available()
    loss_type = next(t for t in LOSS_TYPES if AGG_MODE_OF_LOSS_TYPE[t] == tr.agg_mode)
    return GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=not cuda,
        bf16=cfg.trl.bf16,  # GPU: bf16 weights (_math_parts) and autocast; CPU: autocast over float32 weights
        seed=cfg.seed,
        data_seed=cfg.seed,
        # one RL step = one generation batch, minibatches x epochs optimizer steps on it
        num_generations=ro.samples_per_prompt,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,
        steps_per_generation=tr.minibatches * (per_step // micro),
        num_iterations=tr.epochs,
        max_steps=tr.steps * k,
        max_completion_length=ro.max_new_tokens,
        temperature=ro.temperature,
        top_p=1.0,
        top_k=0,
        # optimizer
        learning_rate=tr.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=tr.adam_betas[0],
        adam_beta2=tr.adam_betas[1],
        weight_decay=tr.weight_decay,
        max_grad_norm=tr.grad_clip,
        gradient_checkpointing=cfg.trl.gradient_checkpointing,
        # loss: the rule is nsr's; TRL's settings agree with it (NSRGRPOTrainer checks)
        loss_type=loss_type,
        epsilon=lo.eps_low,
        epsilon_high=lo.eps_high,
        importance_sampling_level=lo.level,
        beta=tr.kl_coef,
        entropy_coef=tr.entropy_coef,
        mask_truncated_completions=False,
        use_vllm=cfg.trl.use_vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=cfg.trl.vllm_gpu_memory_utilization,
        # logging and checkpoints: once per RL step
        logging_steps=k,
        save_strategy="steps" if every else "no",
        save_steps=max(every, 1) * k,
        save_total_limit=1,
        report_to="none",
        disable_tqdm=not progress,
        log_completions=False,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )


def speed_options(cfg: RunConfig) -> dict[str, bool]:
    """NSRGRPOTrainer's speed options as the config sets them (trl.compact_logprobs, share_prompt, skip_zero_adv,
    rollout_bf16, checkpoint_mlp)."""
    t = cfg.trl
    return {"compact_logprobs": t.compact_logprobs, "share_prompt": t.share_prompt,
            "skip_zero_advantage": t.skip_zero_adv, "rollout_bf16": t.rollout_bf16,
            "checkpoint_mlp": t.checkpoint_mlp}  # fmt: skip


def _tiny_parts(cfg: RunConfig, progress: bool):
    """(model, tokenizer, dataset, reward function, evaluate) for a model built in code on a testbed task."""
    from experiments.evaluation.testbed import evaluate
    from experiments.models.qwen2 import char_tokenizer  # registers tiny-qwen2
    from experiments.models.tiny import build_model
    from experiments.sft import warm_start
    from experiments.tasks.countdown import get_task
    from experiments.trl.data import task_reward, train_dataset
    from nsr.seeds import generator

    task = get_task(cfg.task.name)
    state, info = warm_start(cfg, progress=progress)
    model = build_model(cfg.model, generator(cfg.sft.seed, "sft-init"))
    model.load_state_dict(state)
    model.warm_start_info = info  # recorded into the run folder by build_trainer (meta.warm_start)

    def run_eval(model, step: int) -> list[dict]:
        was_training = model.training
        rows = evaluate(model, task, cfg, step)
        model.train(was_training)
        return rows

    return model, char_tokenizer(), train_dataset(task), task_reward(task), run_eval


def _math_parts(cfg: RunConfig, progress: bool):
    """(model, tokenizer, dataset, reward function, evaluate) for a HF model (experiments.models.smollm2.load) on the
    math prompt files made by ``python -m experiments.openrlhf.data`` or the generated arithmetic task
    (experiments.tasks.arithmetic), scored by the kit's math reward."""
    from datasets import Dataset

    from experiments.evaluation.math import eval_rows, load_benchmark
    from experiments.models.smollm2 import load
    from experiments.rewards.math import score
    from experiments.rundir import read_jsonl

    dtype = torch.bfloat16 if cfg.trl.bf16 and torch.cuda.is_available() else torch.float32
    model, tok, model.model_info = load(cfg.model.name, untie=cfg.model.untie_embeddings, dtype=dtype)
    if cfg.task.name == "arithmetic":  # generated on first use; prompts are chats already
        from experiments.tasks.arithmetic import write_files

        files = write_files(cfg.task)
        rows = read_jsonl(files["train"])
        held_out = read_jsonl(files["eval"])[: cfg.eval.n_prompts]

        def benchmarks():
            return [("arithmetic", held_out)] if held_out else []

        def prompt(p):
            return p
    else:
        rows = read_jsonl(Path(cfg.task.train_data))

        def benchmarks():
            return [(name, load_benchmark(cfg, name)) for name in cfg.task.eval_benchmarks]

        def prompt(p):
            return [{"role": "user", "content": p}] if cfg.task.chat_template else p

    data = Dataset.from_dict({"prompt": [prompt(r["prompt"]) for r in rows], "label": [r["label"] for r in rows]})

    def math_correct(prompts, completions, label, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(t, lab) for t, lab in zip(texts, label)]

    def run_eval(model, step: int) -> list[dict]:
        from experiments.trl.generate import sample_texts

        out = []
        for name, problems in benchmarks():
            prompts = [prompt(p["prompt"]) for p in problems]
            for decoding, texts in sample_texts(model, tok, prompts, cfg, step).items():
                out += eval_rows(step, name, problems, texts, decoding)
        return out

    return model, tok, data, math_correct, run_eval


def trainer_parts(cfg: RunConfig, progress: bool = False):
    """(model, tokenizer, dataset, reward function, evaluate) of ``cfg``: a HF model on a math task, or a testbed
    model on a testbed task."""
    return (_math_parts if cfg.task.name in HF_TASKS else _tiny_parts)(cfg, progress)


ROW_NAMES = {"approx_kl": "ppo_kl"}
"""metrics.jsonl names of the nsr.METRIC_KEYS values that the run-folder contract names differently."""


def _metrics_row(step: int, logs: dict, wall_s: float) -> dict:
    """One metrics.jsonl row from TRL's log of an RL step (names as the tiny backend's rows). Every value is
    NSRGRPOTrainer's, already reduced over the step as declared (nsr.METRIC_REDUCE for the nsr.METRIC_KEYS values)."""
    from nsr import METRIC_KEYS

    row = {
        "step": step,
        "reward_mean": logs.get("reward"),
        "entropy": logs.get("entropy"),
        "response_len": logs.get("completions/mean_length"),
        **{ROW_NAMES.get(k, k): logs.get(f"nsr/{k}") for k in METRIC_KEYS},
        "policy_loss": logs.get("nsr/policy_loss"),
        "grad_norm": logs.get("grad_norm"),
        "adv_abs_mean": logs.get("nsr/adv_abs_mean"),
        "mixed_group_frac": logs.get("nsr/mixed_group_frac"),
        "wall_s": wall_s,
    }
    if "kl" in logs:
        row["ref_kl"] = logs["kl"]
    return row


def _eval_due(cfg: RunConfig, step: int) -> bool:
    return step == cfg.train.steps or (cfg.eval.every > 0 and step % cfg.eval.every == 0)


def latest_checkpoint(rd: RunDir) -> Path | None:
    """The newest complete TRL checkpoint folder of the run (trainer_state.json written last), or None."""
    folder = rd.path / CHECKPOINT_DIR
    done = [p for p in folder.glob("checkpoint-*") if (p / "trainer_state.json").exists()] if folder.is_dir() else []
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


MODEL_RECORD = "model.json"
"""In ``trl_checkpoints/``: the model identity a run started from (meta.model), kept for its resumes."""


def _record_model(rd: RunDir, info: dict) -> None:
    """meta.model in config.yaml (gguf_sha256, weights_sha256, untied, name); a run with checkpoints refuses to resume
    from other weights than those it started from (ModelSourceError)."""
    import json

    from experiments.models.smollm2 import check_resume

    meta = {k: info[k] for k in ("name", "gguf_sha256", "weights_sha256", "untied")}
    record = rd.path / CHECKPOINT_DIR / MODEL_RECORD
    if latest_checkpoint(rd) is not None and record.is_file():
        check_resume(json.loads(record.read_text()), meta, rd.path)
    elif latest_checkpoint(rd) is None:
        shutil.rmtree(rd.path / CHECKPOINT_DIR, ignore_errors=True)
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(meta, indent=1) + "\n")
    if rd.config_path.exists():
        rd.update_meta(model=meta)


def checkpoint_rl_step(checkpoint: Path, cfg: RunConfig) -> int:
    """The RL step a TRL checkpoint folder (``checkpoint-<optimizer step>``) was saved after."""
    return int(checkpoint.name.split("-")[1]) // optimizer_steps_per_rl_step(cfg)


def check_runnable(cfg: RunConfig) -> None:
    """The checks the run makes at its start, without a model: the GRPOConfig it builds and NSRGRPOTrainer's refusals
    of that config (nsr.trl). ConfigError naming the option and what is allowed."""
    import tempfile

    from experiments.config_errors import ConfigError
    from nsr.trl.trainer import _check_args

    try:
        with tempfile.TemporaryDirectory() as tmp:
            _check_args(grpo_config(cfg, tmp), cfg.loss, cfg.advantages, cfg.train.allow_on_policy)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_trainer(
    cfg: RunConfig,
    rd: RunDir,
    progress: bool = False,
    stop_after: int | None = None,
    before_step=None,
    save_and_stop: SaveRequest | None = None,
    evaluate: bool = True,
):
    """(NSRGRPOTrainer of ``cfg`` writing into ``rd``, evaluate function). ``stop_after``: the trainer stops after
    this RL step as if killed (tests of the resume path). ``before_step(step, trainer)``: called once per RL step
    ``step`` (1-based) after its rollout and before its updates (NSRGRPOTrainer.after_rollout). ``save_and_stop``:
    once requested, the trainer saves a checkpoint at the end of the RL step under way (unless it is the last) and
    stops. ``evaluate=False``: no evaluation at the due steps (experiments.trl.bench times training only)."""
    from transformers import PrinterCallback, TrainerCallback

    from nsr.trl import NSRGRPOTrainer

    if not progress:  # transformers' bars (checkpoint writing) too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    model, tok, data, reward, run_eval = trainer_parts(cfg, progress)
    info = getattr(model, "warm_start_info", None)
    if info is not None and rd.config_path.exists():  # a model trained from a testbed warm start: pairs need its hash
        from experiments.sft import record_warm_start

        record_warm_start(rd, cfg, info)
    model_info = getattr(model, "model_info", None)
    if model_info is not None:  # a HF model: what it starts from (meta.model), checked again on resume
        _record_model(rd, model_info)
    k = optimizer_steps_per_rl_step(cfg)

    class RunFolder(TrainerCallback):
        """Writes TRL's per-RL-step log as a metrics.jsonl row (and the premise meter's as a ratio_bins.jsonl row),
        and the eval due at that step."""

        def __init__(self):
            self.t0 = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "train_runtime" in logs or state.global_step % k:  # the end-of-training summary
                return
            step = state.global_step // k
            wall = time.perf_counter() - self.t0
            rd.append("metrics.jsonl", [_metrics_row(step, logs, wall)])
            if trainer.premise_counts is not None:  # the premise meter's counts of this RL step (token level)
                from nsr.premise import counts_row

                tokens = trainer.premise_tokens or (None, None)
                rd.append("ratio_bins.jsonl", [counts_row(trainer.premise_counts, step, cfg.loss, *tokens)])
                trainer.premise_counts = None
            if evaluate and _eval_due(cfg, step):
                rd.append("eval.jsonl", run_eval(trainer.model, step))
            if stop_after is not None and step >= stop_after:
                control.should_training_stop = True
            self.t0 = time.perf_counter()

    class SaveOnRequest(TrainerCallback):
        """At an RL step's end (every K optimizer steps) after a save-and-stop request: save, then stop. The step's
        metrics row is written before the save (Trainer logs, then saves), so the checkpoint and the logs agree. Read
        at the step's end and again after its log and eval (a request made during the eval counts for this step)."""

        def on_step_end(self, args, state, control, **kwargs):
            self._check(state, control)

        def on_log(self, args, state, control, logs=None, **kwargs):  # after RunFolder's (callbacks run in order)
            self._check(state, control)

        @staticmethod
        def _check(state, control):
            if save_and_stop is not None and save_and_stop.requested and state.global_step % k == 0:
                if state.global_step < state.max_steps:
                    control.should_save = True
                    control.should_training_stop = True

    trainer = NSRGRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=grpo_config(cfg, rd.path / CHECKPOINT_DIR, progress),
        train_dataset=data,
        processing_class=tok,
        callbacks=[RunFolder(), SaveOnRequest()],
        loss=cfg.loss,
        advantages=cfg.advantages,
        seed=cfg.seed,
        allow_on_policy=cfg.train.allow_on_policy,
        **speed_options(cfg),
    )
    trainer.remove_callback(PrinterCallback)  # TRL's log goes to metrics.jsonl, not stdout
    if before_step is not None:
        trainer.after_rollout = lambda t: before_step(t.state.global_step // k + 1, t)
    if trainer.accelerator.num_processes != 1:  # one process writes the run folder: CPU or one GPU
        raise ValueError(
            f"the trl backend runs in one process (CPU or one GPU); got {trainer.accelerator.num_processes} processes "
            "(accelerate launch / torchrun): run `python -m experiments.run` directly"
        )
    return trainer, run_eval


def run_trl(cfg: RunConfig, rd: RunDir, progress: bool = True, stop_after: int | None = None, before_step=None) -> None:
    """Run ``cfg`` on the trl backend into ``rd``, resuming from its latest TRL checkpoint if there is one.

    ``stop_after``: end after this RL step as if killed (tests of the resume path), leaving the folder unfinished.
    ``before_step(step, trainer)``: called after each RL step's rollout, before its updates (experiments.mechanism.trl);
    it must leave the trainer's state unchanged.
    """
    from experiments.threads import set_threads

    set_threads()
    progress = progress and cfg.logging.progress
    # experiments.run listens for SAVE_SIGNAL around the whole attempt; called directly (main thread), listen here
    own = stop_request.current() is None and threading.current_thread() is threading.main_thread()
    previous = stop_request.listen(SAVE_SIGNAL) if own else None
    try:
        _train(cfg, rd, progress, stop_after, before_step, stop_request.current() or SaveRequest())
    finally:
        if own:
            stop_request.restore(SAVE_SIGNAL, previous)


def _train(cfg: RunConfig, rd: RunDir, progress: bool, stop_after, before_step, stop: SaveRequest) -> None:
    trainer, run_eval = build_trainer(cfg, rd, progress, stop_after, before_step, stop)
    resume = latest_checkpoint(rd)
    if resume is None:
        for p in (rd.path / CHECKPOINT_DIR).glob("*"):  # a fresh start: nothing but the model record stays
            if p.name != MODEL_RECORD:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
        rd.reset_logs()
        rd.append("eval.jsonl", run_eval(trainer.model, 0))
    else:
        rd.truncate_logs(checkpoint_rl_step(resume, cfg))
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    step = trainer.state.global_step // optimizer_steps_per_rl_step(cfg)
    if stop.requested and step < cfg.train.steps:
        raise Cancelled(
            f"signal {stop.signal}: saved a checkpoint after RL step {step} of {cfg.train.steps} and stopped; "
            "a rerun resumes from it"
        )
    if stop_after is not None and stop_after < cfg.train.steps:
        return
    rd.compress_eval()
    if not cfg.logging.keep_checkpoint:
        shutil.rmtree(rd.path / CHECKPOINT_DIR, ignore_errors=True)
