"""Stage D's readout (analysis/stage_d.py; python -m analysis.regime ROOT --stage d): the registered paired decision,
on real run folders (the delta sweep's committed hard and nsr-delta0.2 runs of the tiny preset, seeds 0-4, stand in
for the stage's pairs under a plan naming them), and no look at any evaluation before every planned run is done."""

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

from analysis import regime, stage_d
from experiments.rundir import REPO_ROOT

DELTA = REPO_ROOT / "results" / "runs" / "delta"
SEEDS = [0, 1, 2, 3, 4]


def _plan(tmp_path: Path, **change) -> Path:
    plan = {
        "sealed": True,
        "sweep": "delta",
        "control": "hard",
        "treatment": "nsr",
        "seeds": SEEDS,
        "primary": {"decoding": "greedy", "benchmark": "countdown3", "window": [0.5, 1.0]},
        "alpha": 0.05,
        "sesoi": 0.03,
        "secondary": {"metrics": ["clip_frac", "reward_mean", "no_such_column"]},
    } | change
    path = tmp_path / "regime.yaml"
    path.write_text(yaml.safe_dump({"stage_d": plan}))
    return path


def _runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for seed in SEEDS:
        for pattern in (f"hard-s{seed}-*", f"nsr-delta0.2-s{seed}-*"):
            (src,) = DELTA.glob(pattern)
            shutil.copytree(src, root / src.name)
    return root


def _greedy(folder: Path, steps) -> float:
    """The primary metric recomputed from the raw file: mean over ``steps`` of the greedy accuracy."""
    with gzip.open(folder / "eval.jsonl.gz", "rt") as f:
        rows = [json.loads(x) for x in f]
    return float(np.mean([np.mean([r["correct"] for r in rows if r["step"] == s and r["decoding"] == "greedy"])
                          for s in steps]))  # fmt: skip


def test_the_registered_decision_on_whole_pairs(tmp_path):
    root, plan = _runs(tmp_path), _plan(tmp_path)
    out = stage_d.readout(root, plan)
    assert out["other"] == [] and all(p["state"] == "done" for p in out["progress"])
    assert all(v == [200, 300, 400] for v in out["steps"].values())  # window [0.5, 1] of 400 steps
    d = []
    for pair in out["pairs"]:
        (hard,) = root.glob(f"hard-s{pair['seed']}-*")
        (nsr,) = root.glob(f"nsr-delta0.2-s{pair['seed']}-*")
        assert pair["control"] == pytest.approx(_greedy(hard, (200, 300, 400)), abs=1e-12)
        assert pair["treatment"] == pytest.approx(_greedy(nsr, (200, 300, 400)), abs=1e-12)
        d.append(pair["treatment"] - pair["control"])
    dec = out["decision"]
    half = stats.t.ppf(0.975, 4) * np.std(d, ddof=1) / np.sqrt(5)
    assert dec["n"] == 5 and dec["mean"] == pytest.approx(np.mean(d))
    assert dec["ci"] == pytest.approx((np.mean(d) - half, np.mean(d) + half))
    assert out["outcome"] == dec["verdict"] in stage_d.VERDICTS
    sec = out["secondary"]
    assert {"clip_frac", "reward_mean", "neg_reach", "zone_per_token"} <= set(sec["hard"])
    assert "no_such_column" not in sec["hard"] and "resampling_factor" not in sec["hard"]  # no dynamic sampling
    text = stage_d.markdown(out)
    assert f"Decision: {dec['verdict']}" in text and "| 3 |" in text


def test_nothing_is_read_before_every_planned_run_is_done(tmp_path, monkeypatch):
    root, plan = _runs(tmp_path), _plan(tmp_path)
    (last,) = root.glob("nsr-delta0.2-s4-*")
    status = json.loads((last / "status.json").read_text())
    (last / "status.json").write_text(json.dumps(status | {"state": "running"}))

    def no_look(*a, **k):
        raise AssertionError("an evaluation or metric was read before the stage is complete")

    monkeypatch.setattr(stage_d, "primary_metric", no_look)
    monkeypatch.setattr(stage_d, "secondary", no_look)
    out = stage_d.readout(root, plan)
    assert out["outcome"] == "incomplete" and "decision" not in out and "pairs" not in out
    assert [p["state"] for p in out["progress"]].count("done") == 9
    text = stage_d.markdown(out)
    assert "In progress: 9 of 10 runs done" in text and "Decision" not in text
    shutil.rmtree(last)
    assert stage_d.readout(root, plan)["progress"][-1]["state"] is None
    assert stage_d.readout(tmp_path / "none", plan)["outcome"] == "not run"


def test_bad_folders_and_plans_are_refused(tmp_path):
    root, plan = _runs(tmp_path), _plan(tmp_path)
    (src,) = root.glob("hard-s0-*")
    shutil.copytree(src, root / "hard-s0-copy")
    with pytest.raises(stage_d.StageDError, match="two runs of arm hard seed 0"):
        stage_d.readout(root, plan)
    shutil.rmtree(root / "hard-s0-copy")
    with pytest.raises(stage_d.StageDError, match=r"primary.decoding='best' is not valid; allowed: greedy, sampled"):
        stage_d.readout(root, _plan(tmp_path, primary={"decoding": "best", "window": [0.5, 1]}))
    with pytest.raises(stage_d.StageDError, match="stage_d lacks sesoi"):
        data = yaml.safe_load(plan.read_text())
        del data["stage_d"]["sesoi"]
        plan.write_text(yaml.safe_dump(data))
        stage_d.readout(root, plan)
    # an evaluated step with fewer problems than step 0 is an error, not a mean over less
    (src,) = root.glob("nsr-delta0.2-s1-*")
    with gzip.open(src / "eval.jsonl.gz", "rt") as f:
        rows = [json.loads(x) for x in f]
    gone = rows[0]["problem_id"]
    rows = [r for r in rows if not (r["step"] == 300 and r["decoding"] == "greedy" and r["problem_id"] == gone)]
    with gzip.open(src / "eval.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with pytest.raises(stage_d.StageDError, match="step 300 evaluated 511 problems, step 0 512"):
        stage_d.readout(root, _plan(tmp_path))


@pytest.mark.parametrize(
    "d,verdict",
    [
        ([0.05, 0.06, 0.04, 0.05, 0.07], "better"),
        ([-0.05, -0.06, -0.04, -0.05, -0.07], "worse"),
        ([0.001, -0.002, 0.003, 0.0, -0.001], "equivalent"),
        ([0.1, -0.1, 0.05, -0.08, 0.02], "inconclusive"),
        ([0.05], "inconclusive"),  # one pair: no interval
    ],
)
def test_the_rule(d, verdict):
    assert stage_d.decide(np.array(d), alpha=0.05, sesoi=0.03)["verdict"] == verdict


def test_the_cli_through_analysis_regime(tmp_path, capsys):
    root, plan = _runs(tmp_path), _plan(tmp_path)
    assert regime.main([str(root), "--stage", "d", "--regime", str(plan)]) == 0
    assert "Decision: " in capsys.readouterr().out
    (tmp_path / "other.yaml").write_text(yaml.safe_dump({"stage_r0": {"sweep": "regime_r0"}}))
    assert stage_d.main([str(root), "--regime", str(tmp_path / "other.yaml")]) == 2
    assert "no stage_d section (stage D is not registered)" in capsys.readouterr().err
