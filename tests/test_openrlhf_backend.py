"""The cluster backend's CPU-side parts: checkpoint discovery, resume step, data checks, eval rows (the vLLM and
OpenRLHF processes themselves need GPUs)."""

import json
from pathlib import Path

import pytest

from experiments.config import ConfigError, load_config
from experiments.openrlhf.backend import check_data, resume_step
from experiments.openrlhf.evaluate import checkpoints, eval_rows, load_benchmark
from experiments.rundir import RunDir

PRESET = Path(__file__).resolve().parents[1] / "sweeps" / "presets" / "qwen2.5-math-7b-dapo.yaml"


def _cfg(tmp_path, *overrides):
    return load_config(PRESET, [f"task.train_data={tmp_path / 'train.jsonl'}", *overrides])


def test_checkpoints_found_in_the_run_folder(tmp_path):
    cfg = _cfg(tmp_path)
    rd = RunDir(tmp_path / "run")
    for name in ("global_step50_hf", "global_step100_hf", "final_hf", "_actor", "global_step7"):
        (rd.path / "ckpt" / name).mkdir(parents=True)
    rd.append("metrics.jsonl", [{"step": s} for s in range(1, 121)])
    found = checkpoints(rd.path, cfg)
    assert list(found) == [0, 50, 100, 120]
    assert found[0] == cfg.model.name and found[120].endswith("final_hf") and found[50].endswith("global_step50_hf")


def test_resume_step_reads_deepspeeds_latest_tag(tmp_path):
    rd = RunDir(tmp_path)
    assert resume_step(rd) is None
    (tmp_path / "ckpt" / "_actor").mkdir(parents=True)
    (tmp_path / "ckpt" / "_actor" / "latest").write_text("global_step150\n")
    assert resume_step(rd) == 150


def test_check_data_counts_rows(tmp_path):
    cfg = _cfg(
        tmp_path,
        "train.steps=2",
        "rollout.prompts_per_step=4",
        "openrlhf.train_batch_size=16",
        "openrlhf.micro_train_batch_size=1",
        "openrlhf.micro_rollout_batch_size=1",
        "train.minibatches=4",
    )
    with pytest.raises(ConfigError, match="no such file"):
        check_data(cfg)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": "p", "label": "1"}) + "\n" for _ in range(7)))
    with pytest.raises(ConfigError, match="has 7 rows, train.steps x rollout.prompts_per_step = 8 needed"):
        check_data(cfg)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": "p", "label": "1"}) + "\n" for _ in range(8)))
    check_data(cfg)


def test_eval_rows_score_each_sample(tmp_path):
    cfg = _cfg(tmp_path)
    (tmp_path / "aime24.jsonl").write_text(
        json.dumps({"prompt": "a", "label": "34", "problem_id": 7})
        + "\n"
        + json.dumps({"prompt": "b", "label": "\\frac{1}{2}", "problem_id": 8})
        + "\n"
    )
    probs = load_benchmark(cfg, "aime24")
    rows = eval_rows(50, "aime24", probs, [["\\boxed{34}", "\\boxed{33}"], ["\\boxed{0.5}", "no"]], "sampled")
    assert [(r["problem_id"], r["sample"], r["correct"]) for r in rows] == [
        ("7", 0, 1),
        ("7", 1, 0),
        ("8", 0, 1),
        ("8", 1, 0),
    ]
    assert all(r["step"] == 50 and r["decoding"] == "sampled" and r["benchmark"] == "aime24" for r in rows)
    with pytest.raises(FileNotFoundError, match="python -m experiments.openrlhf.data --only amc"):
        load_benchmark(cfg, "amc")
