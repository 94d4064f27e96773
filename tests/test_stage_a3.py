"""Stage A3 (analysis/regime.yaml, stage_a3): the sweep is the pre-registered regime and seeds; the planning numbers
written into the plan are what the committed mechanism files give; the readout decides only when every baseline run
counts, and then by the pre-registered one-sided t-test over the run means (checked against scipy directly)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from analysis import mechanism as A
from analysis import regime as R
from experiments.config import load_config
from experiments.sweep import expand, preset_file


def test_sweep_is_tl44_on_seeds_301_308_each_with_its_own_warm_start():
    a3, a2 = R.load_regime(stage="a3"), R.load_regime(stage="a2")
    tl44 = a2["candidates"]["tl44"]
    assert a3["overrides"] == tl44["overrides"] and a3["delta"] == tl44["delta"] == 0.2
    runs = expand(a3["sweep"])
    assert [r.config.seed for r in runs] == a3["seeds"] == list(range(301, 309))
    preset = preset_file(a3["base_preset"])
    for spec in runs:
        ov = {**a3["overrides"], "loss.delta": a3["delta"], "loss.rule": "hard", "seed": spec.config.seed}
        want = load_config(preset, [f"{k}={v}" for k, v in {**ov, "sft.seed": spec.config.seed}.items()])
        assert spec.config == want and spec.meta["arm"] == "hard" and spec.meta["point"] == {"regime": "tl44"}
    earlier = set(a2["seeds"]) | set(a2["gate_seeds"]) | {r.config.seed for r in expand("confirm")} | set(range(5))
    assert not earlier & set(a3["seeds"])


def test_planning_numbers_are_the_committed_files():
    """sd of the 6 per-run means of soft - hard (held-out), hard's change, MDE at n = 8 and power at the SESOI."""
    p = R.load_regime(stage="a3")["planning"]
    means, hard = [], []
    for f in ("results/mechanism/tiny-s0-2-steps4-200.jsonl", "results/mechanism/tiny-s3-5-steps204-320.jsonl"):
        states = A.load_states(f)
        for run in sorted({s["run"] for s in states}):
            mine = [s for s in states if s["run"] == run]
            means.append(np.mean([s["after"]["soft"] - s["after"]["hard"] for s in mine]))
            hard.append(np.mean([s["after"]["hard"] - s["before"] for s in mine]))
    assert means == pytest.approx(p["run_means_soft_minus_hard"], abs=1e-7)
    sd, h = float(np.std(means, ddof=1)), float(np.mean(hard))
    assert sd == pytest.approx(p["sd_run_means"], rel=1e-3) and h == pytest.approx(p["hard_change"], rel=1e-4)
    assert sd / h == pytest.approx(p["sd_relative"], abs=1e-3)
    assert A.mde_one_sided(8, sd / h) == pytest.approx(0.282, abs=1e-3)
    assert A.power_one_sided(0.1, sd / h, 8) == pytest.approx(p["power_at_sesoi_n8"], abs=0.005)
    assert A.n_one_sided(0.1, sd / h) == p["n_for_sesoi"]
    # the one-sided power is the noncentral t's tail beyond the one-sided critical value
    crit = sps.t.ppf(0.95, 7)
    assert A.power_one_sided(0.3, 1.0, 8) == pytest.approx(sps.nct.sf(crit, 7, 0.3 * math.sqrt(8)))


