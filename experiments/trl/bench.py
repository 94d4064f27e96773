"""Time a trl-backend RL step against TRL's own GRPOTrainer on the same model, data, reward and GRPOConfig.

    python -m experiments.trl.bench sweeps/presets/smollm2-trl-cpu.yaml train.minibatches=4 --trainer kit --steps 4
    python -m experiments.trl.bench sweeps/presets/smollm2-trl-cpu.yaml train.minibatches=4 --trainer trl --steps 4

``--trainer kit`` times the trainer the trl backend itself builds (experiments.trl.train.build_trainer: the preset's
loss, advantages and its ``trl.*`` savings, as a run has them), writing into a temporary run folder, without
evaluation. ``--trainer trl`` times TRL's GRPOTrainer on the same parts and GRPOConfig (its default loss: dapo with
the same trust region; its own advantages). torch uses every core unless NSR_THREADS says otherwise.

One JSON line: seconds of each RL step (generation, rewards, the old log-probs and every update), their median over
the steps after the first (TRL's start-up is in the first), the seconds of each step's generation and of its whole
rollout (generation, rewards, old log-probs; the rest of a step is its updates), the load average at the start and
the end, the process's peak resident memory, and the size of one TRL checkpoint (with ``--checkpoint``); with
``--profile``, each phase's and model part's median seconds and each phase's peak memory over the steps after the
first (experiments/trl/profile.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _timed(fn, sink: list[float]):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sink.append(time.perf_counter() - t0)

    return wrapper


def bench(cfg, trainer_kind: str, steps: int, checkpoint: bool = False, profile: bool = False) -> dict:
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from experiments.rundir import RunDir
    from experiments.trl.train import build_trainer, grpo_config, optimizer_steps_per_rl_step, trainer_parts

    threads = _set_threads()
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, steps=steps))
    k = optimizer_steps_per_rl_step(cfg)
    times: list[float] = []
    phases: dict[str, list[float]] = {}

    class Clock(TrainerCallback):
        def __init__(self):
            self.t0 = None

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % k == 0:
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % k == 0 and self.t0 is not None:
                times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as tmp:
        if trainer_kind == "kit":
            trainer, _ = build_trainer(cfg, RunDir(Path(tmp) / "run"), evaluate=False)
            info = trainer.model.model_info if hasattr(trainer.model, "model_info") else None
        else:
            model, tok, data, reward, _ = trainer_parts(cfg)
            info = getattr(model, "model_info", None)
            trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=grpo_config(cfg, Path(tmp) / "run"),
                                  train_dataset=data, processing_class=tok)  # fmt: skip
        trainer.add_callback(Clock())
        if checkpoint:
            trainer.args.save_strategy, trainer.args.save_steps = "steps", k
        for name in ("_generate", "_generate_and_score_completions"):  # the same methods in both trainers
            setattr(trainer, name, _timed(getattr(trainer, name), phases.setdefault(name, [])))
        prof = None
        if profile:
            from experiments.trl.profile import StepProfile

            prof = StepProfile(trainer, k)
        load0 = os.getloadavg()[0]
        try:
            trainer.train()
        finally:
            if prof is not None:
                prof.close()
        ckpts = sorted((Path(tmp) / "run").rglob("checkpoint-*"))
        ckpt_bytes = _dir_bytes(ckpts[-1]) if ckpts else None
    out = {
        "trainer": trainer_kind,
        "threads": threads,
        "step_s": [round(t, 2) for t in times],
        "median_s_after_first": round(statistics.median(times[1:]), 2) if len(times) > 1 else None,
        # per RL step: generation alone, and the whole rollout (generation, rewards, old log-probs, advantages);
        # the step's rest is the minibatch updates
        "generate_s": [round(t, 2) for t in phases["_generate"]],
        "rollout_s": [round(t, 2) for t in phases["_generate_and_score_completions"]],
        "load_start": round(load0, 2),
        "load_end": round(os.getloadavg()[0], 2),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "checkpoint_mb": round(ckpt_bytes / 2**20, 1) if ckpt_bytes else None,
        "weights_sha256": info["weights_sha256"][:16] if info else None,
    }
    if prof is not None:
        out["profile"] = prof.summary()
    return out


def _set_threads() -> int:
    """NSR_THREADS if set, else every core of this machine (a bench measures the machine, not a grid run)."""
    import torch

    from experiments.threads import set_threads

    if os.environ.get("NSR_THREADS"):
        return set_threads()
    n = len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


def main(argv: list[str] | None = None) -> int:
    from experiments.config import load_config

    p = argparse.ArgumentParser(prog="python -m experiments.trl.bench", description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--trainer", choices=("kit", "trl"), default="kit")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--checkpoint", action="store_true", help="save a TRL checkpoint every RL step; report its size")
    p.add_argument(
        "--profile",
        action="store_true",
        help="split each step into phases and model parts, with peak memory (experiments/trl/profile.py)",
    )
    args = p.parse_intermixed_args(sys.argv[1:] if argv is None else argv)  # overrides before or after options
    cfg = load_config(args.config, args.overrides)
    print(json.dumps(bench(cfg, args.trainer, args.steps, args.checkpoint, args.profile)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
