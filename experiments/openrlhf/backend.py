"""The cluster backend: one RunConfig -> one OpenRLHF 0.11.2 training run (through the NSR launcher), then the
offline evaluator, writing the run folder contract (docs/design.md). Called by ``python -m experiments.run`` for
``backend: openrlhf``; ``run()`` there sets status.json around it.

    python -m experiments.run sweeps/presets/qwen2.5-math-7b-dapo.yaml loss.rule=nsr     # inside an allocation
    python -m experiments.run --sweep sweeps/main.yaml --dry-run                         # print the commands

Before the launcher starts: the data file must hold the rows the run may draw (experiments/openrlhf/plan.py), and
the DeepSpeed checkpoint OpenRLHF will resume from is checked (:func:`repair_checkpoints`): ``latest`` must name a
whole checkpoint, else it is pointed at the newest whole one (or the run starts over), and half-written folders are
removed; metrics.jsonl rows after that step are cut, so a resumed run ends with one row per step.
After training: the run must have reached ``train.steps`` (else it failed: the prompts ran out), the DeepSpeed
checkpoints (only needed to resume training) and HF folders the evaluator will not read are deleted, and a requeued
job that finds training finished goes straight to evaluation. After evaluation the HF folders are deleted too
unless ``logging.keep_checkpoint``.

The toy model (``model.name: cpu-tiny-qwen2``, sweeps/presets/openrlhf-cpu.yaml) is built in code with its toy data
before the launcher starts (experiments/openrlhf/toy.py). A CPU run (``openrlhf.cpu: true``, set by the CPU presets)
starts the launcher with the CPU shim switched on (``LaunchCommand.env``; nsr/openrlhf/cpu_shim.py).
SmolLM2 (``model.name: smollm2-135m-instruct``, or any model with ``model.untie_embeddings``) is prepared before the
launcher starts (experiments/models/smollm2.py ``prepared_folder``: converted once per machine) and the run records
``meta.model`` (name, gguf_sha256, weights_sha256, untied) in config.yaml; a resumed run refuses other weights.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from experiments.config import ConfigError, RunConfig
from experiments.evaluation.math import STEP_DIR, benchmark_file, eval_steps
from experiments.models.qwen2 import is_toy_model, model_path
from experiments.openrlhf.argv import build_command
from experiments.openrlhf.plan import ARITHMETIC, FILTER_HEADROOM, count_rows, rows_needed, train_data_path
from experiments.openrlhf.tensorboard import ratio_bins_from_tensorboard, rows_from_tensorboard
from experiments.openrlhf.toy import prepare as prepare_cpu_model
from experiments.rundir import REPO_ROOT, RunDir, read_jsonl

CKPT_DONE_FILE = "metric.json"
"""OpenRLHF writes this into a DeepSpeed checkpoint folder after DeepSpeed's save returned on every rank."""
STEP_TAG = "global_step"


def _tag_step(tag: str) -> int | None:
    rest = tag.removeprefix(STEP_TAG)
    return int(rest) if tag.startswith(STEP_TAG) and rest.isdigit() else None


def repair_checkpoints(ckpt: Path) -> int | None:
    """Make ``<ckpt>/_actor/latest`` name a whole DeepSpeed checkpoint before OpenRLHF resumes from it.

    A folder is whole when OpenRLHF's ``metric.json`` is in it, or when it is the one ``latest`` names (DeepSpeed
    writes ``latest`` after every rank saved). Half-written folders (a save cut by preemption) are removed, so
    OpenRLHF's rotation cannot delete the whole one in their favour; when ``latest`` names a missing or half-written
    folder it is pointed at the newest whole one; with none left, ``_actor`` is removed and the run starts over.

    Returns the RL step OpenRLHF will resume from, or None for a fresh start.
    """
    actor = ckpt / "_actor"
    if not actor.is_dir():
        return None
    latest = actor / "latest"
    named = latest.read_text().strip() if latest.is_file() else None
    folders = {d.name: d for d in actor.iterdir() if d.is_dir() and _tag_step(d.name) is not None}
    whole = {t for t, d in folders.items() if (d / CKPT_DONE_FILE).is_file() or (t == named and any(d.iterdir()))}
    for tag in set(folders) - whole:
        shutil.rmtree(folders[tag])
    if not whole:
        shutil.rmtree(actor)
        return None
    if named not in whole:
        named = max(whole, key=_tag_step)
        latest.write_text(named)
    return _tag_step(named)


