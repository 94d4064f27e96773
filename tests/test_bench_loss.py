"""experiments.bench_loss at a tiny size: the table has every rule and OpenRLHF, with sane columns.

No timing is asserted (timings belong to the benchmark's report, not to pass/fail tests).
"""

import json
import math

import pytest
import torch

import nsr
from experiments import bench_loss


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_main_prints_every_rule_with_ratios_and_memory(level, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--B", "4", "--T", "64", "--repeats", "2", "--warmup", "1", "--level", level, "--json", str(out)]
    result = bench_loss.main(argv)
    names = [r["name"] for r in result["rows"]]
    assert names == ["openrlhf", *nsr.RULES]
    by_name = {r["name"]: r for r in result["rows"]}
    for r in result["rows"]:
        assert math.isfinite(r["median_ms"]) and r["median_ms"] > 0
        assert r["vs_hard"] == pytest.approx(r["median_ms"] / by_name["hard"]["median_ms"])
        assert r["vs_openrlhf"] == pytest.approx(r["median_ms"] / by_name["openrlhf"]["median_ms"])
        assert r["peak_mb"] > 0 and r["saved_mb"] >= 0
    assert by_name["hard"]["vs_hard"] == 1.0 and by_name["openrlhf"]["vs_openrlhf"] == 1.0
    # hard and OpenRLHF agree on what is clipped: the two cases ran on the same batch
    assert by_name["hard"]["clip_frac"] == pytest.approx(by_name["openrlhf"]["clip_frac"], abs=1e-6)
    assert by_name["nsr"]["rescue_frac"] <= by_name["nsr"]["clip_frac"]
    printed = capsys.readouterr().out
    for name in names:
        assert f"| {name} |" in printed
    assert "x hard" in printed and "x OpenRLHF" in printed and "peak extra MB" in printed
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["setup"]["level"] == level and result["setup"]["repeats"] == 2


def test_inputs_are_padded_with_advantages_of_both_signs_and_zero():
    logp, old, adv, mask = bench_loss.make_inputs(16, 256, torch.float32, spread=0.15)
    lens = mask.sum(-1)
    assert lens.max() == 256 and lens.min() < 256 and lens.min() >= 256 // 8  # right padding, spread lengths
    assert torch.equal(mask, torch.arange(256)[None, :] < lens[:, None])
    per_row = adv[:, 0]
    assert torch.equal(adv, per_row[:, None].expand_as(adv))  # one advantage per response
    assert (per_row > 0).any() and (per_row < 0).any() and (per_row == 0).any()
    assert logp.requires_grad and not old.requires_grad


def test_default_spread_clips_a_few_percent():
    """The README's setting: 3-8% of the valid tokens clipped by hard at the default spread."""
    logp, old, adv, mask = bench_loss.make_inputs(64, 1024, torch.float32, spread=bench_loss.DEFAULT_SPREAD["token"])
    _, m = nsr.policy_loss(logp, old, adv, mask, nsr.LossConfig(rule="hard"))
    assert 0.03 <= m["clip_frac"].item() <= 0.08


def test_peak_bytes_sees_a_temporary_allocation():
    n = 1 << 20

    def alloc():
        x = torch.empty(n, dtype=torch.float32)  # 4 MiB, freed on return
        return x.sum()

    assert bench_loss.peak_bytes(alloc) >= 4 * n
    assert bench_loss.peak_bytes(lambda: None) < 4 * n


@pytest.mark.parametrize("argv, key", [(["--B", "0"], "--B"), (["--repeats", "0"], "--repeats")])
def test_bad_arguments_name_the_option(argv, key, capsys):
    with pytest.raises(SystemExit):
        bench_loss.parse_args(argv)
    assert key in capsys.readouterr().err
