"""``python -m experiments.trl.bench``: the kit's trl-backend step against TRL's own GRPOTrainer on the same model,
batch and GRPOConfig. Here on a tiny Qwen2 folder (tests/trl_tiny.py) with the SmolLM2 preset's task and loop; the
SmolLM2 numbers are in docs/testbed.md, "The real model"."""

import json

import pytest

pytest.importorskip("trl", reason="trl is installed by `make venv` (trl==1.16.0)")

import trl_tiny  # noqa: E402

from experiments.trl import bench  # noqa: E402

PRESET = "sweeps/presets/smollm2-trl-cpu.yaml"
SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
         "train.minibatches=2", "eval.n_prompts=2"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    with trl_tiny.one_thread_frozen_gc():
        yield trl_tiny.save_models(tmp_path_factory.mktemp("models"))["dense"]


@pytest.mark.parametrize("trainer", ["kit", "trl"])
def test_bench_times_each_rl_step_and_its_rollout(tiny_folder, trainer, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NSR_CACHE_DIR", str(tmp_path))  # the task files go here, not into the repo's cache/
    args = [PRESET, f"model.name={tiny_folder}", *SMALL, "--trainer", trainer, "--steps", "3", "--checkpoint"]
    assert bench.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["trainer"] == trainer
    assert len(out["step_s"]) == len(out["generate_s"]) == len(out["rollout_s"]) == 3
    # a rollout contains its generation, a step contains its rollout (and its 2 updates)
    for step, rollout, gen in zip(out["step_s"], out["rollout_s"], out["generate_s"], strict=True):
        assert 0 < gen <= rollout + 0.01 and rollout <= step + 0.01
    assert out["median_s_after_first"] > 0
    assert out["checkpoint_mb"] is not None  # --checkpoint saved one (None without it)
    assert out["peak_rss_gb"] > 0


def test_profile_splits_each_step_into_phases_and_parts(tiny_folder, capsys, tmp_path, monkeypatch):
    """--profile (experiments/trl/profile.py) on TRL's own trainer: the phases of a step add up to the step, the old
    log-prob pass, the updates' forward and backward and the optimizer are seen, and within them the model's parts
    (attention, MLP, the LM head's log-prob kernel), each with its phase's peak memory."""
    monkeypatch.setenv("NSR_CACHE_DIR", str(tmp_path))
    args = [PRESET, f"model.name={tiny_folder}", *SMALL, "--trainer", "trl", "--steps", "3", "--profile"]
    assert bench.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prof = out["profile"]
    assert prof["steps"] == 2 and set(prof["seconds"]) <= {"generation", "old_logprobs", "forward", "backward",
                                                            "optimizer", "other"}  # fmt: skip
    assert {"generation", "old_logprobs", "forward", "backward", "optimizer"} <= set(prof["seconds"])
    assert abs(sum(prof["seconds"].values()) - prof["total_s"]) <= 0.05 + 0.01 * prof["total_s"]
    for part in ("generation/mlp", "old_logprobs/lm_head", "forward/attention", "forward/lm_head", "backward/mlp",
                 "backward/attention",
                 "backward/lm_head"):  # fmt: skip
        assert part in prof["parts"], part
    assert all(v > 0 for v in prof["peak_rss_gb"].values())
