"""Synthetic run folders in the exact run-folder contract, for the analysis tests and the make_all benchmark (was
analysis/synth.py: test support, so it left the installed analysis package).

The numbers are made up (a saturating reward curve, a decaying entropy with optional rebounds, Bernoulli eval
labels), but every file is what a real run writes: config.yaml from a real RunConfig plus ``meta``, one
metrics.jsonl row per step with every docs/design.md field, eval.jsonl.gz with one row per (step, benchmark,
problem_id, decoding, sample), and status.json. Same arguments, same bytes (seeded torch.Generator, fixed times).

    from devtools.synthetic_runs import ArmSpec, write_sweep
    write_sweep(root, "rescue_vs_decay", {"hard": ArmSpec(), "nsr": ArmSpec(skill=0.3)}, seeds=[0, 1, 2])

    python -m devtools.synthetic_runs OUT_DIR [--sweeps 5] [--arms 5] [--seeds 4] [--steps 1000]  # a benchmark grid
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from experiments.config import RunConfig, apply_overrides, from_dict


@dataclass(frozen=True)
class ArmSpec:
    """How one synthetic arm behaves, and the config it claims to be."""

    overrides: dict = field(default_factory=dict)
    """Dotted RunConfig overrides of the arm (e.g. {"loss.rule": "nsr", "loss.delta": 0.2})."""
    point: dict = field(default_factory=dict)
    """The grid point recorded in meta.point (a subset of overrides)."""
    skill: float = 0.0
    """Log-odds added to every problem's solve rate by the end of training (the arm's true effect)."""
    entropy_spikes: int = 0
    """Entropy rebounds injected into the run, each with a fall in reward (a collapse-prone arm)."""
    rescue: float = 0.0
    """Mean rescue_frac (0 for rules that do not rescue)."""


def _gen(*key) -> torch.Generator:
    h = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return torch.Generator().manual_seed(int(h[:15], 16))


def _normal(g, n) -> np.ndarray:
    return torch.randn(n, generator=g, dtype=torch.float64).numpy()


def _uniform(g, n) -> np.ndarray:
    return torch.rand(n, generator=g, dtype=torch.float64).numpy()


def metrics_rows(spec: ArmSpec, seed: int, steps: int, key: str) -> list[dict]:
    """One metrics.jsonl row per step 1..steps."""
    g = _gen("metrics", key, seed)
    t = np.arange(1, steps + 1, dtype=np.float64)
    prog = 1 - np.exp(-t / (0.25 * steps))
    reward = 0.2 + (0.3 + 0.1 * spec.skill) * prog + 0.03 * _normal(g, steps)
    entropy = 0.05 + 0.45 * np.exp(-t / (0.3 * steps)) + 0.01 * _normal(g, steps)
    for c in range(spec.entropy_spikes):
        centre = steps * (0.3 + 0.5 * c / max(1, spec.entropy_spikes))
        bump = np.exp(-0.5 * ((t - centre) / (0.02 * steps + 1)) ** 2)
        entropy += 0.3 * bump
        reward -= 0.15 * bump  # a spike comes with a fall in reward (what analysis.summary.entropy_spike counts)
    clip_low = np.abs(0.015 * (1 - 0.5 * prog) + 0.002 * _normal(g, steps))
    clip_high = np.abs(0.02 * (1 - 0.5 * prog) + 0.002 * _normal(g, steps))
    rescue = np.abs(spec.rescue * (1 - 0.5 * prog) + 0.1 * spec.rescue * _normal(g, steps))
    length = 6.0 + prog + 0.1 * _normal(g, steps)
    noise = _normal(g, 3 * steps).reshape(3, steps)
    rows = []
    for i in range(steps):
        rows.append(
            {
                "step": int(t[i]),
                "reward_mean": round(float(reward[i]), 6),
                "entropy": round(float(max(entropy[i], 0.0)), 6),
                "response_len": round(float(length[i]), 4),
                "clip_frac_low": round(float(clip_low[i]), 6),
                "clip_frac_high": round(float(clip_high[i]), 6),
                "rescue_frac": round(float(rescue[i]), 6),
                "pushout_frac": 0.0,
                "ppo_kl": round(float(1e-3 * abs(noise[0, i])), 8),
                "policy_loss": round(float(0.01 * noise[1, i]), 6),
                "grad_norm": round(float(0.5 + 0.1 * abs(noise[2, i])), 6),
                "wall_s": 0.15,
            }
        )
    return rows


def eval_text(spec: ArmSpec, seed: int, steps: int, every: int, n_prompts: int, n_samples: int, key: str) -> str:
    """eval.jsonl text: greedy + n_samples sampled labels per prompt at step 0, every ``every`` steps, and the end."""
    at = sorted({0, steps, *range(every, steps, every)}) if every else [0, steps]
    difficulty = _normal(_gen("eval-set"), n_prompts) * 1.5 - 0.8  # shared by every run: the fixed eval set
    lines = []
    for step in at:
        g = _gen("eval", key, seed, step)
        logit = difficulty + (0.8 + spec.skill) * (1 - np.exp(-step / (0.25 * steps)))
        p = 1 / (1 + np.exp(-logit))
        greedy = (p > 0.5).astype(int) if step else (p > 0.6).astype(int)
        sampled = (_uniform(g, n_prompts * n_samples).reshape(n_prompts, n_samples) < p[:, None]).astype(int)
        for j in range(n_prompts):
            head = f'{{"step":{step},"benchmark":"countdown3","problem_id":{j},"decoding":'
            lines.append(f'{head}"greedy","sample":0,"correct":{greedy[j]}}}\n')
            lines.extend(f'{head}"sampled","sample":{s},"correct":{sampled[j, s]}}}\n' for s in range(n_samples))
    return "".join(lines)


def write_folder(run_dir: Path, cfg: RunConfig, meta: dict, spec: ArmSpec, state: str = "done") -> None:
    """Write one synthetic run folder for ``cfg`` (train.steps steps; eval as cfg.eval says: every, n_prompts,
    n_samples) with ``meta`` (sweep, arm, point, seed, baseline, ...) in its config.yaml."""
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = {"run_id": run_dir.name, "run_hash": cfg.run_hash(), "git_commit": "synthetic", **meta}
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**cfg.to_dict(), "meta": meta}, sort_keys=False))
    key = f"{meta.get('sweep')}/{meta.get('arm')}/{json.dumps(meta.get('point', {}), sort_keys=True)}"
    steps, seed, ev = cfg.train.steps, cfg.seed, cfg.eval
    rows = metrics_rows(spec, seed, steps, key)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    text = eval_text(spec, seed, steps, ev.every, ev.n_prompts, ev.n_samples, key)
    with open(run_dir / "eval.jsonl.gz", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(text.encode())
    status = {"state": state, "created": 0.0, "updated": 0.0, "finished": 0.0}
    (run_dir / "status.json").write_text(json.dumps(status, indent=1, sort_keys=True) + "\n")


def write_run(
    path: Path,
    sweep: str,
    arm: str,
    spec: ArmSpec,
    seed: int,
    *,
    steps: int,
    baseline: str | None,
    every: int = 100,
    n_prompts: int = 64,
    n_samples: int = 8,
) -> str:
    """Write a synthetic run of ``arm`` (default RunConfig + spec.overrides) under ``path``; returns its run id."""
    overrides = {**spec.overrides, "seed": seed, "train.steps": steps, "eval.every": every}
    overrides |= {"eval.n_prompts": n_prompts, "eval.n_samples": n_samples}
    cfg = from_dict(apply_overrides(RunConfig().to_dict(), overrides))
    run_id = f"{arm}-s{seed}-{cfg.run_hash()}"
    meta = {"sweep": sweep, "arm": arm, "point": dict(spec.point), "seed": seed, "baseline": baseline}
    write_folder(Path(path) / run_id, cfg, meta, spec)
    return run_id


def write_sweep(root: Path, sweep: str, arms: dict[str, ArmSpec], seeds, baseline: str | None = None, **kw) -> list:
    """Write every (arm, seed) of a synthetic sweep under ``root/sweep/``; returns the run ids."""
    baseline = baseline if baseline is not None else next(iter(arms))
    return [
        write_run(Path(root) / sweep, sweep, arm, spec, s, baseline=baseline, **kw)
        for arm, spec in arms.items()
        for s in seeds
    ]


def benchmark_grid(
    root: Path,
    sweeps: int = 5,
    arms: int = 5,
    seeds: int = 4,
    steps: int = 1000,
    every: int = 100,
    n_prompts: int = 512,
) -> int:
    """The make_all benchmark's grid: ``sweeps`` x ``arms`` x ``seeds`` runs (default 100) of ``steps`` steps, eval
    of ``n_prompts`` x (8 sampled + greedy) every ``every`` steps (the tiny preset's eval). Returns the run count."""
    n = 0
    for i in range(sweeps):
        specs = {"hard": ArmSpec()}
        for a in range(1, arms):
            d = round(0.1 * a, 2)
            specs[f"nsr_d{a}"] = ArmSpec(
                overrides={"loss.rule": "nsr", "loss.delta": d},
                point={"loss.delta": d},
                skill=0.1 * a,
                rescue=0.003 * a,
                entropy_spikes=a % 2,
            )
        n += len(write_sweep(root, f"sweep{i}", specs, range(seeds), steps=steps, every=every, n_prompts=n_prompts))
    return n


def add_grid_args(p: argparse.ArgumentParser) -> None:
    """The size of a synthetic grid (defaults: the make_all benchmark, 100 runs x 1,000 steps)."""
    p.add_argument("--sweeps", type=int, default=5)
    p.add_argument("--arms", type=int, default=5)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--prompts", type=int, default=512)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.synthetic_runs", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="results folder to fill (<out>/<sweep>/<run_id>/)")
    add_grid_args(p)
    a = p.parse_args(argv)
    n = benchmark_grid(a.out, a.sweeps, a.arms, a.seeds, a.steps, a.every, a.prompts)
    print(f"wrote {n} synthetic runs under {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
