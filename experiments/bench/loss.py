"""Benchmark: forward + backward of every nsr clip rule next to OpenRLHF 0.11.2's ``PolicyLoss``, and the cost of
``nsr`` against ``hard`` in a whole RL step of the CPU testbed.

Loss table (default). Each timed call is one training step's worth of loss work: ``nsr.policy_loss`` +
``nsr.aggregate`` + ``backward()`` (OpenRLHF: ``PolicyLoss.forward`` + ``backward()``), on one padded batch:

* response lengths spread uniformly over [T/8, T] (right padding; one full row);
* one advantage per response, of both signs, a quarter of them exactly 0 (all-correct / all-wrong groups),
  passed as a (B, T) tensor as OpenRLHF's trainer does;
* log-ratio ``logp - old ~ N(0, spread)``, spread chosen so that a few % (3-8) of the tokens are clipped at
  token level (default 0.15) and of the sequences at sequence level (default 0.015 per token); the table
  prints the clipped fraction that ``hard`` measured, so you can check.

Rules run with their defaults (token level: eps 0.2 / 0.28, delta 0.2; sequence level: GSPO eps and delta);
``noisy_decision`` and ``clean_decision`` with ratio_noise 0.1. All cases run in one process, in interleaved
rounds: every round calls each case once, in a fresh (seeded) random order, so load drift on a shared machine hits
all of them alike. Reported: the median and min time, the median's ratio to ``hard`` and to OpenRLHF, and
``saved MB``, the bytes autograd keeps from forward to backward (``saved_tensors_hooks``). The clock is the wall
clock; on a busy machine ``--threads 1 --clock cpu`` (this thread's CPU time) is steadier, as time spent preempted
is not counted.

Step table (``--tiny-step``): two runs of the tiny testbed (sweeps/presets/tiny.yaml, same seed and warm start),
one with ``hard`` and one with ``nsr`` (delta 0.2), advanced one RL step at a time in alternating order; each
step (rollout, advantages, old log-probs, 2 x 4 minibatch updates, metrics) is timed. Reported: median and min
per step and the ratio nsr / hard. The warm start is built first if it is not cached (cache/sft/).

Commands:
    python -m experiments.bench.loss                                  # B=64, T=4096, float32, torch's threads
    python -m experiments.bench.loss --threads 1 --clock cpu          # steadier on a busy machine
    python -m experiments.bench.loss --level sequence                 # the GSPO variants
    python -m experiments.bench.loss --verl --threads 1 --clock cpu   # + verl's clip_cov / kl_cov next to ours
    python -m experiments.bench.loss --tiny-step --steps 120 --threads 1 --clock cpu   # RL step, nsr vs hard
    python -m experiments.bench.loss --premise --threads 1 --clock cpu   # + nsr with the premise meter (nsr+premise)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import nsr
from nsr.openrlhf.mapping import LOSS_TYPE
from nsr.openrlhf.reference import load_loss_module

DEFAULT_SPREAD = {"token": 0.15, "sequence": 0.015}
RATIO_NOISE = 0.1
TARGET_VS_OPENRLHF = 2.0
"""Every rule's median at most this many times PolicyLoss's (issue: plain rules, speed that matters)."""
TARGET_VS_VERL = 1.2
"""Clip-Cov and KL-Cov: median at most this many times verl 0.9.1's own clip_cov / kl_cov (``--verl``)."""
VERL_RULES = ("clip_cov", "kl_cov")
TARGET_STEP = 1.03
"""nsr's median RL step at most this many times hard's on the tiny testbed."""
TINY_PRESET = Path(__file__).resolve().parents[1] / "sweeps" / "presets" / "tiny.yaml"
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


@dataclass
class Case:
    name: str
    step: Callable[[torch.Tensor], dict]
    """Runs forward + aggregate + backward on the leaf ``log_probs``; returns the metrics dict (may be empty)."""


