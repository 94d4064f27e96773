"""Time NSRPolicyLoss against OpenRLHF 0.11.2's PolicyLoss, forward + backward, at cluster size on a GPU.

    python -m experiments.openrlhf.bench_gpu                                  # 512 x 8192 tokens, bf16, CUDA
    python -m experiments.openrlhf.bench_gpu --rules hard nsr soft pushout --repeats 50 --json out.json
    python -m experiments.openrlhf.bench_gpu --device cpu --B 4 --T 64 --dtype float32 --repeats 3   # smoke run

Inputs as in training: a padded (B, T) mask (response lengths spread over [T/8, T]), one advantage per response
(both signs and zeros), log-ratios spread so a few % of tokens are clipped. Each repeat runs every loss once in
turn (interleaved, so clock drift hits all alike); CUDA events time each call; the table gives the median ms and the
ratio to OpenRLHF's PolicyLoss. ``hard`` is NSRPolicyLoss delegating to PolicyLoss plus the nsr_* metrics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from nsr.openrlhf.loss import NSRPolicyLoss, PolicyLoss
from nsr.openrlhf.settings import NSRSettings


def make_inputs(B: int, T: int, dtype, device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    old = torch.randn(B, T, generator=g) * 0.5 - 2.0
    logp = old + torch.randn(B, T, generator=g) * 0.12
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    adv[: B // 8] = 0.0
    lens = torch.randint(T // 8, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    to = dict(device=device)
    return logp.to(dtype=dtype, **to), old.to(dtype=dtype, **to), adv.to(**to), mask.to(**to)


def _timer(device):
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def run(fn):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)

        return run

    def run_cpu(fn):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return run_cpu


def bench(B=512, T=8192, dtype="bfloat16", device="cuda", rules=("hard", "nsr", "soft"), repeats=20, warmup=3):
    device = torch.device(device)
    dt = getattr(torch, dtype)
    logp, old, adv, mask = make_inputs(B, T, dt, device)
    n_tok = float(mask.sum())
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.28)
    losses = {"openrlhf": PolicyLoss(**kw)}
    for r in rules:
        fn = NSRPolicyLoss(**kw, settings=NSRSettings.make(rule=r, ratio_noise=0.1 if r.endswith("_decision") else 0.0))
        fn.sink = {}
        losses[r] = fn

    def step(fn):
        lp = logp.detach().requires_grad_()
        loss = fn(lp, old, adv, action_mask=mask, dp_size=1, batch_num_tokens=n_tok)[0]
        loss.backward()

    timer = _timer(device)
    times = {k: [] for k in losses}
    for i in range(warmup + repeats):
        for k, fn in losses.items():
            ms = timer(lambda fn=fn: step(fn))
            if i >= warmup:
                times[k].append(ms)
    base = statistics.median(times["openrlhf"])
    # every NSRPolicyLoss logs the same clip fraction (the region does not depend on the rule)
    clip = next((fn.sink["nsr_clip_frac"] for k, fn in losses.items() if k != "openrlhf" and fn.sink), None)
    rows = [
        {"loss": k, "median_ms": statistics.median(v), "ratio_to_openrlhf": statistics.median(v) / base}
        for k, v in times.items()
    ]
    return {
        "B": B,
        "T": T,
        "dtype": dtype,
        "device": str(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu",
        "repeats": repeats,
        "clip_frac": None if clip is None else float(clip),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.openrlhf.bench_gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--B", type=int, default=512)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--rules", nargs="+", default=["hard", "nsr", "soft"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="also write the result here")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device here; use --device cpu for a smoke run", file=sys.stderr)
        return 2
    res = bench(a.B, a.T, a.dtype, a.device, tuple(a.rules), a.repeats)
    clipped = "n/a" if res["clip_frac"] is None else f"{res['clip_frac']:.3%}"
    print(f"{res['B']} x {res['T']} {res['dtype']} on {res['device']}, clipped {clipped} of tokens")
    print(f"{'loss':<16}{'median ms':>12}{'x OpenRLHF':>12}")
    for r in res["rows"]:
        print(f"{r['loss']:<16}{r['median_ms']:>12.3f}{r['ratio_to_openrlhf']:>12.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
