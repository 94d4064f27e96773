"""Stage R0's readout (analysis.regime --stage r0): the pre-registered criteria read through the premise meter, on
real run folders (stage A2's committed tl44 hard runs stand in for R0's, under a copy of the plan naming their
seeds and length)."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from analysis import regime
from analysis.premise import read_run
from experiments.rundir import REPO_ROOT

A2 = REPO_ROOT / "results" / "runs" / "regime_a2"
SEEDS = (101, 102, 103)


def _plan(tmp_path: Path) -> Path:
    """analysis/regime.yaml with stage_r0's seeds and steps set to the stand-in runs'; every threshold as registered."""
    data = yaml.safe_load(regime.REGIME_FILE.read_text())
    data["stage_r0"]["seeds"] = list(SEEDS)
    data["stage_r0"]["fixed"]["steps"] = 400
    path = tmp_path / "regime.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _runs(tmp_path: Path, mixed: float | None) -> Path:
    """Copies of the stand-in runs; every metrics row's mixed_group_frac set to ``mixed`` (None: the field removed)."""
    root = tmp_path / "regime_r0"
    for seed in SEEDS:
        (src,) = A2.glob(f"hard-tl44-s{seed}-*")
        dst = root / src.name
        shutil.copytree(src, dst)
        rows = [json.loads(x) for x in (dst / "metrics.jsonl").read_text().splitlines()]
        rows = [{k: v for k, v in r.items() if k != "mixed_group_frac"} for r in rows]
        if mixed is not None:
            rows = [{**r, "mixed_group_frac": mixed} for r in rows]
        (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_r0_pools_the_premise_meter_and_applies_each_registered_threshold(tmp_path):
    plan = _plan(tmp_path)
    out = regime.r0_readout(_runs(tmp_path, mixed=0.75), plan)
    readings = [read_run(p) for p in sorted((tmp_path / "regime_r0").iterdir())]
    c = out["criteria"]
    for side in ("pos", "neg"):  # pooled reach = in-zone clipped tokens of all runs over all their clipped tokens
        n = sum(r[f"{side}_clipped"] for r in readings)
        assert c[f"reach_{side}"]["clipped"] == n > 100
        want = sum(r[f"{side}_reach"] * r[f"{side}_clipped"] for r in readings) / n
        assert c[f"reach_{side}"]["value"] == pytest.approx(want, rel=1e-12)
        assert c[f"reach_{side}"]["holds"] == (want >= 0.5)
    zone = sum(r["pos_zone_per_token"] + r["neg_zone_per_token"] for r in readings) / 3
    assert c["zone_mass"]["value"] == pytest.approx(zone, rel=1e-12) and c["zone_mass"]["holds"] == (zone >= 2e-3)
    assert c["signal"]["value"] == pytest.approx(0.75) and c["signal"]["holds"] and c["complete"]["holds"]
    assert out["outcome"] == ("qualifies" if all(v["holds"] for v in c.values()) else "fails")
    table = regime.r0_markdown(out)
    assert "| reach_neg |" in table and f"**Outcome: {out['outcome']}**" in table


def test_r0_signal_missing_or_low_fails(tmp_path):
    out = regime.r0_readout(_runs(tmp_path, mixed=None), _plan(tmp_path))
    assert out["criteria"]["signal"]["holds"] is False and out["outcome"] == "fails"
    shutil.rmtree(tmp_path / "regime_r0")
    out = regime.r0_readout(_runs(tmp_path, mixed=0.49), _plan(tmp_path))
    signal = out["criteria"]["signal"]
    assert signal["value"] == pytest.approx(0.49) and signal["holds"] is False and out["outcome"] == "fails"


def test_r0_not_run_and_incomplete(tmp_path):
    plan = _plan(tmp_path)
    out = regime.r0_readout(tmp_path / "nothing", plan)
    assert out["outcome"] == "not run" and "Not run yet" in regime.r0_markdown(out)
    root = _runs(tmp_path, mixed=0.75)
    running = sorted(root.iterdir())[0] / "status.json"
    running.write_text(json.dumps({**json.loads(running.read_text()), "state": "running"}))
    out = regime.r0_readout(root, plan)
    assert out["outcome"] == "incomplete" and len(out["runs"]) == 2 and out["pending"][0]["state"] == "running"
    assert list(out["criteria"]) == ["complete"]  # nothing read from part of the stage
    table = regime.r0_markdown(out)
    assert "In progress: 2 of 3 done" in table and f"Seeds without a done run: {SEEDS[0]}." in table
    assert "reach" not in table and "zone" not in table and "| running | 400 logged |" in table
    metrics = running.parent / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:37]))  # a run part-way: its progress
    assert "| running | 37 logged |" in regime.r0_markdown(regime.r0_readout(root, plan))
    running.write_text(json.dumps({**json.loads(running.read_text()), "state": "done"}))
    shutil.copy(A2 / running.parent.name / "metrics.jsonl", metrics)
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:399]))  # done, one row short
    out = regime.r0_readout(root, plan)
    assert out["outcome"] == "incomplete" and f"short of 400 steps: {running.parent.name} (399 rows)" in (
        regime.r0_markdown(out)
    )


def test_r0_cli(tmp_path, capsys):
    assert regime.main([str(_runs(tmp_path, mixed=0.5)), "--stage", "r0", "--regime", str(_plan(tmp_path))]) == 0
    assert "| signal | 0.5 | >= 0.5 | yes |" in capsys.readouterr().out