def make_inputs(B: int, T: int, dtype: torch.dtype, spread: float, seed: int = 0):
    """A padded batch: log_probs (B, T) leaf with grad, old_log_probs (B, T), advantages (B, T), mask (B, T) bool."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype).mul_(3.0)
    logp = (old + torch.randn(B, T, generator=g, dtype=dtype) * spread).requires_grad_()
    lens = torch.randint(max(T // 8, 1), T + 1, (B,), generator=g)
    lens[0] = T
    mask = torch.arange(T)[None, :] < lens[:, None]
    adv = torch.randn(B, generator=g, dtype=dtype)
    adv[torch.arange(B) % 4 == 1] = 0.0
    adv = adv[:, None].expand(B, T).contiguous()
    return logp, old, adv, mask


def rule_config(rule: str, level: str) -> nsr.LossConfig:
    return nsr.LossConfig(rule=rule, level=level, ratio_noise=RATIO_NOISE if "decision" in rule else 0.0)


def verl_cases(old, adv, mask) -> list[Case]:
    """verl 0.9.1's own ``clip_cov`` and ``kl_cov`` policy losses (verl.trainer.ppo.core_algos) + backward, with the
    parameters of our rules' defaults (eps 0.2 / 0.28, clip_cov_frac / kl_cov_frac, bounds, coefficient)."""
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    d = nsr.LossConfig(rule="hard")
    extra = {
        "clip_cov": dict(clip_cov_ratio=d.clip_cov_frac, clip_cov_lb=d.clip_cov_lb, clip_cov_ub=d.clip_cov_ub),
        "kl_cov": dict(kl_cov_ratio=d.kl_cov_frac, ppo_kl_coef=d.kl_cov_coef),
    }
    cases = []
    for mode in VERL_RULES:
        cfg = ActorConfig(
            strategy="fsdp",
            rollout_n=1,
            ppo_micro_batch_size_per_gpu=1,
            clip_ratio_low=d.eps_low,
            clip_ratio_high=d.eps_high,
            policy_loss=PolicyLossConfig(loss_mode=mode, **extra[mode]),
        )

        cases.append(Case(f"verl:{mode}", _verl_step(core_algos.get_policy_loss_fn(mode), cfg, old, adv, mask)))
    return cases


def _verl_step(fn, cfg, old, adv, mask):
    def step(logp):
        loss, _ = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, config=cfg)
        loss.backward()
        return {}

    return step


def build_cases(old, adv, mask, level: str, seed: int = 0) -> list[Case]:
    """One case for OpenRLHF's PolicyLoss, then one per registered rule."""
    orl = load_loss_module()
    hard = nsr.LossConfig(rule="hard", level=level)
    ref = orl.PolicyLoss(
        clip_eps_low=hard.eps_low,
        clip_eps_high=hard.eps_high,
        token_level_loss=level == "token",
        policy_loss_type=LOSS_TYPE[level],
    )
    mode = "token-mean" if level == "token" else "seq-mean-token-mean"

    def openrlhf_step(logp):
        loss, clip_ratio, ppo_kl, _, _ = ref(logp, old, adv, action_mask=mask)
        loss.backward()
        return {"clip_frac": clip_ratio}

    def rule_step(cfg):
        gen = torch.Generator().manual_seed(seed)

        def step(logp):
            loss_tok, metrics = nsr.policy_loss(logp, old, adv, mask, cfg, generator=gen)
            nsr.aggregate(loss_tok, mask, mode).backward()
            return metrics

        return step

    cases = [Case("openrlhf", openrlhf_step)]
    rules = [r for r in nsr.RULES if level in nsr.RULES.info(r)["levels"]]  # the rules defined at this level
    cases += [Case(rule, rule_step(rule_config(rule, level))) for rule in rules]
    return cases


def premise_case(old, adv, mask, seed: int = 0) -> Case:
    """``nsr`` (token level) with the premise meter on: the rule's step plus ``nsr.PremiseMeter.add`` (its autograd
    gradient through the loss and its counts), as a trainer runs it on every update."""
    cfg = rule_config("nsr", "token")
    gen = torch.Generator().manual_seed(seed)
    meter = nsr.PremiseMeter(cfg)

    def step(logp):
        loss_tok, metrics = nsr.policy_loss(logp, old, adv, mask, cfg, generator=gen)
        meter.add(loss_tok, logp, adv, mask, old_log_probs=old)
        nsr.aggregate(loss_tok, mask, "token-mean").backward()
        return metrics

    return Case("nsr+premise", step)


def time_cases(
    cases: list[Case], logp: torch.Tensor, repeats: int, warmup: int, clock: str = "wall", seed: int = 0
) -> dict[str, list[float]]:
    """Interleaved rounds, each in a fresh seeded random order; returns the per-call times in ms of each case
    (warm-up rounds dropped)."""
    now = CLOCKS[clock]
    times: dict[str, list[float]] = {c.name: [] for c in cases}
    rng = random.Random(seed)
    for rep in range(warmup + repeats):
        for case in rng.sample(cases, len(cases)):
            logp.grad = None
            t0 = now()
            case.step(logp)
            dt = now() - t0
            if rep >= warmup:
                times[case.name].append(dt * 1e3)
    return times


