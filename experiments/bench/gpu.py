"""GPU benchmark (torch and transformers only): runs per second of the batched tiny trainer, and the loss in bf16.

    python -m experiments.bench.gpu                         # one GPU, under 8 minutes: S = 1 8 64, then the loss
    python -m experiments.bench.gpu --save                  # ... and write results/bench_gpu/<date>-<gpu>.json
    python -m experiments.bench.gpu --device cpu --small    # the smoke size a test runs on a CPU

Part 1, the batched trainer (experiments/tiny/batched.py) on the device: for each batch size S, S runs of the tiny
preset (seeds 0 .. S - 1, ``loss.rule`` from ``--rule``) advanced by ``batch_rl_step`` (rollout with per-run
sampling, rewards, advantages, the old log-probs, epochs x minibatches updates, each run's loss, bins and metrics row),
``--warmup`` untimed steps, then ``--steps`` timed ones (the device synchronised around each). Reported: seconds per
batched RL step, run-steps per second (S / step time) and runs per hour of the preset's length (its ``train.steps``,
evals left out). Weights: the preset's warm start where it is cached or committed, else each run's own random init
(the rollouts are then longer: a conservative number). On a GPU the sampling and the loss draw on generators of the
device, so the numbers of the runs differ from a CPU run's; only the time is the point here.

Part 2, the loss: ``experiments.openrlhf.bench_gpu.bench`` (NSRPolicyLoss of each rule against OpenRLHF 0.11.2's
PolicyLoss, forward + backward, CUDA events) at 512 x 8192 tokens in bf16; it needs the ``openrlhf`` package's files
(``pip install --no-deps openrlhf==0.11.2``, as ``make venv`` does), and is skipped with a note without them.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

import nsr
from experiments.config import load_config
from experiments.models.tiny import build_model
from experiments.rundir import REPO_ROOT
from experiments.sft import committed_dir, sft_key, sft_path
from experiments.tasks.countdown import get_task
from experiments.tiny.batched import batch_rl_step
from experiments.tiny.batched_model import BatchedAdamW, BatchedGPT2
from nsr.seeds import generator

TINY_PRESET = REPO_ROOT / "sweeps" / "presets" / "tiny.yaml"
SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.minibatches=2"]
"""--small: the rollout of the CPU smoke run."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_state(cfg):
    """The preset's warm start if it exists on this machine (never built here), else None."""
    for path in (committed_dir() / f"{sft_key(cfg)}.pt" if committed_dir() else None, sft_path(cfg)):
        if path is not None and path.is_file():
            return torch.load(path, weights_only=True)["state_dict"]
    return None


def bench_trainer(preset: Path, sizes, device, rule="nsr", steps=5, warmup=2, overrides=()) -> tuple[list[dict], str]:
    """Rows {S, step_s, run_steps_per_s, runs_per_hour} of the batched trainer on ``device``, and the weights used."""
    device = torch.device(device)
    rows, source = [], "warm start"
    for S in sizes:
        cfgs = [load_config(preset, [*overrides, f"loss.rule={rule}", f"seed={s}"]) for s in range(S)]
        task = get_task(cfgs[0].task.name)
        state = _warm_state(cfgs[0])
        if state is None:
            source = "random init (no warm start cached or committed)"
        states = [state or build_model(c.model, generator(c.seed, "bench-init")).state_dict() for c in cfgs]
        model = BatchedGPT2(cfgs[0].model, states, device=device)
        tr = [c.train for c in cfgs]
        opt = BatchedAdamW(model, [t.lr for t in tr], [t.adam_betas for t in tr], [t.weight_decay for t in tr])
        times = []
        for step in range(1, warmup + steps + 1):
            _sync(device)
            t0 = time.perf_counter()
            out = batch_rl_step(model, opt, task, cfgs, step, list(range(S)))
            _sync(device)
            if step > warmup:
                times.append(time.perf_counter() - t0)
            if len(out) != S:
                raise RuntimeError(f"S={S}: {S - len(out)} run(s) failed at step {step}")
        step_s = statistics.median(times)
        rows.append(
            {
                "S": S,
                "step_s": step_s,
                "run_steps_per_s": S / step_s,
                "runs_per_hour": 3600 * S / (step_s * cfgs[0].train.steps),
                "train_steps": cfgs[0].train.steps,
                "times": times,
            }
        )
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, source


