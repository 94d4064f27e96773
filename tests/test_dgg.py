"""Dynamic Gradient Gating (nsr.gating; skipped updates in experiments/tiny/train.py) in the tiny update loop.

The gate's criterion by hand; a surge in the real loop gates updates (no optimizer step, weights untouched); a gate
that never fires leaves every number of the step as without it; a crashed and resumed DGG run ends with the rows
of an uninterrupted one. About 10 s on one core (tiny model, 4-prompt rollouts, a 20-step warm start).
"""

import math
import os

import pytest
import torch

from experiments.config import ConfigError, load_config
from experiments.models.tiny import build_model, lm_head_grad_norm
from experiments.run import run
from experiments.rundir import REPO_ROOT, RunDir, read_jsonl
from experiments.tasks.countdown import get_task
from experiments.tiny import train as tiny_train
from nsr.gating import GradientGate
from nsr.seeds import generator

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

SMOKE = REPO_ROOT / "sweeps" / "presets" / "tiny-smoke.yaml"
SMALL = [
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "train.epochs=2",
    "train.minibatches=2",
    "train.lr=3e-3",
    "eval.n_prompts=8",
    "eval.n_samples=2",
    "sft.steps=20",
    "sft.warmup=5",
]
LOOP = SMALL + ["advantages.kind=random_reward"]  # an untrained model earns no reward: coin flips give a gradient


# ---------------------------------------------------------------- the criterion
def test_gate_fires_on_a_surge_past_k_times_the_running_median():
    gate = GradientGate(k=3.0, window=4)
    assert gate.gate(100.0, first=False) is False  # nothing to compare with yet
    gate.history = []
    for norm in (1.0, 2.0, 1.0, 2.0):
        assert gate.gate(norm, first=False) is False
    assert gate.threshold() == pytest.approx(3.0 * 1.5)  # median of (1, 2, 1, 2)
    assert gate.gate(4.4, first=False) is False  # below 4.5
    # window is now (2, 1, 2, 4.4): median 2, threshold 6
    assert gate.gate(6.5, first=False) is True
    assert gate.history == [1.0, 2.0, 4.4, 6.5]  # a gated norm enters the window too


def test_first_update_of_a_rollout_is_never_gated_and_non_finite_norms_are():
    gate = GradientGate(k=3.0, window=20)
    for _ in range(5):
        gate.gate(1.0, first=False)
    assert gate.gate(1000.0, first=True) is False
    assert gate.gate(math.nan, first=False) is True
    assert gate.gate(math.inf, first=False) is True
    assert all(math.isfinite(v) for v in gate.history) and len(gate.history) == 6


def test_gate_state_round_trips_and_bad_settings_are_refused():
    gate = GradientGate(k=2.0, window=3)
    for v in (1.0, 5.0, 2.0, 3.0):
        gate.gate(v, first=False)
    other = GradientGate(k=2.0, window=3)
    other.load_state_dict(gate.state_dict())
    assert other.history == [5.0, 2.0, 3.0] and other.threshold() == gate.threshold() == 6.0
    with pytest.raises(ValueError, match="dgg_k"):
        GradientGate(k=1.0)
    with pytest.raises(ValueError, match="dgg_window"):
        GradientGate(window=0)
    with pytest.raises(ConfigError, match=r"train\.dgg_k=0\.5 is not valid"):
        load_config(SMOKE, ["train.dgg_k=0.5"])
    with pytest.raises(ConfigError, match=r"train\.dgg_window=0 is not valid"):
        load_config(SMOKE, ["train.dgg_window=0"])
    with pytest.raises(ConfigError, match=r"train\.dgg=True is not valid; allowed: false \(DGG is an option of the"):
        load_config(REPO_ROOT / "sweeps" / "presets" / "trl-tiny.yaml", ["train.dgg=true"])


def test_lm_head_norm_is_the_tied_embedding_gradient():
    cfg = load_config(SMOKE, SMALL)
    model = build_model(cfg.model, generator(0, "init"))
    head = model.get_output_embeddings().weight
    assert head is model.get_input_embeddings().weight  # tied: one matrix
    assert lm_head_grad_norm(model) == 0.0
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    assert lm_head_grad_norm(model) == pytest.approx(float(head.grad.norm()))


