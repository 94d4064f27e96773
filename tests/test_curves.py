"""Live curves (``logging.report_to``, experiments/curves.py): a tiny and a trl run write TensorBoard events under
RUN/tensorboard/ that TensorBoard's own reader returns, with the same scalar names in both backends, the values of
the run folder's rows, and the premise meter's scalars under ``premise/``; the field is not part of the run id."""

from __future__ import annotations

import pytest

from experiments.config import ConfigError, load_config
from experiments.run import preflight, run
from experiments.rundir import REPO_ROOT, RunDir, read_jsonl, read_rows
from nsr.premise import RATE_KEYS

TINY = REPO_ROOT / "sweeps" / "presets" / "tiny-smoke.yaml"
TRL = REPO_ROOT / "sweeps" / "presets" / "trl-tiny.yaml"
SHORT = ["train.steps=2", "eval.every=1", "eval.n_prompts=16", "loss.rule=nsr", "logging.report_to=tensorboard"]
SHARED = {"train/reward_mean", "train/clip_frac_low", "train/clip_frac_high", "train/entropy", "train/grad_norm",
          *(f"premise/{k}" for k in RATE_KEYS), "premise/tokens"}  # fmt: skip
"""The scalars both backends write (reward, clip fractions per side, entropy, grad norm, the premise meter)."""


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} read with TensorBoard's own EventAccumulator from every event file under ``folder``."""
    from tensorboard.backend.event_processing import event_accumulator

    files = sorted(folder.rglob("events.out.tfevents.*"))
    assert files, f"no event file under {folder}"
    out: dict[str, dict[int, float]] = {}
    for f in files:
        acc = event_accumulator.EventAccumulator(str(f), size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def check_against_the_run_folder(rd: RunDir) -> dict[str, dict[int, float]]:
    got = tensorboard_scalars(rd.path / "tensorboard")
    assert SHARED <= set(got), sorted(SHARED - set(got))
    metrics = read_jsonl(rd.metrics_path)
    assert [r["step"] for r in metrics] == [1, 2]
    for r in metrics:
        for key in ("reward_mean", "clip_frac_low", "clip_frac_high", "entropy", "grad_norm"):
            assert got[f"train/{key}"][r["step"]] == pytest.approx(r[key], rel=1e-6, abs=1e-7), key
    bins, _ = read_rows(rd.log_path("ratio_bins.jsonl"))
    for b in bins:
        zone = sum(b["pos_clipped"][:-1]) / b["tokens"]
        assert got["premise/tokens"][b["step"]] == b["tokens"] > 0
        assert got["premise/pos_clipped_zone"][b["step"]] == pytest.approx(zone, rel=1e-6, abs=1e-9)
    evals = [t for t in got if t.startswith("eval/")]
    assert evals and all(set(got[t]) == {0, 1, 2} for t in evals)  # step 0 and each step (eval.every=1)
    return got


def test_report_to_is_no_part_of_the_run_id_and_bad_values_are_refused():
    a = load_config(TINY)
    b = load_config(TINY, ["logging.report_to=tensorboard"])
    assert a.run_hash() == b.run_hash() and b.logging.report_to == "tensorboard" and a.logging.report_to == "none"
    with pytest.raises(
        ConfigError, match=r"logging\.report_to='mlflow' is not valid; allowed: none, tensorboard, wandb"
    ):
        load_config(TINY, ["logging.report_to=mlflow"])


def test_wandb_where_it_cannot_act_is_refused_before_work():
    import importlib.util

    cfg = load_config(TINY, ["logging.report_to=wandb"])
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match=r"logging\.report_to='wandb' needs the wandb package"):
            preflight(cfg)
    orl = load_config(REPO_ROOT / "sweeps" / "presets" / "openrlhf-cpu.yaml", ["logging.report_to=wandb"])
    with pytest.raises(ConfigError, match=r"report_to='wandb' is not valid with backend='openrlhf'"):
        preflight(orl)


@pytest.mark.slow
def test_tiny_run_writes_tensorboard_events(run_env, tmp_path):
    rd = RunDir(tmp_path / "run")
    run(load_config(TINY, SHORT), rd.path, progress=False)
    got = check_against_the_run_folder(rd)
    assert "eval/countdown3/greedy" in got


@pytest.mark.slow
def test_trl_run_writes_the_same_scalars(run_env, tmp_path):
    pytest.importorskip("trl")
    rd = RunDir(tmp_path / "run")
    small = ["sft.steps=150", "sft.warmup=50", "eval.n_samples=2"]
    run(load_config(TRL, [*SHORT, *small]), rd.path, progress=False)
    check_against_the_run_folder(rd)
