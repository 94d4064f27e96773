"""Benchmark of ``python -m analysis.make_all`` (was analysis/bench.py): the whole rebuild, cold, on a grid of
synthetic run folders.

    python -m devtools.bench_make_all        # 100 runs x 1,000 steps (5 sweeps x 5 arms x 4 seeds), 3 repeats
    python -m devtools.bench_make_all --steps 400 --repeats 5 --dir /tmp/nsr-bench

Each run has the tiny preset's eval: 512 prompts x (8 sampled + greedy) every 100 steps, i.e. 50k labels per run
and 5M in the grid (devtools.synthetic_runs writes them once and reuses them while the grid size is unchanged).
Each repeat is a fresh ``python -m analysis.make_all --runs DIR --out DIR --no-readme --no-cache`` process (imports
included, every run parsed); ``--warm`` times it with the parsed-log cache instead (in DIR/cache, filled by an
untimed first run), as a rerun on unchanged runs is. The median wall-clock and CPU seconds are printed. Target: at
most 30 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devtools.synthetic_runs import add_grid_args, benchmark_grid
from experiments.rundir import CACHE_ENV, REPO_ROOT


def ensure_grid(folder: Path, params: dict) -> int:
    """Write the synthetic grid under ``folder/runs`` unless the one there was made with the same params."""
    marker = folder / "grid.json"
    if marker.exists() and json.loads(marker.read_text()) == params:
        return sum(1 for _ in (folder / "runs").glob("*/*/status.json"))
    shutil.rmtree(folder / "runs", ignore_errors=True)
    n = benchmark_grid(folder / "runs", **params)
    marker.write_text(json.dumps(params))
    return n


def time_make_all(folder: Path, warm: bool = False) -> tuple[float, float]:
    """(wall s, CPU s of the child and its workers) of one make_all process: cold (no cache), or ``warm`` (the
    parsed-log cache in ``folder/cache``)."""
    cmd = [sys.executable, "-m", "analysis.make_all", "--runs", str(folder / "runs"), "--out", str(folder / "out")]
    cmd += ["--no-readme"] if warm else ["--no-readme", "--no-cache"]
    env = {**os.environ, CACHE_ENV: str(folder / "cache")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.bench_make_all", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "nsr-analysis-bench")
    add_grid_args(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm", action="store_true", help="time reruns that find every run in the parsed-log cache")
    a = p.parse_args(argv)
    params = {"sweeps": a.sweeps, "arms": a.arms, "seeds": a.seeds, "steps": a.steps, "every": a.every}
    params["n_prompts"] = a.prompts
    a.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n = ensure_grid(a.dir, params)
    print(f"grid: {n} runs x {a.steps} steps under {a.dir / 'runs'} (ready in {time.perf_counter() - t0:.1f} s)")
    if a.warm:
        time_make_all(a.dir, warm=True)  # fills the cache; not timed
    times = [time_make_all(a.dir, a.warm) for _ in range(a.repeats)]
    for i, (wall, cpu) in enumerate(times):
        print(f"  repeat {i + 1}: wall {wall:.1f} s, cpu {cpu:.1f} s")
    wall = statistics.median(t[0] for t in times)
    cpu = statistics.median(t[1] for t in times)
    kind = "warm (cached logs)" if a.warm else "cold"
    print(f"make_all {kind}, {n} runs x {a.steps} steps: median wall {wall:.1f} s, median cpu {cpu:.1f} s "
          "(target <= 30 s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
