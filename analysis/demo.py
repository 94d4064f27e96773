"""The demo: hard clipping vs NSR (delta 0.2) on the CPU testbed, one seed, 300 RL steps, and its figure.

    make demo                          # builds .venv, runs both arms, writes results/figures/demo_dynamics.png
    python -m analysis.demo            # the same, in an existing environment (about 2 minutes on 2 cores)
    python -m analysis.demo --plot-only
    python -m analysis.demo --jobs 1   # the arms one after the other, NSR_THREADS (default 1) threads each

Both runs use ``sweeps/presets/tiny.yaml`` with ``train.steps=300`` and ``eval.every=50``, and go to
``results/runs/demo/<arm>-<run hash>/`` (the normal run-folder contract, so ``analysis`` reads them like any
other; ``make_all`` never tables sweep ``demo``). A finished run is reused, an interrupted one resumes. The
figure shows, against the RL step: the training reward (10-step mean) with the held-out sampled accuracy and
pass@8, the policy entropy, the fraction of tokens the clip drops (by side), and the fraction NSR rescues.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from analysis.stats import pass_at_k
from experiments.config import RunConfig, load_config
from experiments.rundir import REPO_ROOT, RunDir, read_jsonl
from experiments.sft import warm_start
from experiments.threads import set_threads

PRESET = REPO_ROOT / "sweeps" / "presets" / "tiny.yaml"
COMMON = ["train.steps=300", "eval.every=50"]
ARMS = {"hard": ["loss.rule=hard"], "nsr": ["loss.rule=nsr", "loss.delta=0.2"]}
LABELS = {"hard": "hard clip (DAPO)", "nsr": "NSR, delta 0.2"}
COLORS = {"hard": "tab:gray", "nsr": "tab:red"}
RUNS = REPO_ROOT / "results" / "runs" / "demo"
FIGURE = REPO_ROOT / "results" / "figures" / "demo_dynamics.png"


def _configs() -> dict[str, RunConfig]:
    return {arm: load_config(PRESET, [*COMMON, *overrides]) for arm, overrides in ARMS.items()}


def _folders(cfgs: dict[str, RunConfig], runs_root: Path) -> dict[str, Path]:
    return {arm: runs_root / f"{arm}-{cfg.run_hash()}" for arm, cfg in cfgs.items()}


def _run_one(cfg: RunConfig, folder: Path, arm: str, progress: bool) -> None:
    from experiments.run import run

    run(cfg, folder, run_id=folder.name, meta={"sweep": "demo", "arm": arm, "seed": cfg.seed}, progress=progress)


def run_arms(runs_root: Path = RUNS, jobs: int = 2, progress: bool = True) -> dict[str, Path]:
    """Run (or reuse) each arm, ``jobs`` at a time; returns {arm: run folder}.

    With jobs > 1 each arm runs in its own process with one torch thread (NSR_THREADS=1 unless set): on 2 cores
    that is faster than two threads per run one after the other, and it does not stall when other jobs share
    the cores (docs/testbed.md). The shared warm start is built first, here.
    """
    cfgs = _configs()
    folders = _folders(cfgs, runs_root)
    todo = [arm for arm in cfgs if RunDir(folders[arm]).state() != "done"]
    if not todo:
        return folders
    set_threads()
    warm_start(cfgs[todo[0]], progress=progress)  # every arm shares it: build it once, before the fan-out
    if jobs <= 1:
        for arm in todo:
            _run_one(cfgs[arm], folders[arm], arm, progress)
        return folders
    ctx = multiprocessing.get_context("spawn")  # no fork after torch has started its thread pool
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=ctx) as pool:
        futures = [pool.submit(_run_one, cfgs[arm], folders[arm], arm, False) for arm in todo]
        total = sum(cfgs[arm].train.steps for arm in todo)
        with tqdm(total=total, desc=f"demo: {', '.join(todo)} in parallel", disable=not progress) as bar:
            while not all(f.done() for f in futures):
                time.sleep(1.0)
                done = sum(_rows(RunDir(folders[arm]).metrics_path) for arm in todo)
                bar.update(done - bar.n)
        for f in futures:
            f.result()  # re-raises a failed arm's error (its status.json says failed)
    return folders


def _rows(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _rolling(values: list[float], window: int = 10) -> pd.Series:
    return pd.Series(values).rolling(window, min_periods=1).mean()


def _eval_curves(rows: list[dict], k: int = 8) -> tuple[list[int], list[float], list[float], int]:
    """(steps, sampled accuracy, pass@k, k) from raw eval rows; pass@k by analysis.stats.pass_at_k (the unbiased
    estimator, each problem's value the float nearest the exact fraction), k <= samples."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for r in rows:
        if r["decoding"] == "sampled":
            by_step.setdefault(r["step"], {}).setdefault(r["problem_id"], []).append(r["correct"])
    steps = sorted(by_step)
    k = min([k] + [len(g) for s in steps for g in by_step[s].values()])
    acc, pk = [], []
    for s in steps:
        groups = by_step[s].values()
        acc.append(sum(map(sum, groups)) / sum(map(len, groups)))
        per_problem = pass_at_k([len(g) for g in groups], [sum(g) for g in groups], k)
        pk.append(float(sum(per_problem)) / len(groups))
    return steps, acc, pk, k


def plot(runs: dict[str, Path], path: Path = FIGURE) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for arm, folder in runs.items():
        rd = RunDir(folder)
        m = read_jsonl(rd.metrics_path)
        steps = [r["step"] for r in m]
        c, label = COLORS[arm], LABELS[arm]
        axes[0].plot(steps, _rolling([r["reward_mean"] for r in m]), color=c, alpha=0.5, lw=1)
        es, acc, pk, k = _eval_curves(read_jsonl(rd.eval_path))
        axes[0].plot(es, acc, "o-", color=c, label=f"{label}: eval sampled acc")
        axes[0].plot(es, pk, "s--", color=c, mfc="none", label=f"{label}: eval pass@{k}")
        axes[1].plot(steps, _rolling([r["entropy"] for r in m]), color=c, label=label)
        high, low = _rolling([r["clip_frac_high"] for r in m]), _rolling([r["clip_frac_low"] for r in m])
        axes[2].plot(steps, high, color=c, label=f"{label}: A>0, r>1+eps_high")
        axes[2].plot(steps, low, color=c, ls=":", label=f"{label}: A<0, r<1-eps_low")
        axes[3].plot(steps, _rolling([r["rescue_frac"] for r in m]), color=c, label=label)
    titles = [
        "reward (line: train, 10-step mean)",
        "policy entropy per token",
        "tokens clipped (zero gradient)",
        "tokens rescued by NSR",
    ]
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[2:]:
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0, decimals=1))
    cfg = load_config(RunDir(next(iter(runs.values()))).config_path)
    ro, tr, md = cfg.rollout, cfg.train, cfg.model
    title = (
        f"CPU testbed: {cfg.task.name}, GPT-2 d{md.d_model} L{md.n_layer}, GRPO {ro.prompts_per_step}x"
        f"{ro.samples_per_prompt}, lr {tr.lr:g}, {tr.epochs}x{tr.minibatches} minibatches, seed {cfg.seed}"
    )
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m analysis.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--plot-only", action="store_true", help="only redraw the figure from finished runs")
    p.add_argument("--runs", type=Path, default=RUNS, help="folder of the demo runs (default results/runs/demo)")
    p.add_argument("--figure", type=Path, default=FIGURE, help="output PNG")
    p.add_argument("--jobs", type=int, default=2, help="arms run at once, one thread each (1: in turn)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.plot_only:
        folders = _folders(_configs(), args.runs)
    else:
        folders = run_arms(args.runs, jobs=args.jobs, progress=not args.no_progress)
    for folder in folders.values():
        if RunDir(folder).state() != "done":
            print(f"error: {folder} is not a finished run; run `python -m analysis.demo` first", file=sys.stderr)
            return 2
    print(f"wrote {plot(folders, args.figure)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