def saved_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn`` runs (each storage counted once)."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def measure(args) -> dict:
    load_before = _load()
    dtype = getattr(torch, args.dtype)
    spread = DEFAULT_SPREAD[args.level] if args.spread is None else args.spread
    logp, old, adv, mask = make_inputs(args.B, args.T, dtype, spread, seed=args.seed)
    cases = build_cases(old, adv, mask, args.level, seed=args.seed)
    if args.verl:
        cases += verl_cases(old, adv, mask)
    if args.premise:
        cases.append(premise_case(old, adv, mask, seed=args.seed))
    times = time_cases(cases, logp, args.repeats, args.warmup, args.clock, seed=args.seed)
    rows = []
    for case in cases:
        logp.grad = None
        metrics = case.step(logp)
        logp.grad = None
        saved = saved_bytes(lambda c=case: c.step(logp))
        rows.append(
            {
                "name": case.name,
                "median_ms": statistics.median(times[case.name]),
                "min_ms": min(times[case.name]),
                "saved_mb": saved / 2**20,
                **{k: float(metrics[k]) for k in ("clip_frac", "rescue_frac", "pushout_frac") if k in metrics},
            }
        )
    base = {r["name"]: r["median_ms"] for r in rows}
    for r in rows:
        r["vs_hard"] = r["median_ms"] / base["hard"]
        r["vs_openrlhf"] = r["median_ms"] / base["openrlhf"]
    setup = {
        "B": args.B,
        "T": args.T,
        "dtype": args.dtype,
        "level": args.level,
        "spread": spread,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "clock": args.clock,
        "threads": torch.get_num_threads(),
        "valid_frac": int(mask.sum()) / mask.numel(),
        "torch": torch.__version__,
        "load_avg": [load_before, _load()],
    }
    return {"setup": setup, "rows": rows}


def format_table(result: dict) -> str:
    s = result["setup"]
    hard = next(r for r in result["rows"] if r["name"] == "hard")
    unit = "tokens" if s["level"] == "token" else "sequences"
    rules = [r for r in result["rows"] if r["name"] in nsr.RULES]
    worst = max(rules, key=lambda r: r["vs_openrlhf"])
    lines = [
        f"B={s['B']} T={s['T']} {s['dtype']} level={s['level']} threads={s['threads']} torch {s['torch']}; "
        f"{s['valid_frac']:.0%} of (B, T) valid; {s['clock']} clock, median of {s['repeats']} interleaved rounds; "
        f"clipped by hard: {hard['clip_frac']:.1%} of valid {unit}; load average (1/5/15 min) "
        f"{s['load_avg'][0]} -> {s['load_avg'][1]} on {os.cpu_count()} cores",
        "",
        "| case | median ms | min ms | x hard | x OpenRLHF | saved MB | clip % | rescue % | pushout % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pct = lambda r, k: f"{100 * r[k]:.2f}" if k in r else "-"  # noqa: E731
    for r in result["rows"]:
        lines.append(
            f"| {r['name']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['vs_hard']:.2f} | {r['vs_openrlhf']:.2f} | "
            f"{r['saved_mb']:.1f} | {pct(r, 'clip_frac')} | {pct(r, 'rescue_frac')} | {pct(r, 'pushout_frac')} |"
        )
    verdict = "met" if worst["vs_openrlhf"] <= TARGET_VS_OPENRLHF else "MISSED"
    lines += ["", f"slowest rule: {worst['name']} {worst['vs_openrlhf']:.2f}x OpenRLHF (target <= "
              f"{TARGET_VS_OPENRLHF:g}x: {verdict})"]  # fmt: skip
    ms = {r["name"]: r["median_ms"] for r in result["rows"]}
    for rule in VERL_RULES:
        if f"verl:{rule}" in ms and rule in ms:
            x = ms[rule] / ms[f"verl:{rule}"]
            verdict = "met" if x <= TARGET_VS_VERL else "MISSED"
            lines.append(f"{rule}: {x:.2f}x verl's {rule} (target <= {TARGET_VS_VERL:g}x: {verdict})")
    return "\n".join(lines)


# ------------------------------------------------------------------ RL step of the tiny testbed
def measure_tiny_step(args) -> dict:
    """Alternating RL steps of a hard run and an nsr run from the same warm start and seed; per-step times."""
    from experiments.config import load_config
    from experiments.sft import warm_policy
    from experiments.tasks.countdown import get_task
    from experiments.tiny.train import rl_step

    load_before = _load()
    now = CLOCKS[args.clock]
    runs = {}
    for rule in ("hard", "nsr"):
        overrides = [*args.set, f"loss.rule={rule}", f"seed={args.seed}", "logging.progress=false"]
        cfg = load_config(args.preset, overrides)
        model = warm_policy(cfg)
        tr = cfg.train
        opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=tr.adam_betas, weight_decay=tr.weight_decay)
        runs[rule] = (cfg, model, opt, get_task(cfg.task.name))
    times: dict[str, list[float]] = {rule: [] for rule in runs}
    clip: dict[str, list[float]] = {rule: [] for rule in runs}
    rescue: list[float] = []
    for step in range(1, args.warmup_steps + args.steps + 1):
        order = ("hard", "nsr") if step % 2 else ("nsr", "hard")
        for rule in order:
            cfg, model, opt, task = runs[rule]
            t0 = now()
            row, _ = rl_step(model, opt, task, cfg, step)
            dt = now() - t0
            if step > args.warmup_steps:
                times[rule].append(dt * 1e3)
                clip[rule].append(row["clip_frac"])
                if rule == "nsr":
                    rescue.append(row["rescue_frac"])
    med = {rule: statistics.median(t) for rule, t in times.items()}
    setup = {
        "preset": str(args.preset),
        "overrides": list(args.set),
        "seed": args.seed,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "clock": args.clock,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_avg": [load_before, _load()],
    }
    rows = [
        {
            "name": rule,
            "median_ms": med[rule],
            "min_ms": min(times[rule]),
            "vs_hard": med[rule] / med["hard"],
            "clip_frac": statistics.fmean(clip[rule]),
            **({"rescue_frac": statistics.fmean(rescue)} if rule == "nsr" else {}),
        }
        for rule in runs
    ]
    return {"setup": setup, "rows": rows}


