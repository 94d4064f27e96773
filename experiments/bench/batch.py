"""Benchmark: runs per core-hour of the batched tiny trainer against today's single-run trainer, whole processes.

    NSR_THREADS=1 python -m experiments.bench.batch                       # tiny preset, S = 1 2 4 8 16, 3 rounds
    NSR_THREADS=1 python -m experiments.bench.batch --steps 100 --sizes 1 8 --repeats 2 --json out.json

Each measurement is one whole ``python -m experiments.run`` process with the preset (default sweeps/presets/tiny.yaml)
and ``train.steps`` (default: the preset's): ``seed=0`` for the single-run trainer, ``--seeds 0-(S-1)`` for a batch of
S. Its cost is the CPU time the process used (user + sys, ``getrusage`` of the child: core-seconds, which a busy shared
machine inflates far less than the wall clock), process start, imports, warm-start load, evals and writes included.
Rounds run every case once, in a fresh seeded random order, so load drift hits all alike; the table gives medians over
rounds: CPU seconds per process and per run, runs per core-hour, and the ratio to the single-run trainer. The warm start
is built (or found) before the first round and never timed. ``NSR_THREADS`` (default 1) is passed to every process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY_PRESET = Path(__file__).resolve().parents[1] / "sweeps" / "presets" / "tiny.yaml"
TARGET_AT_8 = 4.0
"""Issue 25: a batch of 8 trains at least this many times the runs per core-hour of the single-run trainer."""


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_case(preset: Path, overrides: list[str], size: int | None, out: Path, env: dict) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one whole run process: the single-run trainer if ``size`` is None, else a batch
    of seeds 0 .. size - 1."""
    cmd = [sys.executable, "-m", "experiments.run", str(preset), *overrides, "--out", str(out), "--no-progress"]
    cmd += ["seed=0"] if size is None else ["--seeds", f"0-{size - 1}"]
    cpu, wall = _child_cpu(), time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    cpu, wall = _child_cpu() - cpu, time.perf_counter() - wall
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return cpu, wall


def measure(args) -> dict:
    env = {**os.environ, "NSR_THREADS": os.environ.get("NSR_THREADS", "1")}
    overrides = [*args.set, *([f"train.steps={args.steps}"] if args.steps else []), "logging.progress=false"]
    subprocess.run(
        [sys.executable, "-m", "experiments.sft", str(args.preset), *overrides],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    cases: list[int | None] = [None, *args.sizes]
    cpu: dict = {c: [] for c in cases}
    wall: dict = {c: [] for c in cases}
    rng = random.Random(args.seed)
    load = [round(v, 2) for v in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="nsr-bench-batch-") as tmp:
        for _ in range(args.repeats):
            for case in rng.sample(cases, len(cases)):
                out = Path(tmp) / f"case-{case}"
                c, w = run_case(args.preset, overrides, case, out, env)
                shutil.rmtree(out, ignore_errors=True)
                cpu[case].append(c)
                wall[case].append(w)
    base = statistics.median(cpu[None])
    rows = []
    for case in cases:
        runs = 1 if case is None else case
        med = statistics.median(cpu[case])
        rows.append(
            {
                "trainer": "single" if case is None else f"batched S={case}",
                "runs": runs,
                "cpu_s": med,
                "cpu_s_per_run": med / runs,
                "wall_s": statistics.median(wall[case]),
                "runs_per_core_hour": 3600 * runs / med,
                "vs_single": base * runs / med,
                "cpu_all": cpu[case],
            }
        )
    setup = {
        "preset": str(args.preset),
        "overrides": overrides,
        "repeats": args.repeats,
        "threads": env["NSR_THREADS"],
        "cpus": os.cpu_count(),
        "load_avg": [load, [round(v, 2) for v in os.getloadavg()]],
        "python": sys.version.split()[0],
    }
    return {"setup": setup, "rows": rows}


def format_table(result: dict) -> str:
    s = result["setup"]
    lines = [
        f"{Path(s['preset']).name} {' '.join(s['overrides'])}; whole processes, NSR_THREADS={s['threads']}, median of "
        f"{s['repeats']} interleaved rounds; CPU = user + sys of the process; load average (1/5/15 min) "
        f"{s['load_avg'][0]} -> {s['load_avg'][1]} on {s['cpus']} cores",
        "",
        "| trainer | runs | CPU s | CPU s / run | wall s | runs / core-hour | x single |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['trainer']} | {r['runs']} | {r['cpu_s']:.1f} | {r['cpu_s_per_run']:.1f} | {r['wall_s']:.1f} | "
            f"{r['runs_per_core_hour']:.1f} | {r['vs_single']:.2f} |"
        )
    at8 = next((r for r in result["rows"] if r["trainer"] == "batched S=8"), None)
    if at8 is not None:
        verdict = "met" if at8["vs_single"] >= TARGET_AT_8 else "MISSED"
        lines += ["", f"S = 8: {at8['vs_single']:.2f}x the single-run trainer's runs per core-hour (target >= "
                      f"{TARGET_AT_8:g}x: {verdict})"]  # fmt: skip
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", type=Path, default=TINY_PRESET, help="the run config (default sweeps/presets/tiny.yaml)")
    p.add_argument("--steps", type=int, default=None, help="train.steps for every process (default: the preset's)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="batch sizes S (default 1 2 4 8 16)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the rounds' order")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the setup and rows as JSON")
    args = p.parse_args(argv)
    if not args.preset.is_file():
        p.error(f"--preset {args.preset} is not a file")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.repeats < 1 or any(s < 1 for s in args.sizes):
        p.error("--repeats and every --sizes value must be >= 1")
    if any(kv.split("=", 1)[0].strip() in ("seed", "train.steps") for kv in args.set):
        p.error("--set seed=... / train.steps=...: the benchmark sets these (use --steps)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = measure(args)
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
