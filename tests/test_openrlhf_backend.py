"""The cluster backend's CPU-side parts: checkpoint discovery and repair before resume, rotation, data checks, eval
steps and GPU split, eval rows (the vLLM and OpenRLHF processes themselves need GPUs)."""

import json
from pathlib import Path

import pytest

from experiments.config import ConfigError, load_config
from experiments.evaluation.math import checkpoints, eval_rows, gpu_groups, load_benchmark
from experiments.openrlhf import data
from experiments.openrlhf.backend import check_data, prune_checkpoints, repair_checkpoints, resume_step
from experiments.openrlhf.plan import plan_run
from experiments.rundir import RunDir, read_jsonl

PRESET = Path(__file__).resolve().parents[1] / "sweeps" / "presets" / "qwen2.5-math-7b-dapo.yaml"


def _cfg(tmp_path, *overrides):
    return load_config(PRESET, [f"task.train_data={tmp_path / 'train.jsonl'}", *overrides])


def test_checkpoints_found_in_the_run_folder(tmp_path):
    cfg = _cfg(tmp_path)
    rd = RunDir(tmp_path / "run")
    for name in ("global_step50_hf", "global_step100_hf", "final_hf", "_actor", "global_step7"):
        (rd.path / "ckpt" / name).mkdir(parents=True)
    rd.append("metrics.jsonl", [{"step": s} for s in range(1, 401)])
    found = checkpoints(rd.path, cfg)
    assert list(found) == [0, 50, 100, 400]
    assert found[0] == cfg.model.name and found[400].endswith("final_hf") and found[50].endswith("global_step50_hf")


def test_eval_every_picks_the_evaluated_checkpoints(tmp_path):
    cfg = _cfg(tmp_path, "eval.every=100")
    rd = RunDir(tmp_path / "run")
    for s in range(50, 401, 50):
        (rd.path / "ckpt" / f"global_step{s}_hf").mkdir(parents=True)
    assert list(checkpoints(rd.path, cfg)) == [0, 100, 200, 300, 400]
    # after training, the HF folders of other steps and the DeepSpeed checkpoints (resume only) are deleted
    (rd.path / "ckpt" / "_actor" / "global_step400").mkdir(parents=True)
    gone = prune_checkpoints(rd, cfg)
    assert sorted(p.name for p in gone) == ["_actor", *[f"global_step{s}_hf" for s in (150, 250, 350, 50)]]
    assert sorted(p.name for p in (rd.path / "ckpt").iterdir()) == [f"global_step{s}_hf" for s in (100, 200, 300, 400)]


def test_every_engine_gets_a_group_of_this_nodes_gpus():
    assert gpu_groups(1, visible="0,1,2,3") == ["0", "1", "2", "3"]
    assert gpu_groups(2, visible="4,5,6,7") == ["4,5", "6,7"]
    assert gpu_groups(2, visible="", count=5) == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="--tp 2: 1 GPUs visible on this node; allowed: 1 .. 1"):
        gpu_groups(2, visible="0")


def test_resume_step_reads_deepspeeds_latest_tag(tmp_path):
    rd = RunDir(tmp_path)
    assert resume_step(rd) is None
    (tmp_path / "ckpt" / "_actor").mkdir(parents=True)
    (tmp_path / "ckpt" / "_actor" / "latest").write_text("global_step150\n")
    assert resume_step(rd) == 150


def _ds_ckpt(actor, step, whole=True):
    d = actor / f"global_step{step}"
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if whole:  # OpenRLHF writes metric.json after DeepSpeed's save returned on every rank
        (d / "metric.json").write_text('{"metric_key": null, "metric_value": null}')


def test_a_latest_naming_a_deleted_checkpoint_is_repaired_before_resume(tmp_path):
    """--ckpt.max_num 1 and a preemption between OpenRLHF's delete and DeepSpeed's save: latest names a tag that is
    gone. OpenRLHF would die in DeepSpeed with a bare AssertionError on every requeue; the backend points latest at
    the newest whole checkpoint and removes the half-written one."""
    actor = tmp_path / "ckpt" / "_actor"
    _ds_ckpt(actor, 50)
    _ds_ckpt(actor, 100)
    _ds_ckpt(actor, 150, whole=False)  # cut mid-save
    (actor / "latest").write_text("global_step200")  # deleted
    assert repair_checkpoints(tmp_path / "ckpt") == 100
    assert (actor / "latest").read_text() == "global_step100"
    assert sorted(p.name for p in actor.iterdir()) == ["global_step100", "global_step50", "latest"]


def test_the_checkpoint_latest_names_is_kept_even_before_openrlhfs_metric_file(tmp_path):
    actor = tmp_path / "ckpt" / "_actor"
    _ds_ckpt(actor, 50)
    _ds_ckpt(actor, 100, whole=False)  # DeepSpeed finished (it wrote latest); OpenRLHF's metric.json not yet
    (actor / "latest").write_text("global_step100")
    assert repair_checkpoints(tmp_path / "ckpt") == 100
    assert sorted(p.name for p in actor.iterdir()) == ["global_step100", "global_step50", "latest"]