def bench_loss(device, B=512, T=8192, dtype="bfloat16", repeats=20) -> dict | str:
    """experiments.openrlhf.bench_gpu's table for every token-level rule, or why it was skipped."""
    try:
        from experiments.openrlhf.bench_gpu import bench
    except ImportError as e:
        return f"skipped: {e}"
    rules = tuple(r for r in nsr.RULES if "token" in nsr.RULES.info(r)["levels"])
    return bench(B, T, dtype, str(device), rules, repeats)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="python -m experiments.bench.gpu", description=__doc__, formatter_class=fmt)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke run)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64], help="batch sizes S (default 1 8 64)")
    p.add_argument("--rule", default="nsr", help="every run's loss.rule (default nsr)")
    p.add_argument("--steps", type=int, default=5, help="timed RL steps per size (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed RL steps first (default 2)")
    p.add_argument("--preset", type=Path, default=TINY_PRESET)
    p.add_argument("--B", type=int, default=512, help="loss part: responses (default 512)")
    p.add_argument("--T", type=int, default=8192, help="loss part: tokens per response (default 8192)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="loss part")
    p.add_argument("--repeats", type=int, default=20, help="loss part: timed rounds (default 20)")
    p.add_argument("--small", action="store_true", help="smoke size: S = 1 2, a 4 x 4 rollout, 1 step, a 4 x 64 loss")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--save", action="store_true", help="write results/bench_gpu/<date>-<device>.json (to commit)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; use --device cpu --small for a smoke run", file=sys.stderr)
        return 2
    if a.rule not in nsr.RULES:
        print(f"error: --rule {a.rule!r} is not valid; allowed: {', '.join(nsr.RULES)}", file=sys.stderr)
        return 2
    overrides = list(SMALL) if a.small else []
    sizes, steps, warmup = ([1, 2], 1, 1) if a.small else (a.sizes, a.steps, a.warmup)
    B, T, dtype, repeats = (4, 64, "float32", 2) if a.small else (a.B, a.T, a.dtype, a.repeats)
    t0 = time.perf_counter()
    rows, source = bench_trainer(a.preset, sizes, device, a.rule, steps, warmup, overrides)
    name = device_name(device)
    print(f"batched tiny trainer on {name}: {Path(a.preset).name} {' '.join(overrides)} rule {a.rule}; weights: "
          f"{source}; median of {steps} RL steps after {warmup}")  # fmt: skip
    print(f"{'S':>4}{'s / step':>12}{'run-steps / s':>16}{'runs / hour':>14}")
    for r in rows:
        print(f"{r['S']:>4}{r['step_s']:>12.3f}{r['run_steps_per_s']:>16.2f}{r['runs_per_hour']:>14.1f}")
    loss = bench_loss(device, B, T, dtype, repeats)
    if isinstance(loss, str):
        print(f"loss: {loss}")
    else:
        print(f"loss: {loss['B']} x {loss['T']} {loss['dtype']} on {loss['device']}, forward + backward")
        print(f"{'loss':<16}{'median ms':>12}{'x OpenRLHF':>12}")
        for r in loss["rows"]:
            print(f"{r['loss']:<16}{r['median_ms']:>12.3f}{r['ratio_to_openrlhf']:>12.2f}")
    result = {
        "date": date.today().isoformat(),
        "device": name,
        "torch": torch.__version__,
        "preset": str(a.preset),
        "overrides": overrides,
        "rule": a.rule,
        "weights": source,
        "trainer": rows,
        "loss": loss,
        "wall_s": time.perf_counter() - t0,
    }
    print(f"total {result['wall_s']:.0f} s")
    paths = [Path(a.json)] if a.json else []
    if a.save:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()
        paths.append(REPO_ROOT / "results" / "bench_gpu" / f"{result['date']}-{slug}.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
