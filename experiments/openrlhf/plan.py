"""What a cluster run needs before it is submitted: prompt rows, GPU-hours and disk, per run and per sweep.

    python -m experiments.openrlhf.plan --sweep sweeps/main.yaml                 # every openrlhf run + the total
    python -m experiments.openrlhf.plan sweeps/presets/qwen2.5-math-7b-dapo.yaml loss.rule=nsr

Per run (:func:`plan_run`):
* ``rows_needed``: prompts OpenRLHF may draw. Each RL step trains on ``rollout.prompts_per_step`` prompts; with DAPO
  dynamic filtering a filtered prompt is replaced by a new one, so the loader must hold FILTER_HEADROOM times as many
  (the filter must keep >= 1 / FILTER_HEADROOM of the prompts; a run whose filter keeps fewer runs out of prompts,
  stops early and is reported failed by the backend, never done). ``rows_written``: rows in ``task.train_data``
  (None when the file is not there yet); ``rows_ok`` (always for the generated arithmetic task and a toy CPU
  model's data: its backend writes the rows the run draws when it starts).
* ``gpu_hours_limit``: nodes x GPUs x the site's time limit (slurm/cluster.yaml ``time_min``), what one allocation
  holds; ``gpu_hours_estimate``: from the token budget (``train.steps`` x prompts x samples x tokens per sample) at
  the throughputs below; ``jobs_estimate``: allocations that takes (the job requeues and resumes). The estimate is
  for a decision, not a promise: measure one run's ``timing/step_total`` (metrics.jsonl ``wall_s``) and scale.
* ``model_local``: the model is a local folder or already in the Hugging Face cache (``HF_HOME``); compute nodes
  without internet need it there (docs/cluster.md, offline settings).
* ``disk_peak_gb``: what its checkpoints hold at most: ``--ckpt.max_num`` DeepSpeed checkpoints (bf16 weights, fp32
  master weights and two Adam moments: BYTES_DS per parameter) plus one bf16 HF folder per evaluated step
  (BYTES_HF per parameter); ``disk_kept_gb``: what stays after the run (HF folders when ``logging.keep_checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from experiments.config import RunConfig
from experiments.evaluation.math import eval_steps
from experiments.models.qwen2 import is_toy_model
from experiments.rundir import REPO_ROOT

ARITHMETIC = "arithmetic"
"""task.name of the generated arithmetic task (experiments/tasks/arithmetic.py): no train_data file to name."""
FILTER_HEADROOM = 3
"""With dynamic filtering, prompt rows per prompt a step trains on (the filter must keep >= 1/3 of the groups)."""
CKPT_MAX_NUM = 2
"""DeepSpeed checkpoints OpenRLHF keeps (``--ckpt.max_num``): >= 2, so a preemption while one is written leaves the
previous one whole (OpenRLHF deletes the oldest before it writes the next)."""
BYTES_DS = 16
"""Bytes per parameter of a DeepSpeed checkpoint: bf16 weights (2), fp32 master weights (4), Adam m, v (8), slack."""
BYTES_HF = 2
"""Bytes per parameter of one HF checkpoint (bf16 safetensors)."""
MODEL_PARAMS = {
    "smollm2-135m-instruct": 134.5e6,  # a DeepSpeed checkpoint measured 1797 MB, an HF one 314 MB (docs/testbed.md)
    "Qwen/Qwen2.5-Math-7B": 7.62e9,
    "Qwen/Qwen3-8B-Base": 8.19e9,
    "Qwen/Qwen3-8B": 8.19e9,
    "Qwen/Qwen3-30B-A3B-Base": 30.5e9,
    "Qwen/Qwen3-30B-A3B": 30.5e9,
}
"""Parameter counts (from the models' HF cards) of the preset models; another model gives no disk estimate."""
ACTIVE_PARAMS = {"Qwen/Qwen3-30B-A3B-Base": 3.3e9, "Qwen/Qwen3-30B-A3B": 3.3e9}
"""MoE: parameters used per token (compute), where it differs from the total."""
MEAN_RESPONSE_FRACTION = 0.5
"""[assumption] mean response length as a fraction of rollout.max_new_tokens (DAPO's grow to 0.4-0.7)."""
EXPECTED_FILTER_PASS = 0.6
"""[assumption] share of prompt groups dynamic filtering keeps, for the time estimate (rows use FILTER_HEADROOM)."""
DECODE_TOKENS_PER_GPU_S_7B = 15000.0
"""[assumption] vLLM decode throughput of a 7B dense model per 80 GB GPU with ~1000 sequences in flight, scaled by
7e9 / active parameters."""
TRAIN_MFU = 0.3
"""[assumption] model-FLOPs utilisation of the DeepSpeed update on 989 bf16 TFLOP/s GPUs."""
GPU_FLOPS = 989e12


@dataclass(frozen=True)
class RunPlan:
    run_id: str
    nodes: int
    gpus: int
    rows_needed: int
    rows_written: int | None
    rows_ok: bool
    time_limit_h: float | None
    gpu_hours_limit: float | None
    gpu_hours_estimate: float | None
    jobs_estimate: int | None
    """Allocations of ``time_limit_h`` the estimate needs (the job requeues itself and resumes)."""
    model_local: bool
    disk_peak_gb: float | None
    disk_kept_gb: float | None


def count_rows(path: str | Path) -> int:
    """Rows of a prompt JSONL file (non-empty lines)."""
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def rows_needed(cfg: RunConfig) -> int:
    """Prompt rows a run may draw (``--data.max_samples``): steps x prompts, x FILTER_HEADROOM if dynamic filtering."""
    base = cfg.train.steps * cfg.rollout.prompts_per_step
    return base * FILTER_HEADROOM if cfg.openrlhf.dynamic_filtering else base


def train_data_path(cfg: RunConfig) -> Path:
    """The prompt file OpenRLHF reads: ``task.train_data`` (from the repo root), or for the generated ``arithmetic``
    task whole seeded passes over its training problems, written next to them by the backend
    (experiments/openrlhf/backend.py ``write_task_data``; pure here)."""
    if cfg.task.name == ARITHMETIC:
        from experiments.tasks.arithmetic import data_dir

        return data_dir(cfg.task) / f"openrlhf-train-{rows_needed(cfg)}.jsonl"
    path = Path(cfg.task.train_data)
    return path if path.is_absolute() else REPO_ROOT / path


def site_time_limit_h(preset: str | None, site: str | Path | None = None) -> float | None:
    """``time_min`` of ``preset`` (else ``default``) in slurm/cluster.yaml, in hours; None when not set."""
    path = Path(site) if site else REPO_ROOT / "slurm" / "cluster.yaml"
    if not path.is_file():
        return None
    doc = yaml.safe_load(path.read_text()) or {}
    entry = {**(doc.get("default") or {}), **((doc.get("presets") or {}).get(preset) or {})}
    return entry["time_min"] / 60 if entry.get("time_min") else None


def model_local(name: str) -> bool:
    """A local model folder, or a hub id whose config.json is in the Hugging Face cache (no network used)."""
    if Path(name).is_dir():
        return True
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001 - an id the cache cannot even look up is not there
        return False


def gpu_hours_estimate(cfg: RunConfig) -> float | None:
    """GPU-hours from the token budget (see the module doc for the assumptions); None for an unknown model."""
    n = ACTIVE_PARAMS.get(cfg.model.name, MODEL_PARAMS.get(cfg.model.name))
    if n is None or cfg.openrlhf.cpu:  # a CPU run uses no GPU
        return None
    samples = cfg.train.steps * cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    generated = samples / (EXPECTED_FILTER_PASS if cfg.openrlhf.dynamic_filtering else 1)
    response = MEAN_RESPONSE_FRACTION * cfg.rollout.max_new_tokens
    tokens = samples * (cfg.task.max_prompt_len / 2 + response)  # trained on
    decode_s = generated * response / (DECODE_TOKENS_PER_GPU_S_7B * 7e9 / n)
    # update: forward for old log-probs (2N) + forward/backward with recomputation (8N) per epoch
    train_s = tokens * n * (2 + 8 * cfg.train.epochs) / (GPU_FLOPS * TRAIN_MFU)
    return (decode_s + train_s) / 3600


def plan_run(cfg: RunConfig, run_id: str = "", time_limit_h: float | None = None) -> RunPlan:
    """The plan of one openrlhf run (see the module doc)."""
    o = cfg.openrlhf
    gpus = 0 if o.cpu else o.nodes * o.gpus_per_node  # a CPU run's DeepSpeed ranks hold fake GPUs only
    need = rows_needed(cfg)
    path = train_data_path(cfg)
    have = count_rows(path) if path.is_file() else None
    params = MODEL_PARAMS.get(cfg.model.name)
    limit = gpus * time_limit_h if time_limit_h else None
    estimate = gpu_hours_estimate(cfg)
    hf = len(eval_steps(cfg)) * params * BYTES_HF / 1e9 if params else None
    ds = CKPT_MAX_NUM * params * BYTES_DS / 1e9 if params else None
    return RunPlan(
        run_id=run_id,
        nodes=o.nodes,
        gpus=gpus,
        rows_needed=need,
        rows_written=have,
        # the generated task's rows and a toy CPU model's data are written by the backend when the run starts
        rows_ok=cfg.task.name == ARITHMETIC or is_toy_model(cfg) or (have is not None and have >= need),
        time_limit_h=time_limit_h,
        gpu_hours_limit=limit,
        gpu_hours_estimate=estimate,
        jobs_estimate=math.ceil(estimate / limit) if estimate and limit else None,
        model_local=model_local(cfg.model.name),
        disk_peak_gb=None if params is None else ds + hf,
        disk_kept_gb=None if params is None else (hf if cfg.logging.keep_checkpoint else 0.0),
    )


def total(plans: list[RunPlan]) -> dict:
    """Sweep totals: runs, GPU-hours (limit and estimate), disk if every run's peak were held at once, rows."""

    def add(key):
        vals = [getattr(p, key) for p in plans]
        return None if any(v is None for v in vals) else sum(vals)

    return {
        "runs": len(plans),
        "gpu_hours_limit": add("gpu_hours_limit"),
        "gpu_hours_estimate": add("gpu_hours_estimate"),
        "disk_peak_gb_all_at_once": add("disk_peak_gb"),
        "disk_kept_gb": add("disk_kept_gb"),
        "rows_needed_max": max((p.rows_needed for p in plans), default=0),
        "runs_short_of_rows": [p.run_id for p in plans if not p.rows_ok],
    }


def _specs(args) -> list[tuple[RunConfig, str, str | None]]:
    from experiments.config import load_config

    if args.sweep:
        from experiments.sweep import expand

        return [(s.config, s.run_id, s.meta.get("preset")) for s in expand(args.sweep, preset=args.preset)]
    cfg = load_config(args.config, args.overrides)
    return [(cfg, f"{Path(args.config).stem}-{cfg.run_hash()}", Path(args.config).stem)]


def main(argv: list[str] | None = None) -> int:
    from experiments.config import ConfigError

    p = argparse.ArgumentParser(
        prog="python -m experiments.openrlhf.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="a preset (with key=value overrides), or use --sweep")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--sweep")
    p.add_argument("--preset")
    p.add_argument("--site", help="site file (default slurm/cluster.yaml)")
    a = p.parse_intermixed_args(argv)  # key=value overrides before or after the options
    if not a.sweep and not a.config:
        print("error: give a preset file or --sweep SWEEP", file=sys.stderr)
        return 2
    try:
        plans = []
        for cfg, run_id, preset in _specs(a):
            if cfg.backend != "openrlhf":
                continue
            plans.append(plan_run(cfg, run_id, site_time_limit_h(preset or cfg.model.name, a.site)))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for pl in plans:
        print(json.dumps(asdict(pl)))
    print(json.dumps({"total": total(plans)}))
    return 0 if all(pl.rows_ok for pl in plans) else 1


if __name__ == "__main__":
    sys.exit(main())