# ---------------------------------------------------------------- in the update loop
def _step(cfg, gate, seed=0):
    model = build_model(cfg.model, generator(seed, "init"))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=cfg.train.adam_betas)
    row, _ = tiny_train.rl_step(model, opt, get_task(cfg.task.name), cfg, step=1, gate=gate)
    return model, opt, row


def test_a_surge_gates_updates_in_the_loop():
    cfg = load_config(SMOKE, LOOP + ["train.dgg=true"])
    updates = cfg.train.epochs * cfg.train.minibatches
    gate = GradientGate(k=3.0, window=20)
    gate.history = [1e-9] * 20  # a calm past: every real norm is a surge
    model, opt, row = _step(cfg, gate)
    assert row["dgg_gated"] == updates - 1  # all but the rollout's first update
    assert row["lm_head_grad_norm"] > 3e-9
    steps = {int(s["step"]) for s in opt.state.values()}
    assert steps == {1}  # Adam stepped once: gated updates never reached the optimizer
    # weights move only through opt.step, so they hold the first update alone: not those of the ungated loop
    ungated_model, _, _ = _step(cfg, GradientGate(k=3.0, window=20))
    assert any(not torch.equal(a, c) for a, c in zip(model.parameters(), ungated_model.parameters()))


def test_a_gate_that_never_fires_changes_nothing():
    cfg = load_config(SMOKE, LOOP)
    _, _, plain = _step(cfg, None)
    quiet = GradientGate(k=3.0, window=20)
    quiet.history = [1e9] * 20
    _, _, gated = _step(cfg, quiet)
    assert gated["dgg_gated"] == 0
    extra = {"dgg_gated", "lm_head_grad_norm"}
    assert set(gated) - set(plain) == extra
    assert {k: v for k, v in gated.items() if k not in extra} == plain


def test_resumed_dgg_run_matches_an_uninterrupted_one(tmp_path, monkeypatch):
    monkeypatch.setenv("NSR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("NSR_THREADS", os.environ.get("NSR_THREADS", "1"))
    over = LOOP + [
        "train.steps=4",
        "train.dgg=true",
        "train.dgg_k=1.05",  # fires often, so the resumed window matters
        "train.dgg_window=3",
        "eval.every=0",
        "logging.checkpoint_every=2",
        "logging.progress=false",
    ]
    cfg = load_config(SMOKE, over)
    whole = RunDir(tmp_path / "whole")
    run(cfg, whole.path, progress=False)
    rows = [{k: v for k, v in r.items() if k != "wall_s"} for r in read_jsonl(whole.metrics_path)]
    assert sum(r["dgg_gated"] for r in rows) > 0

    crashed = RunDir(tmp_path / "crashed")
    real_step = tiny_train.rl_step

    def crash_at_3(model, opt, task, cfg, step, ref=None, gate=None):
        if step == 3:
            raise KeyboardInterrupt
        return real_step(model, opt, task, cfg, step, ref, gate)

    monkeypatch.setattr(tiny_train, "rl_step", crash_at_3)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, crashed.path, progress=False)
    assert torch.load(crashed.checkpoint_path, weights_only=True)["dgg"]["history"]
    monkeypatch.setattr(tiny_train, "rl_step", real_step)
    run(cfg, crashed.path, progress=False)
    again = [{k: v for k, v in r.items() if k != "wall_s"} for r in read_jsonl(crashed.metrics_path)]
    assert again == rows


def test_dgg_sweep_expands_on_tiny_and_cluster_presets_and_not_on_trl():
    from experiments.openrlhf.argv import build_command
    from experiments.sweep import SweepError, expand

    runs = expand("dgg")
    assert {r.meta["arm"] for r in runs} == {"hard", "nsr", "soft", "dgg", "nsr_dgg"} and len(runs) == 15
    assert {(r.meta["arm"], r.config.loss.rule) for r in runs if r.config.train.dgg} == {
        ("dgg", "hard"),
        ("nsr_dgg", "nsr"),
    }
    cluster = {r.meta["arm"]: r.config for r in expand("dgg", preset="qwen2.5-math-7b-dapo")}
    flags = build_command(cluster["nsr_dgg"], "/tmp/nsr-dgg-test", "x").nsr_argv
    assert (
        flags[flags.index("--nsr.dgg") + 1] == "True"
        and "--nsr.dgg" not in build_command(cluster["nsr"], "/tmp/nsr-dgg-test", "x").nsr_argv
    )
    with pytest.raises(SweepError, match=r"train\.dgg=True is not valid"):
        expand("dgg", preset="trl-tiny")
