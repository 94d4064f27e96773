"""The cluster backend: one RunConfig -> one OpenRLHF 0.11.2 training run (through the NSR launcher), then the
offline evaluator, writing the run folder contract (design.md). Called by ``python -m experiments.run`` for
``backend: openrlhf``; ``run()`` there sets status.json around it.

    python -m experiments.run sweeps/presets/qwen2.5-math-7b-dapo.yaml loss.rule=nsr     # inside an allocation
    python -m experiments.run --sweep sweeps/main.yaml --dry-run                         # print the commands

Resume: OpenRLHF reloads its latest DeepSpeed checkpoint (``--ckpt.load_enable``) and continues from its
global_step; metrics.jsonl rows after that step are cut first, so a resumed run ends with one row per step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from experiments.config import ConfigError, RunConfig
from experiments.openrlhf.argv import build_command
from experiments.openrlhf.data import count_rows
from experiments.openrlhf.metrics import rows_from_tensorboard
from experiments.rundir import REPO_ROOT, RunDir, read_jsonl


def resume_step(rd: RunDir) -> int | None:
    """global_step of the DeepSpeed checkpoint OpenRLHF will resume from (its ``latest`` tag file), or None."""
    latest = rd.path / "ckpt" / "_actor" / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return int(tag.removeprefix("global_step")) if tag.removeprefix("global_step").isdigit() else None


def check_data(cfg: RunConfig) -> None:
    """The train file exists and holds steps x prompts_per_step rows (OpenRLHF would silently train fewer steps)."""
    path = Path(cfg.task.train_data)
    path = path if path.is_absolute() else REPO_ROOT / path
    if not path.is_file():
        raise ConfigError(
            f"task.train_data={cfg.task.train_data!r}: no such file; make it with: python -m experiments.openrlhf.data"
        )
    need = cfg.train.steps * cfg.rollout.prompts_per_step
    have = count_rows(path)
    if have < need:
        raise ConfigError(
            f"task.train_data has {have} rows, train.steps x rollout.prompts_per_step = {need} needed; allowed: "
            "fewer train.steps, or more passes (python -m experiments.openrlhf.data --epochs N)"
        )


def _run_logged(argv: list[str], log: Path) -> None:
    """Run ``argv`` from the repo root (Ray workers import nsr from the driver's working directory), output to
    ``log``; on any exception (SIGTERM -> Cancelled included) the child is stopped before re-raising."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(log, "a") as out:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{argv[2] if len(argv) > 2 else argv[0]} exited with {rc}; end of {log}:\n{tail}")


def run_openrlhf(cfg: RunConfig, rd: RunDir, progress: bool = True) -> None:
    meta = (yaml.safe_load(rd.config_path.read_text()) or {}).get("meta", {}) if rd.config_path.exists() else {}
    run_id = meta.get("run_id") or rd.path.name
    cmd = build_command(cfg, rd.path, run_id)  # refusals before anything starts
    check_data(cfg)
    step = resume_step(rd)
    if step is None:
        rd.reset_logs()
    else:
        rd.truncate_logs(step)
    _run_logged(cmd.argv, rd.path / "openrlhf.log")
    if not rd.metrics_path.exists() or not read_jsonl(rd.metrics_path):  # fall back to the TensorBoard mirror
        rows = rows_from_tensorboard(rd.path / "tensorboard")
        if not rows:
            raise RuntimeError(f"{rd.path}: OpenRLHF finished without logging a single step")
        rd.append("metrics.jsonl", rows)
    _run_logged([sys.executable, "-m", "experiments.openrlhf.evaluate", str(rd.path)], rd.path / "evaluate.log")
    rd.compress_eval()
    if not cfg.logging.keep_checkpoint:
        shutil.rmtree(rd.path / "ckpt", ignore_errors=True)