def format_step_table(result: dict) -> str:
    s = result["setup"]
    nsr_row = next(r for r in result["rows"] if r["name"] == "nsr")
    lines = [
        f"tiny testbed RL step ({Path(s['preset']).name}, seed {s['seed']}): median of {s['steps']} steps per rule "
        f"after {s['warmup_steps']} warm-up steps, alternating; threads={s['threads']}, {s['clock']} clock, torch "
        f"{s['torch']}; load average (1/5/15 min) {s['load_avg'][0]} -> {s['load_avg'][1]} on {os.cpu_count()} cores",
        "",
        "| rule | median ms / step | min ms | x hard | clip % (mean) | rescue % (mean) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        rescue = f"{100 * r['rescue_frac']:.2f}" if "rescue_frac" in r else "-"
        lines.append(
            f"| {r['name']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['vs_hard']:.3f} | "
            f"{100 * r['clip_frac']:.2f} | {rescue} |"
        )
    verdict = "met" if nsr_row["vs_hard"] <= TARGET_STEP else "MISSED"
    lines += ["", f"nsr / hard per RL step: {nsr_row['vs_hard']:.3f} (target <= {TARGET_STEP}: {verdict})"]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--B", type=int, default=64, help="responses per batch (default 64)")
    p.add_argument("--T", type=int, default=4096, help="padded response length (default 4096)")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    p.add_argument("--level", choices=("token", "sequence"), default="token")
    p.add_argument("--repeats", type=int, default=100, help="timed rounds (default 100)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall (default) or cpu: this thread's CPU time, which a busy shared machine inflates less "
        "(preemption is not counted); needs --threads 1",
    )
    p.add_argument("--spread", type=float, default=None, help="std of the per-token log-ratio (default by level)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny-step", action="store_true", help="time RL steps of the tiny testbed, nsr vs hard")
    p.add_argument(
        "--verl",
        action="store_true",
        help="also time verl 0.9.1's own clip_cov and kl_cov losses (token level; verl installed) and print our "
        "Clip-Cov / KL-Cov against them",
    )
    p.add_argument(
        "--premise", action="store_true", help="also time nsr with the premise meter on (nsr.PremiseMeter; token level)"
    )
    p.add_argument("--steps", type=int, default=120, help="--tiny-step: timed steps per rule (default 120)")
    p.add_argument("--warmup-steps", type=int, default=3, help="--tiny-step: untimed steps first (default 3)")
    p.add_argument("--preset", default=str(TINY_PRESET), help="--tiny-step: the run config (default tiny.yaml)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="--tiny-step: a config override (repeatable)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the setup and rows as JSON")
    args = p.parse_args(argv)
    for name in ("B", "T", "repeats", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup", "warmup_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu counts this thread only, so it needs --threads 1")
    if args.premise and args.level != "token":
        p.error("--premise meters token-level ratios; it needs --level token")
    if args.verl and args.level != "token":
        p.error("--verl compares the token-level Clip-Cov and KL-Cov; it needs --level token")
    if args.tiny_step and not Path(args.preset).is_file():
        p.error(f"--preset {args.preset!r} is not a file")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        result = measure_tiny_step(args) if args.tiny_step else measure(args)
    finally:
        torch.set_num_threads(threads)
    print(format_step_table(result) if args.tiny_step else format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