def resume_step(rd: RunDir) -> int | None:
    """global_step of the DeepSpeed checkpoint OpenRLHF will resume from (its ``latest`` tag file), or None."""
    latest = rd.path / "ckpt" / "_actor" / "latest"
    return _tag_step(latest.read_text().strip()) if latest.is_file() else None


def write_task_data(cfg: RunConfig) -> dict[str, Path]:
    """The generated arithmetic task (experiments/tasks/arithmetic.py; files written once, cached): OpenRLHF's prompt
    file (whole seeded passes over the training problems, at least the rows the run draws: plan.train_data_path)
    and the evaluator's benchmark ``arithmetic`` (the evaluation problems), next to the task's own files. Returns
    {name: path} of what it wrote; nothing for another task."""
    if cfg.task.name != ARITHMETIC:
        return {}
    from experiments.openrlhf.data import repeat_shuffled, write_jsonl
    from experiments.tasks.arithmetic import read_rows, write_files

    files = write_files(cfg.task)
    written = {}
    path, need = train_data_path(cfg), rows_needed(cfg)
    if not path.is_file():
        train = read_rows(files["train"])
        write_jsonl(path, repeat_shuffled(train, -(-need // len(train)), seed=0))
        written["train"] = path
    bench = benchmark_file(cfg, ARITHMETIC)  # where the evaluator reads it
    if ARITHMETIC in cfg.task.eval_benchmarks and not bench.is_file():
        write_jsonl(bench, read_rows(files["eval"]))
        written[ARITHMETIC] = bench
    return written


def check_data(cfg: RunConfig) -> None:
    """The train file exists and holds the rows the run may draw (plan.rows_needed; OpenRLHF would silently train
    fewer steps)."""
    path = train_data_path(cfg)
    if not path.is_file():
        raise ConfigError(
            f"task.train_data={cfg.task.train_data!r}: no such file; make it with: python -m experiments.openrlhf.data"
        )
    need = rows_needed(cfg)
    have = count_rows(path)
    if have < need:
        raise ConfigError(
            f"task.train_data has {have} rows, {need} needed (train.steps x rollout.prompts_per_step"
            f"{f', x {FILTER_HEADROOM} for dynamic filtering' if cfg.openrlhf.dynamic_filtering else ''}); "
            f"allowed: fewer train.steps, or more rows (python -m experiments.openrlhf.data --rows {need})"
        )


def last_step(rd: RunDir) -> int:
    rows = read_jsonl(rd.metrics_path) if rd.metrics_path.exists() else []
    return max((r["step"] for r in rows), default=0)


def training_finished(rd: RunDir, cfg: RunConfig) -> bool:
    """metrics.jsonl reaches train.steps and OpenRLHF saved its final model, or the evaluation (which starts only
    after that) has begun: the checkpoints may be pruned or deleted by then."""
    evaluating = any((rd.path / n).exists() for n in ("eval.jsonl", "eval.jsonl.gz", "evaluate.log"))
    return last_step(rd) >= cfg.train.steps and ((rd.path / "ckpt" / "final_hf").is_dir() or evaluating)


def prune_checkpoints(rd: RunDir, cfg: RunConfig) -> list[Path]:
    """After training: delete the DeepSpeed checkpoints and the HF folders of steps the evaluator does not read."""
    ckpt = rd.path / "ckpt"
    keep = set(eval_steps(cfg))
    gone = [ckpt / "_actor"] if (ckpt / "_actor").is_dir() else []
    for d in ckpt.glob("global_step*_hf") if ckpt.is_dir() else []:
        m = STEP_DIR.fullmatch(d.name)
        if m and int(m.group(1)) not in keep:
            gone.append(d)
    for d in gone:
        shutil.rmtree(d)
    return gone


def _run_logged(argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Run ``argv`` from the repo root (the package itself is imported from its install, ``pip install -e .``),
    with ``env`` on top of this process's environment, output to ``log``; on any exception (SIGTERM -> Cancelled
    included) the child is stopped before re-raising."""
    with open(log, "a") as out:
        environ = {**os.environ, **env} if env else None
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=environ)
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


def prepare_model(cfg: RunConfig, rd: RunDir, resuming: bool) -> None:
    """SmolLM2 (or an untied copy of a model): the folder OpenRLHF loads, made once per machine, and ``meta.model``
    recorded in config.yaml on a fresh start; a resumed run that recorded one must find the same weights
    (ModelSourceError, as the trl backend). Other models (the cluster's hub ids and folders) are read as they are."""
    from experiments.models import smollm2

    if cfg.model.name != smollm2.NAME and not cfg.model.untie_embeddings:
        return
    folder, info = smollm2.prepared_folder(cfg.model.name, untie=cfg.model.untie_embeddings)
    if str(folder) != model_path(cfg):  # the folder the launcher command names (built without converting)
        raise RuntimeError(f"{cfg.model.name}: prepared in {folder}, but the OpenRLHF command loads {model_path(cfg)}")
    model = {k: info[k] for k in ("name", "gguf_sha256", "weights_sha256", "untied")}
    started = (rd.read_config() or {}).get("meta", {}).get("model") if rd.config_path.exists() else None
    if resuming:
        smollm2.check_resume(started, model, rd.path)
    if rd.config_path.exists():
        rd.update_meta(model=model)


def run_openrlhf(cfg: RunConfig, rd: RunDir, progress: bool = True) -> None:
    meta = (yaml.safe_load(rd.config_path.read_text()) or {}).get("meta", {}) if rd.config_path.exists() else {}
    run_id = meta.get("run_id") or rd.path.name
    cmd = build_command(cfg, rd.path, run_id)  # refusals before anything starts
    if is_toy_model(cfg):
        prepare_cpu_model(cfg)  # the model and toy data, built in code once (cached); the evaluator reads both
    write_task_data(cfg)  # a generated task's files (once; the evaluator reads its benchmark too)
    if not training_finished(rd, cfg):  # a requeued job whose training had ended goes on to the evaluation
        check_data(cfg)
        step = repair_checkpoints(rd.path / "ckpt")
        prepare_model(cfg, rd, resuming=step is not None)
        if step is None:
            rd.reset_logs()
        else:
            rd.truncate_logs(step)
        _run_logged(cmd.argv, rd.path / "openrlhf.log", cmd.env)
        if not rd.metrics_path.exists() or not read_jsonl(rd.metrics_path):  # fall back to the TensorBoard mirror
            rows = rows_from_tensorboard(rd.path / "tensorboard")
            if not rows:
                raise RuntimeError(f"{rd.path}: OpenRLHF finished without logging a single step")
            rd.append("metrics.jsonl", rows)
            rd.append("ratio_bins.jsonl", ratio_bins_from_tensorboard(rd.path / "tensorboard", cfg.loss))
        done = last_step(rd)
        if done < cfg.train.steps:
            raise RuntimeError(
                f"{rd.path}: OpenRLHF stopped at step {done} of train.steps={cfg.train.steps}: its prompts ran out "
                f"(dynamic filtering kept fewer than 1/{FILTER_HEADROOM} of them); the run is not done. Raise "
                f"plan.FILTER_HEADROOM, make more rows (python -m experiments.openrlhf.data) and run it again"
            )
    prune_checkpoints(rd, cfg)
    _run_logged([sys.executable, "-m", "experiments.evaluation.math", str(rd.path)], rd.path / "evaluate.log")
    rd.compress_eval()
    if not cfg.logging.keep_checkpoint:
        shutil.rmtree(rd.path / "ckpt", ignore_errors=True)