def test_no_whole_checkpoint_means_a_fresh_start(tmp_path):
    actor = tmp_path / "ckpt" / "_actor"
    _ds_ckpt(actor, 50, whole=False)
    (actor / "latest").write_text("global_step0")
    assert repair_checkpoints(tmp_path / "ckpt") is None and not actor.exists()
    assert repair_checkpoints(tmp_path / "nothing") is None


SMALL = [
    "rollout.prompts_per_step=4",
    "openrlhf.train_batch_size=16",
    "openrlhf.micro_train_batch_size=1",
    "openrlhf.micro_rollout_batch_size=1",
    "train.minibatches=4",
]


def test_check_data_counts_rows(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=2", *SMALL)
    with pytest.raises(ConfigError, match="no such file"):
        check_data(cfg)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": "p", "label": "1"}) + "\n" for _ in range(7)))
    # 2 steps x 4 prompts, x 3: dynamic filtering replaces the prompts it drops
    with pytest.raises(ConfigError, match=r"has 7 rows, 24 needed .*x 3 for dynamic filtering.*--rows 24"):
        check_data(cfg)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": "p", "label": "1"}) + "\n" for _ in range(24)))
    check_data(cfg)
    check_data(_cfg(tmp_path, "train.steps=6", "openrlhf.dynamic_filtering=false", *SMALL))  # 6 x 4 without the filter


@pytest.mark.parametrize("preset", ["qwen2.5-math-7b-dapo", "qwen3-8b-dapo", "qwen3-30b-a3b-gspo"])
def test_the_data_tools_default_rows_are_enough_for_every_preset(preset, tmp_path):
    """What `python -m experiments.openrlhf.data` writes by default (whole passes up to data.preset_rows()) passes
    the dry-run plan and the in-allocation check of every preset (the old 10 passes, ~179k rows, did not)."""
    rows = data.preset_rows()
    (tmp_path / "train.jsonl").write_text("{}\n" * rows)
    cfg = load_config(PRESET.with_name(f"{preset}.yaml"), [f"task.train_data={tmp_path / 'train.jsonl'}"])
    plan = plan_run(cfg)
    assert plan.rows_ok and plan.rows_written == rows >= plan.rows_needed
    check_data(cfg)
    assert 10 * 17_917 < rows  # DAPO-Math-17k's distinct problems x the old 10 passes


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


class Launched:
    """Stands in for the two GPU processes the backend starts (OpenRLHF's trainer and the vLLM evaluator), which
    cannot run on CPU: records each command and, for the trainer, logs ``steps`` metrics rows and writes
    final_hf as OpenRLHF does."""

    def __init__(self, rd, steps):
        self.rd, self.steps, self.commands = rd, steps, []

    def __call__(self, argv, log, env=None):
        self.commands.append(argv[2])
        log.touch()  # as _run_logged: the process's output goes there
        if argv[2] == "nsr.openrlhf.launch":
            self.rd.append("metrics.jsonl", [{"step": s} for s in range(1, self.steps + 1)])
            (self.rd.path / "ckpt" / "final_hf").mkdir(parents=True, exist_ok=True)
            (self.rd.path / "ckpt" / "_actor" / f"global_step{self.steps}").mkdir(parents=True, exist_ok=True)


def _small_run(tmp_path, monkeypatch, steps_logged):
    from experiments.openrlhf import backend

    (tmp_path / "train.jsonl").write_text("{}\n" * 24)
    cfg = _cfg(tmp_path, "train.steps=2", *SMALL, "eval.every=0", "openrlhf.save_steps=1")
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    launched = Launched(rd, steps_logged)
    monkeypatch.setattr(backend, "_run_logged", launched)
    return backend, cfg, rd, launched


def test_a_run_that_stops_before_train_steps_is_not_done(tmp_path, monkeypatch):
    """OpenRLHF ends quietly when its prompts run out; the backend raises instead of letting the run be marked
    done (run() records status failed), and never evaluates it."""
    backend, cfg, rd, launched = _small_run(tmp_path, monkeypatch, steps_logged=1)
    with pytest.raises(RuntimeError, match="stopped at step 1 of train.steps=2.*the run is not done"):
        backend.run_openrlhf(cfg, rd)
    assert launched.commands == ["nsr.openrlhf.launch"]


def test_a_requeued_run_whose_training_ended_goes_straight_to_evaluation(tmp_path, monkeypatch):
    backend, cfg, rd, launched = _small_run(tmp_path, monkeypatch, steps_logged=2)
    backend.run_openrlhf(cfg, rd)
    assert launched.commands == ["nsr.openrlhf.launch", "experiments.evaluation.math"]
    assert not (rd.path / "ckpt").exists()  # keep_checkpoint false: everything deleted after evaluation
    backend.run_openrlhf(cfg, rd)  # requeued after its checkpoints were deleted, before it was marked done
    assert launched.commands[2:] == ["experiments.evaluation.math"]  # no second training
    assert [r["step"] for r in read_jsonl(rd.metrics_path)] == [1, 2]
