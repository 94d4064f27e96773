"""experiments.bench.loss at a tiny size: the table has every rule and OpenRLHF, with sane columns.

No timing is asserted (timings belong to the benchmark's report, not to pass/fail tests).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nsr
from experiments.bench import loss as bench_loss


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_main_prints_every_rule_with_ratios(level, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--B", "4", "--T", "64", "--repeats", "2", "--warmup", "1", "--level", level, "--json", str(out)]
    argv += ["--threads", "1", "--clock", "cpu"] if level == "sequence" else []
    result = bench_loss.main(argv)
    names = [r["name"] for r in result["rows"]]
    assert names == ["openrlhf", *(r for r in nsr.RULES if level in nsr.RULES.info(r)["levels"])]
    if level == "sequence":  # rules whose sources define no sequence-level form are left out, not run
        assert "gppo" not in names and "nsr" in names
    by_name = {r["name"]: r for r in result["rows"]}
    for r in result["rows"]:
        assert math.isfinite(r["median_ms"]) and r["median_ms"] > 0
        assert r["vs_hard"] == pytest.approx(r["median_ms"] / by_name["hard"]["median_ms"])
        assert r["vs_openrlhf"] == pytest.approx(r["median_ms"] / by_name["openrlhf"]["median_ms"])
        assert r["saved_mb"] >= 0 and 0 < r["min_ms"] <= r["median_ms"]
    assert by_name["hard"]["vs_hard"] == 1.0 and by_name["openrlhf"]["vs_openrlhf"] == 1.0
    # hard and OpenRLHF agree on what is clipped: the two cases ran on the same batch
    assert by_name["hard"]["clip_frac"] == pytest.approx(by_name["openrlhf"]["clip_frac"], abs=1e-6)
    assert by_name["nsr"]["rescue_frac"] <= by_name["nsr"]["clip_frac"]
    printed = capsys.readouterr().out
    for name in names:
        assert f"| {name} |" in printed
    assert "x hard" in printed and "x OpenRLHF" in printed and "saved MB" in printed and "slowest rule:" in printed
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["setup"]["level"] == level and result["setup"]["repeats"] == 2


def test_premise_adds_a_row_of_nsr_with_the_meter(capsys):
    result = bench_loss.main(["--B", "4", "--T", "64", "--repeats", "2", "--warmup", "1", "--premise"])
    by_name = {r["name"]: r for r in result["rows"]}
    assert [r["name"] for r in result["rows"]][-1] == "nsr+premise"  # after every rule, not counted as one
    assert by_name["nsr+premise"]["clip_frac"] == by_name["nsr"]["clip_frac"] > 0  # the same batch and rule
    assert by_name["nsr+premise"]["rescue_frac"] == by_name["nsr"]["rescue_frac"]  # the same stream
    assert "| nsr+premise |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_loss.main(["--premise", "--level", "sequence"])
    assert "--premise meters token-level ratios" in capsys.readouterr().err


@pytest.mark.slow
def test_command_line(tmp_path):
    """The module runs as a script."""
    out = tmp_path / "bench.json"
    argv = ["--B", "4", "--T", "64", "--repeats", "2", "--threads", "1", "--clock", "cpu"]
    done = subprocess.run(
        [sys.executable, "-m", "experiments.bench.loss", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr
    assert "| nsr |" in done.stdout and "target <= 2x" in done.stdout
    result = json.loads(out.read_text())
    assert result["setup"]["threads"] == 1 and result["setup"]["clock"] == "cpu"
    assert [r["name"] for r in result["rows"]] == ["openrlhf", *nsr.RULES]  # token level: every rule


def test_tiny_step_times_nsr_against_hard(tmp_path, capsys, monkeypatch):
    """--tiny-step on the smoke preset with a 10-step warm start in a temporary cache: a row per rule, nsr / hard."""
    monkeypatch.setenv("NSR_CACHE_DIR", str(tmp_path))
    preset = Path(__file__).resolve().parents[1] / "sweeps" / "presets" / "tiny-smoke.yaml"
    argv = ["--tiny-step", "--preset", str(preset), "--steps", "2", "--warmup-steps", "0", "--threads", "1"]
    argv += ["--set", "sft.steps=10", "--set", "rollout.prompts_per_step=4", "--set", "train.lr=0.01"]
    result = bench_loss.main([*argv, "--json", str(tmp_path / "step.json")])
    by_name = {r["name"]: r for r in result["rows"]}
    assert set(by_name) == {"hard", "nsr"} and by_name["hard"]["vs_hard"] == 1.0
    assert by_name["nsr"]["vs_hard"] == pytest.approx(by_name["nsr"]["median_ms"] / by_name["hard"]["median_ms"])
    assert all(r["median_ms"] > 0 and 0 <= r["clip_frac"] <= 1 for r in result["rows"])
    assert 0 <= by_name["nsr"]["rescue_frac"] <= by_name["nsr"]["clip_frac"]
    printed = capsys.readouterr().out
    assert "nsr / hard per RL step" in printed and "| nsr |" in printed


def test_inputs_are_padded_with_advantages_of_both_signs_and_zero():
    logp, old, adv, mask = bench_loss.make_inputs(16, 256, torch.float32, spread=0.15)
    lens = mask.sum(-1)
    assert lens.max() == 256 and lens.min() < 256 and lens.min() >= 256 // 8  # right padding, spread lengths
    assert torch.equal(mask, torch.arange(256)[None, :] < lens[:, None])
    per_row = adv[:, 0]
    assert torch.equal(adv, per_row[:, None].expand_as(adv))  # one advantage per response
    assert (per_row > 0).any() and (per_row < 0).any() and (per_row == 0).any()
    assert logp.requires_grad and not old.requires_grad


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_default_spread_clips_a_few_percent(level):
    """The benchmark's setting (results/README.md): 3-8% of the valid tokens (of the sequences) clipped by hard at
    the default spread."""
    logp, old, adv, mask = bench_loss.make_inputs(64, 4096, torch.float32, bench_loss.DEFAULT_SPREAD[level])
    _, m = nsr.policy_loss(logp.detach(), old, adv, mask, nsr.LossConfig(rule="hard", level=level))
    assert 0.03 <= m["clip_frac"].item() <= 0.08


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--B", "0"], "--B"),
        (["--repeats", "0"], "--repeats"),
        (["--clock", "cpu", "--threads", "2"], "--clock"),
        (["--steps", "0"], "--steps"),
        (["--tiny-step", "--preset", "/nonexistent.yaml"], "--preset"),
    ],
)
def test_bad_arguments_name_the_option(argv, key, capsys):
    with pytest.raises(SystemExit):
        bench_loss.parse_args(argv)
    assert key in capsys.readouterr().err
