"""Benchmark: forward + backward of every nsr clip rule, side by side with OpenRLHF 0.11.2's ``PolicyLoss``.

Each timed call is one training-step's worth of loss work: ``nsr.policy_loss`` + ``nsr.aggregate`` +
``backward()`` (OpenRLHF: ``PolicyLoss.forward`` + ``backward()``), on one realistic padded batch:

* response lengths spread uniformly over [T/8, T] (right padding; one full row);
* one advantage per response, of both signs, a quarter of them exactly 0 (all-correct / all-wrong groups),
  passed as a (B, T) tensor as OpenRLHF's trainer does;
* log-ratio ``logp - old ~ N(0, spread)``, spread chosen so that a few % (3-8) of the tokens are clipped at
  token level (default 0.15) and of the sequences at sequence level (default 0.015 per token); the table
  prints the clipped fraction that ``hard`` measured, so you can check.

Rules run with their defaults (token level: eps 0.2 / 0.28, delta 0.2; sequence level: GSPO eps and delta);
``noisy_decision`` and ``clean_decision`` with ratio_noise 0.1. All cases run in one process, in interleaved
rounds: every repeat calls each case once, in a fresh (seeded) random order, so load drift on a shared machine
and the cache state left by the previous call hit all of them alike. Reported: the median and min time, the
median's ratio to ``hard`` and to OpenRLHF, and the min's ratio to hard's min. The clock is the wall clock;
on a busy shared machine ``--threads 1 --clock cpu`` (this thread's CPU time) is steadier, as time spent
preempted is not counted, while the wall clock bills it to whichever case it hits, longer ones more often.
``--keep-heap`` asks glibc to keep freed memory in the process: by default it hands the MB-sized temporaries
back to the OS after each call and page-faults them in again on the next (zeroed by the kernel), a cost that
depends on each case's allocation pattern and, on the 2-core test machine, made most of the run-to-run noise.

Memory, measured in one extra, untimed call per case:

* ``peak MB``: the peak of bytes allocated and not yet freed during forward + backward, above the level at
  its start. It is read from the allocation events of ``torch.profiler`` (``profile_memory=True``), which
  records every allocation and free of torch's CPU allocator with its size; a running sum of those sizes,
  in time order, gives the live bytes, and its maximum is the peak (the (B, T) gradient of ``log_probs``
  is included, for every case alike).
* ``saved MB``: bytes of the tensors autograd keeps from forward to backward (``saved_tensors_hooks``).

Commands:
    python -m experiments.bench_loss                                  # B=64, T=4096, float32, torch's threads
    python -m experiments.bench_loss --threads 1 --clock cpu --keep-heap  # steadier on a busy machine
    python -m experiments.bench_loss --level sequence                 # the GSPO variants
    python -m experiments.bench_loss --repeats 200 --threads 2 --json bench.json
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

import torch

import nsr
from nsr.openrlhf.reference import load_loss_module

DEFAULT_SPREAD = {"token": 0.15, "sequence": 0.015}
RATIO_NOISE = 0.1


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


def build_cases(old, adv, mask, level: str, seed: int = 0) -> list[Case]:
    """One case for OpenRLHF's PolicyLoss, then one per registered rule."""
    orl = load_loss_module()
    hard = nsr.LossConfig(rule="hard", level=level)
    ref = orl.PolicyLoss(
        clip_eps_low=hard.eps_low,
        clip_eps_high=hard.eps_high,
        token_level_loss=level == "token",
        policy_loss_type="ppo" if level == "token" else "gspo",
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
    cases += [Case(rule, rule_step(rule_config(rule, level))) for rule in nsr.RULES]
    return cases


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


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


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of live bytes allocated inside ``fn`` (CPU allocator events of torch.profiler), above the start."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            sizes.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return peak


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


def keep_heap() -> None:
    """glibc ``mallopt``: serve allocations up to 32 MB from the heap and never trim it (see the module doc)."""
    import ctypes
    import ctypes.util

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        raise RuntimeError("--keep-heap needs glibc's mallopt, not found in this C library") from None
    if not (mallopt(M_MMAP_THRESHOLD, 32 << 20) and mallopt(M_TRIM_THRESHOLD, 1 << 30)):
        raise RuntimeError("--keep-heap: glibc mallopt refused the thresholds")


def measure(args) -> dict:
    load_before = os.getloadavg()[0]
    dtype = getattr(torch, args.dtype)
    spread = DEFAULT_SPREAD[args.level] if args.spread is None else args.spread
    logp, old, adv, mask = make_inputs(args.B, args.T, dtype, spread, seed=args.seed)
    cases = build_cases(old, adv, mask, args.level, seed=args.seed)
    times = time_cases(cases, logp, args.repeats, args.warmup, args.clock, seed=args.seed)
    rows = []
    for case in cases:
        logp.grad = None
        metrics = case.step(logp)
        logp.grad = None
        peak = peak_bytes(lambda c=case: c.step(logp))
        logp.grad = None
        saved = saved_bytes(lambda c=case: c.step(logp))
        rows.append(
            {
                "name": case.name,
                "median_ms": statistics.median(times[case.name]),
                "min_ms": min(times[case.name]),
                "peak_mb": peak / 2**20,
                "saved_mb": saved / 2**20,
                **{k: float(metrics[k]) for k in ("clip_frac", "rescue_frac", "pushout_frac") if k in metrics},
            }
        )
    base = {r["name"]: r["median_ms"] for r in rows}
    best = {r["name"]: r["min_ms"] for r in rows}
    for r in rows:
        r["vs_hard"] = r["median_ms"] / base["hard"]
        r["vs_openrlhf"] = r["median_ms"] / base["openrlhf"]
        r["vs_hard_min"] = r["min_ms"] / best["hard"]
    n_valid = int(mask.sum())
    setup = {
        "B": args.B,
        "T": args.T,
        "dtype": args.dtype,
        "level": args.level,
        "spread": spread,
        "repeats": args.repeats,
        "clock": args.clock,
        "keep_heap": args.keep_heap,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "valid_frac": n_valid / mask.numel(),
        "torch": torch.__version__,
        "load_avg_1min": [load_before, os.getloadavg()[0]],
    }
    return {"setup": setup, "rows": rows}


def format_table(result: dict) -> str:
    s = result["setup"]
    hard = next(r for r in result["rows"] if r["name"] == "hard")
    unit = "tokens" if s["level"] == "token" else "sequences"
    lines = [
        f"B={s['B']} T={s['T']} {s['dtype']} level={s['level']} threads={s['threads']} torch {s['torch']}; "
        f"{s['valid_frac']:.0%} of (B, T) valid; {s['clock']} clock{', kept heap' if s['keep_heap'] else ''}, "
        f"median of {s['repeats']} interleaved repeats; "
        f"clipped by hard: {hard['clip_frac']:.1%} of valid {unit}; load average "
        f"{s['load_avg_1min'][0]:.2f} -> {s['load_avg_1min'][1]:.2f} on {os.cpu_count()} cores",
        "",
        "| case | median ms | min ms | x hard | x OpenRLHF | x hard (min) | peak MB | saved MB | clip % | rescue % "
        "| pushout % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pct = lambda r, k: f"{100 * r[k]:.2f}" if k in r else "-"  # noqa: E731
    for r in result["rows"]:
        lines.append(
            f"| {r['name']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['vs_hard']:.2f} | {r['vs_openrlhf']:.2f} | "
            f"{r['vs_hard_min']:.2f} | "
            f"{r['peak_mb']:.1f} | {r['saved_mb']:.1f} | {pct(r, 'clip_frac')} | {pct(r, 'rescue_frac')} | "
            f"{pct(r, 'pushout_frac')} |"
        )
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
    p.add_argument("--keep-heap", action="store_true", help="glibc: keep freed memory (no page faults per call)")
    p.add_argument("--spread", type=float, default=None, help="std of the per-token log-ratio (default by level)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the setup and rows as JSON")
    args = p.parse_args(argv)
    for name in ("B", "T", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu counts this thread only, so it needs --threads 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.keep_heap:
        keep_heap()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        result = measure(args)
    finally:
        torch.set_num_threads(threads)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
