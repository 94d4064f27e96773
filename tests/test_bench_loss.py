"""experiments.bench_loss at a tiny size: the table has every rule and OpenRLHF, with sane columns.

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
from experiments import bench_loss


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_main_prints_every_rule_with_ratios_and_memory(level, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--B", "4", "--T", "64", "--repeats", "2", "--warmup", "1", "--level", level, "--json", str(out)]
    argv += ["--threads", "1", "--clock", "cpu"] if level == "sequence" else []
    result = bench_loss.main(argv)
    names = [r["name"] for r in result["rows"]]
    assert names == ["openrlhf", *nsr.RULES]
    by_name = {r["name"]: r for r in result["rows"]}
    for r in result["rows"]:
        assert math.isfinite(r["median_ms"]) and r["median_ms"] > 0
        assert r["vs_hard"] == pytest.approx(r["median_ms"] / by_name["hard"]["median_ms"])
        assert r["vs_openrlhf"] == pytest.approx(r["median_ms"] / by_name["openrlhf"]["median_ms"])
        assert r["vs_hard_min"] == pytest.approx(r["min_ms"] / by_name["hard"]["min_ms"])
        assert r["peak_mb"] > 0 and r["saved_mb"] >= 0 and 0 < r["min_ms"] <= r["median_ms"]
    assert by_name["hard"]["vs_hard"] == 1.0 and by_name["openrlhf"]["vs_openrlhf"] == 1.0
    # hard and OpenRLHF agree on what is clipped: the two cases ran on the same batch
    assert by_name["hard"]["clip_frac"] == pytest.approx(by_name["openrlhf"]["clip_frac"], abs=1e-6)
    assert by_name["nsr"]["rescue_frac"] <= by_name["nsr"]["clip_frac"]
    printed = capsys.readouterr().out
    for name in names:
        assert f"| {name} |" in printed
    assert "x hard" in printed and "x OpenRLHF" in printed and "x hard (min)" in printed and "peak MB" in printed
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["setup"]["level"] == level and result["setup"]["repeats"] == 2


def test_command_line_with_kept_heap(tmp_path):
    """The module runs as a script (its own process, so glibc's mallopt does not touch the test process)."""
    out = tmp_path / "bench.json"
    argv = ["--B", "4", "--T", "64", "--repeats", "2", "--threads", "1", "--clock", "cpu", "--keep-heap"]
    done = subprocess.run(
        [sys.executable, "-m", "experiments.bench_loss", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr
    assert "kept heap" in done.stdout and "| nsr |" in done.stdout
    result = json.loads(out.read_text())
    assert result["setup"]["keep_heap"] and result["setup"]["threads"] == 1
    assert [r["name"] for r in result["rows"]] == ["openrlhf", *nsr.RULES]


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
    """The README's setting: 3-8% of the valid tokens (of the sequences) clipped by hard at the default spread."""
    logp, old, adv, mask = bench_loss.make_inputs(64, 4096, torch.float32, bench_loss.DEFAULT_SPREAD[level])
    _, m = nsr.policy_loss(logp.detach(), old, adv, mask, nsr.LossConfig(rule="hard", level=level))
    assert 0.03 <= m["clip_frac"].item() <= 0.08


def test_peak_bytes_sees_a_temporary_allocation():
    n = 1 << 20

    def alloc():
        x = torch.empty(n, dtype=torch.float32)  # 4 MiB, freed on return
        return x.sum()

    assert bench_loss.peak_bytes(alloc) >= 4 * n
    assert bench_loss.peak_bytes(lambda: None) < 4 * n


@pytest.mark.parametrize(
    "argv, key",
    [(["--B", "0"], "--B"), (["--repeats", "0"], "--repeats"), (["--clock", "cpu", "--threads", "2"], "--clock")],
)
def test_bad_arguments_name_the_option(argv, key, capsys):
    with pytest.raises(SystemExit):
        bench_loss.parse_args(argv)
    assert key in capsys.readouterr().err


# ---------------------------------------------------------------- the fast paths vs a plain reference
# The benchmark drove nsr.objectives to float masks, lerp selections and a rank-based push-out. This plain
# implementation of method.md (bool masks, nonzero, one draw per token in row-major order; at sequence level
# one draw per sequence) must give the same loss bit for bit and the same gradient.
def reference(logp, old, adv, mask, cfg, seed):
    """(loss, d sum(loss) / d logp, rescue count, push-out count) of nsr / pushout / nsr_pushout."""
    g = torch.Generator().manual_seed(seed)
    B, T = logp.shape
    d, lo, hi = cfg.delta, cfg.low, cfg.high
    adv = torch.where(mask, adv, 0.0)
    lr = torch.where(mask, logp - old, 0.0)
    n_tok = mask.sum(-1, keepdim=True)
    u = lr if cfg.level == "token" else lr.sum(-1, keepdim=True) / n_tok.clamp(min=1)
    r = u.clamp(-20, 20).exp().expand(B, T)
    surr1, surr2 = r * adv, r.clamp(lo, hi) * adv
    clipped = surr2 < surr1
    loss, coef = -torch.minimum(surr1, surr2), torch.where(clipped, 0.0, -surr1)

    def draws(tokens):  # z for the flat token indices, in order
        shape = (B,) if cfg.level == "sequence" else tokens.shape
        z = torch.rand(shape, generator=g, dtype=logp.dtype).mul_(2 * d).add_(1 - d)
        return z[tokens // T] if cfg.level == "sequence" else z

    def inside(rz, a):
        return torch.where(a > 0, rz <= hi, rz >= lo)

    n_resc = n_push = 0
    if cfg.rule in ("nsr", "nsr_pushout"):
        idx = clipped.flatten().nonzero().squeeze(1)
        if len(idx):
            rr, a = r.flatten()[idx], adv.flatten()[idx]
            rz = rr * draws(idx)
            ok = inside(rz, a)
            value = -((rz if cfg.executor == "noisy" else rr) * a)
            loss.view(-1)[idx[ok]], coef.view(-1)[idx[ok]] = value[ok], value[ok]
            n_resc = int(ok.sum())
    if cfg.rule in ("pushout", "nsr_pushout") and d > 0:
        reach = (r.clamp(lo / (1 - d), hi / (1 + d)) * adv < surr1) if lo / (1 - d) < hi / (1 + d) else adv != 0
        idx = (reach & ~clipped).flatten().nonzero().squeeze(1)
        if len(idx):
            out = ~inside(r.flatten()[idx] * draws(idx), adv.flatten()[idx])
            coef.view(-1)[idx[out]] = 0.0
            n_push = int(out.sum())
    grad = coef if cfg.level == "token" else (coef.sum(-1, keepdim=True) / n_tok.clamp(min=1)).expand(B, T)
    return loss, torch.where(mask, grad, 0.0), n_resc, n_push


PUSH_CASES = [("token", dl) for dl in (0.05, 0.2, 0.3, 0.5)] + [("sequence", dl) for dl in (2e-4, 4e-4, 1e-3)]


@pytest.mark.parametrize("level, delta", PUSH_CASES)
@pytest.mark.parametrize("rule", ["nsr", "pushout", "nsr_pushout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_paths_equal_the_plain_reference(level, delta, rule, dtype):
    acted = 0
    spread = 0.3 if level == "token" else 0.002
    for seed in range(3):
        *inputs, mask = bench_loss.make_inputs(64, 64, dtype, spread, seed=seed)
        logp, old, adv = (t.detach() for t in inputs)
        for executor in ("noisy", "clean"):
            cfg = nsr.LossConfig(rule=rule, level=level, delta=delta, executor=executor)
            lp = logp.clone().requires_grad_()
            loss, m = nsr.policy_loss(lp, old, adv, mask, cfg, generator=torch.Generator().manual_seed(seed))
            loss.sum().backward()
            ref_loss, ref_grad, n_resc, n_push = reference(logp, old, adv, mask, cfg, seed)
            assert torch.equal(loss.detach(), ref_loss)
            if level == "token":
                assert torch.equal(lp.grad, ref_grad)
            else:  # the same sum over a sequence's tokens, in another order
                torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0)
            n = mask.sum().item()
            assert m["rescue_frac"].item() == pytest.approx(n_resc / n)
            assert m["pushout_frac"].item() == pytest.approx(n_push / n)
            acted += n_resc + n_push
    assert acted > 0  # the batches reach the rule's rescue / push-out branches