def _files(tmp_path, effects: dict[int, float], states=20, hard=1e-3):
    """Gate files of the pre-registered seeds: soft - hard = effects[seed] (+ a small per-state wobble)."""
    for seed, eff in effects.items():
        rows = [{"header": {"command": "x", "git_commit": "abc"}}]
        for k in range(states):
            wob = (k % 2 - 0.5) * 1e-5
            after = {"hard": 0.3 + hard, "soft": 0.3 + hard + eff + wob, "nsr": 0.3 + hard + eff / 2}
            met = {r: {"clip_frac": 0.03, "rescue_frac": 0.0, "grad_norm": 1.0, "dose": 0.001} for r in after}
            row = {"run": 0, "step": 20 * (k + 1), "before": math.nan, "after": dict.fromkeys(after, math.nan)}
            row.update(train_after=after, train_before=0.3, metrics=met, seed=seed, sft_seed=seed)
            rows.append(row)
        (tmp_path / f"tl44-s{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rs(done: list[int]):
    runs = expand("regime_a3")
    states = ["done" if r.config.seed in done else "running" for r in runs]
    return SimpleNamespace(runs=pd.DataFrame({"hash": [r.config.run_hash() for r in runs], "state": states}))


def test_readout_decides_only_when_complete_and_by_the_one_sided_t_test(tmp_path):
    seeds = list(range(301, 309))
    effects = dict(zip(seeds, [3e-4, 1e-4, 2e-4, 4e-4, 0.5e-4, 2.5e-4, 1.5e-4, 3e-4]))
    _files(tmp_path, effects)
    part = R.a3_readout(gates_dir=tmp_path, rs=_rs(seeds[:5]))
    assert not part["complete"] and part["counted"] == 5 and part["outcome"] == "pending"
    assert part["gate"]["passes"] is None and part["gate"]["runs"] == 5
    assert "Decision: none yet: 5 of 8" in R.a3_markdown(part)

    out = R.a3_readout(gates_dir=tmp_path, rs=_rs(seeds))
    g = out["gate"]
    assert out["complete"] and g["runs"] == 8 and g["states"] == 160
    means = np.array([effects[s] for s in seeds])  # the wobble averages out over 20 states
    t = sps.ttest_1samp(means, 0.0, alternative="greater")
    assert g["p"] == pytest.approx(t.pvalue, rel=1e-6) and g["passes"] and out["outcome"] == "passes"
    assert g["hard_change"] == pytest.approx(1e-3) and g["sesoi"] == pytest.approx(1e-4)
    assert g["mde"] == pytest.approx(A.mde_one_sided(8, float(np.std(means, ddof=1))))
    assert out["beside"]["mean"] == pytest.approx(means.mean() / 2)  # nsr - hard, reported, not decided on
    md = R.a3_markdown(out)
    assert "**passes" in md and "python -m analysis.mechanism results/mechanism/a3/tl44-s*.jsonl --gate soft" in md

    # a seed whose file misses states does not count; an all-negative effect is "harmful"
    _files(tmp_path, {s: -abs(e) for s, e in effects.items()})
    assert R.a3_readout(gates_dir=tmp_path, rs=_rs(seeds))["outcome"] == "harmful"
    _files(tmp_path, {301: 1e-4}, states=19)
    assert R.a3_readout(gates_dir=tmp_path, rs=_rs(seeds))["counted"] == 7


def test_a_null_effect_fails_underpowered_or_powered_by_the_mde(tmp_path):
    seeds = list(range(301, 309))
    noisy = dict(zip(seeds, [3e-4, -2e-4, 1e-4, -3e-4, 2e-4, -1e-4, 0.5e-4, -0.5e-4]))
    _files(tmp_path, noisy)  # SD 2e-4: MDE about 1.9e-4, above the SESOI 1e-4
    out = R.a3_readout(gates_dir=tmp_path, rs=_rs(seeds))
    assert out["outcome"] == "fails_underpowered" and out["gate"]["mde"] > out["gate"]["sesoi"]
    assert "not detected at this power" in R.a3_markdown(out)
    _files(tmp_path, noisy, hard=1e-2)  # the same spread against a ten times larger step: SESOI 1e-3 > MDE
    out = R.a3_readout(gates_dir=tmp_path, rs=_rs(seeds))
    assert out["outcome"] == "fails_powered" and out["gate"]["mde"] <= out["gate"]["sesoi"]
