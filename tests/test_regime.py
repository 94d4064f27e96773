"""The pre-registration (analysis/regime.yaml) and its sweeps agree, its criteria read fields the tiny backend
writes, and the stage-A readout (analysis.regime) computes them: on the committed tiny grid it finds what issue 12
measured (the tiny preset fails reach, clip and grad-clip). About 5 s (reads 6 committed run folders)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import nsr
from analysis import dose as D
from analysis import power as P
from analysis import regime as R
from experiments.config import load_config
from experiments.rundir import RunDir, read_rows
from experiments.sweep import expand, load_sweep, preset_file

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

REPO = Path(__file__).resolve().parents[1]
REGIME = R.load_regime()
GRID = REPO / "results" / "runs" / "delta"


def _planned_config(preset, cand: dict, arm: dict, **extra):
    """The RunConfig a plan gives one (candidate, arm) with ``extra`` overrides (seeds): the candidate's overrides and
    delta, the arm's rule, and for a widening arm eps_low / eps_high widened by ``widen_by`` from the candidate's."""
    ov = {**cand["overrides"], "loss.delta": cand["delta"], **extra}
    ov["loss.rule"] = arm["loss.rule"]
    if "widen_by" in arm:
        base = load_config(preset, [f"{k}={v}" for k, v in cand["overrides"].items()]).loss
        ov["loss.eps_low"] = round(base.eps_low + arm["widen_by"], 6)
        ov["loss.eps_high"] = round(base.eps_high + arm["widen_by"], 6)
    return load_config(preset, [f"{k}={v}" for k, v in ov.items()])


def test_stage_a_sweep_runs_exactly_the_preregistered_candidates():
    runs = expand(REGIME["stage_a_sweep"])
    preset = preset_file(REGIME["base_preset"])
    cands, arms = REGIME["candidates"], REGIME["arms"]
    assert len(runs) == len(cands) * len(arms) * len(REGIME["seeds"])
    for spec in runs:
        name, arm = spec.meta["point"]["regime"], spec.meta["arm"]
        want = _planned_config(preset, cands[name], arms[arm], seed=spec.meta["seed"])
        assert spec.config == want, spec.run_id
    assert sorted({r.meta["seed"] for r in runs}) == REGIME["seeds"]


def test_judge_executor_sweep_matches_the_collapse_plan():
    sw = load_sweep("judge_executor_sigma")
    je = REGIME["judge_executor"]
    for arm in ("noisy_decision", "clean_decision"):
        assert sw.arms[arm]["grid"]["loss.ratio_noise"] == je["sigmas"]
    assert list(sw.seeds) == je["seeds"] and max(je["sigmas"]) == 0.5


def test_stage_a2_sweep_runs_exactly_the_preregistered_candidates():
    """sweeps/regime_a2.yaml = stage_a2's candidates x arms x seeds, each seed on its own warm start; the seed ranges
    of the criteria runs, the gate and stage B are disjoint and none holds (sft.seed 0, seed 0), the run that was
    seen before the plan."""
    a2 = R.load_regime(stage="a2")
    runs = expand(a2["sweep"])
    preset = preset_file(a2["base_preset"])
    cands, arms = a2["candidates"], a2["arms"]
    assert len(runs) == len(cands) * len(arms) * len(a2["seeds"])
    for spec in runs:
        name, arm, seed = spec.meta["point"]["regime"], spec.meta["arm"], spec.meta["seed"]
        want = _planned_config(preset, cands[name], arms[arm], **{"seed": seed, "sft.seed": seed})
        assert spec.config == want, spec.run_id
    assert sorted({r.meta["seed"] for r in runs}) == a2["seeds"]
    confirm = {r.config.seed for r in expand("confirm")}
    ranges = [set(a2["seeds"]), set(a2["gate_seeds"]), confirm]
    assert all(not (x & y) for i, x in enumerate(ranges) for y in ranges[i + 1 :])
    assert 0 not in set().union(*ranges) and min(confirm) == 1001
    assert all(r.config.sft.seed == r.config.seed for r in [*runs, *expand("confirm")])


def test_confirm_template_is_sized_by_the_power_calculation():
    """Stage B (A2's plan): n pairs at the planning SD, one RL seed and one warm start per pair, four primary arms."""
    a2 = R.load_regime(stage="a2")
    plan = a2["planning"]
    n = P.n_paired(plan["prior_sd"], plan["sesoi"], plan["alpha"], plan["power"], plan["contrasts"])
    runs = expand("confirm")
    per_arm = {a: sum(r.meta["arm"] == a for r in runs) for a in ("hard", "nsr", "soft", "widen_dose")}
    assert set(per_arm.values()) == {n} and len(runs) == 4 * n
    assert sorted({r.config.seed for r in runs}) == list(range(1001, 1001 + n))


def test_the_confirm_template_is_refused_until_filled(tmp_path):
    """status: template: slurm.submit and experiments.run --sweep refuse it before any folder exists; --dry-run lists
    it; any other status value is refused naming the allowed ones."""
    import subprocess
    import sys

    from experiments.sweep import SweepError, check_ready, load_sweep
    from slurm.submit import submit

    assert load_sweep("confirm").status == "template" and load_sweep("regime_search").status == "ready"
    with pytest.raises(SweepError, match="status: template"):
        submit("confirm", preset="tiny-smoke", cluster="local", out_root=tmp_path / "runs", log_dir=tmp_path / "logs")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "logs").exists()
    assert len(submit("confirm", preset="tiny-smoke", dry_run=True, out_root=tmp_path / "runs").decisions) == 4
    run_id = expand("confirm")[0].run_id
    cmd = [sys.executable, "-m", "experiments.run", "--sweep", "confirm", "--run", run_id, "--out", str(tmp_path / "x")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "status: template" in res.stderr and not (tmp_path / "x").exists()

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nstatus: draft\npreset: tiny\narms: {hard: {loss.rule: hard}}\n")
    with pytest.raises(SweepError, match="status='draft' is not valid; allowed: ready, template"):
        check_ready(bad)


def _run(pattern: str) -> Path:
    found = sorted(GRID.glob(pattern))
    assert found, f"no committed run {pattern} under {GRID}"
    return found[0]


def test_criteria_read_fields_the_tiny_backend_writes():
    rd = RunDir(_run("hard-s0-*"))
    metric, _ = read_rows(rd.metrics_path)
    bins, _ = read_rows(rd.log_path("ratio_bins.jsonl"))
    evals, _ = read_rows(rd.log_path("eval.jsonl"))
    for key in ("clip_frac", "grad_norm", "reward_mean"):
        assert key in metric[0]
    for side in ("pos", "neg"):
        assert len(bins[0][f"{side}_clipped"]) == 11
    assert "delta" in bins[0] and {"step", "decoding", "correct"} <= set(evals[0])


def test_readout_finds_the_issue_facts_on_the_tiny_grid():
    """The tiny preset as a would-be candidate (hard, nsr at delta 0.2, widened by 0.05; seeds 0-1)."""
    regime = {**REGIME, "candidates": {"tiny": {"overrides": {}, "delta": 0.2, "cost": 1.0}}}
    runs = []
    current = {spec.run_id.rsplit("-", 1)[0]: GRID / spec.run_id for spec in expand("delta", preset="tiny")}
    for arm, name in (("hard", "hard"), ("nsr", "nsr-delta0.2"), ("widen_small", "widened-widen0.05")):
        for seed in (0, 1):
            # the run of today's code where it is done, else the committed legacy folder of that config
            path = current[f"{name}-s{seed}"]
            if RunDir(path).state() != "done":
                (path,) = [p for p in GRID.glob(f"{name}-s{seed}-*") if RunDir(p).state() == "done"][:1]
            r = R.read_run(path)
            r.arm, r.regime = arm, "tiny"
            runs.append(r)
    assert len(runs) == 6
    out = R.candidate_readout(runs, regime, "tiny")
    assert out["reach_pos"] > 0.4 and out["reach_neg"] < 0.3  # issue: 77% of A < 0 clipped tokens lie deeper
    assert out["clip_frac"] < 0.03 and out["grad_clip_share"] > 0.3  # issue: 2.7%; grad clip on 39% of updates (today)
    assert out["checks"]["not_saturated"] and out["checks"]["complete"]
    assert not out["checks"]["reach"] and not out["checks"]["clip"] and not out["qualifies"]
    # late-window pass@1 over the committed evals (steps 200, 300, 400) of hard seed 0, recomputed here
    hard0 = next(r for r in runs if r.arm == "hard" and r.seed == 0)
    evals, _ = read_rows(RunDir(hard0.path).log_path("eval.jsonl"))
    late = [
        np.mean([e["correct"] for e in evals if e["step"] == s and e["decoding"] == "sampled"]) for s in (200, 300, 400)
    ]
    assert hard0.late_pass1 == pytest.approx(np.mean(late))
    assert math.isfinite(out["spread"]) and out["spread"] > 0


def test_dose_matched_width_of_a_one_bin_histogram():
    """All clipped tokens in the first depth bin: D = N w(mid), and the width reaches depth w(mid) / 10."""
    cfg = nsr.LossConfig(rule="nsr", delta=0.2)
    counts = np.zeros(11)
    counts[0] = 1000.0
    for sign, (bound, edge) in ((1, (cfg.high, cfg.high / 0.8)), (-1, (cfg.low, cfg.low / 1.2))):
        r_mid = bound + (edge - bound) * 0.05
        if sign > 0:
            w_mid = ((bound / r_mid) ** 2 - 0.8**2) / 0.8  # noisy executor, A > 0 (docs/method.md)
        else:
            w_mid = (1.2**2 - (bound / r_mid) ** 2) / 0.8
        dose, width = D.dose_matched_width(counts, sign, cfg)
        assert dose == pytest.approx(1000 * w_mid)
        assert width == round(abs(edge - bound) * w_mid / 10, 3)
        assert float(nsr.expected_weight(torch.tensor(r_mid), sign, cfg)) == pytest.approx(w_mid)


def test_readout_of_an_empty_folder_chooses_nothing(tmp_path, capsys):
    assert P.main(["regime", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stage A incomplete: u16, u16_gc, tight, d128, u16_gc_d05, c4_u16_gc not done" in out
    assert "chosen regime" not in out


def test_no_regime_is_chosen_while_a_candidate_is_pending(monkeypatch):
    """One candidate meets every criterion, another has not run: the selection waits (it compares candidates)."""
    regime = R.load_regime()
    passing = {"qualifies": True, "dose_per_token": 0.01, "spread": 0.03, "checks": {"complete": True}}
    pending = {"qualifies": False, "dose_per_token": math.nan, "spread": math.nan, "checks": {"complete": False}}
    readouts = {"u16": passing, "u16_gc": pending, "tight": dict(passing, qualifies=False), "d128": dict(passing)}
    readouts["u16_gc_d05"] = readouts["c4_u16_gc"] = dict(passing, qualifies=False)
    monkeypatch.setattr(R, "candidate_readout", lambda runs, reg, name, *a: readouts[name])
    monkeypatch.setattr(R, "load_regime", lambda path=None, stage="a": regime)
    out = R.regime_readout("/nonexistent-stage-a")
    assert out["chosen"] is None and out["pending"] == ["u16_gc"]
    readouts["u16_gc"] = dict(passing, dose_per_token=0.02)  # now complete and the larger dose
    out = R.regime_readout("/nonexistent-stage-a")
    assert out["pending"] == [] and out["chosen"] == "u16_gc" and out["plan"]["pairs"] % 4 == 0


def _hard_run(seed: int, deep: bool, done: bool = True) -> R.RunStats:
    """A done hard run of 400 steps whose clipped tokens all lie in the rescue zone, or all deeper."""
    bins = np.zeros(11)
    bins[10 if deep else 0] = 100.0
    return R.RunStats(
        Path(f"hard-s{seed}"), "hard", "tight", seed, done, late_pass1=0.4, pass1_step0=0.2, reward_auc=0.3,
        clip_frac=0.05, grad_clip_steps=0.0, steps=400, delta=0.2, bins={"pos": bins, "neg": bins},
    )  # fmt: skip


def test_a_candidate_is_ruled_out_once_its_hard_runs_fail_a_hard_only_criterion():
    """Amendment 1: every hard run done and reach fails -> ruled out (the nsr / widen_small runs cannot change it);
    a hard run still running, or hard runs that pass, leave it pending."""
    regime = R.load_regime()
    assert regime["rule_out_on_hard"]["criteria"] == ["reach", "clip", "not_saturated", "grad_clip_rare"]
    deep = [_hard_run(s, deep=True) for s in range(5)]
    out = R.candidate_readout(deep, regime, "tight", expected=15, expected_hard=5)
    assert out["ruled_out"] == ["reach"] and not out["checks"]["complete"] and not out["qualifies"]
    four = deep[:4] + [_hard_run(4, deep=True, done=False)]
    assert R.candidate_readout(four, regime, "tight", expected=15, expected_hard=5)["ruled_out"] == []
    near = [_hard_run(s, deep=False) for s in range(5)]
    out = R.candidate_readout(near, regime, "tight", expected=15, expected_hard=5)
    assert out["ruled_out"] == [] and out["checks"]["reach"] and not out["checks"]["complete"]


def test_hard_only_criteria_do_not_move_with_the_other_arms():
    """What makes amendment 1 sound: with the hard runs fixed, no nsr or widen_small runs (none, good, bad, running)
    change the four criteria it rules out on; they do change widening_not_protective."""
    regime = R.load_regime()
    hard = [_hard_run(s, deep=False) for s in range(5)] + [_hard_run(9, deep=True, done=False)]
    g = np.random.default_rng(0)
    seen, widening = set(), set()
    for trial in range(6):
        others = []
        for arm in ("nsr", "widen_small")[: trial % 3]:
            for seed in range(5):
                # values that would fail each hard-only criterion if it read this run: deep bins, no clipping,
                # every update grad-clipped, a step-0 accuracy above the late one
                r = _hard_run(seed, deep=True, done=bool(g.integers(4)))
                r.arm, r.late_pass1, r.reward_auc = arm, float(g.uniform(0, 1)), float(g.uniform(0, 1))
                r.clip_frac, r.grad_clip_steps, r.pass1_step0 = 0.0, 400.0, 0.99
                others.append(r)
        out = R.candidate_readout(hard + others, regime, "tight", expected=15, expected_hard=5)
        seen.add(tuple(out["checks"][c] for c in R.HARD_ONLY_CRITERIA))
        widening.add(out["checks"]["widening_not_protective"])
    assert seen == {(True, True, True, True)} and widening == {True, False}


def test_without_a_sweep_a_candidate_waits_for_every_preregistered_seed():
    """No expected count given: 2 done hard runs of 5 seeds do not rule a candidate out (not "the folders that
    exist")."""
    out = R.candidate_readout([_hard_run(s, deep=True) for s in range(2)], R.load_regime(), "tight")
    assert not out["checks"]["reach"] and out["ruled_out"] == []


def test_a_ruled_out_candidate_is_not_waited_for(monkeypatch, capsys):
    regime = R.load_regime()
    failing = {"qualifies": False, "dose_per_token": 0.01, "spread": 0.03, "checks": {"complete": False}}
    readouts = {k: dict(failing, ruled_out=["reach"]) for k in ("u16", "u16_gc", "tight", "u16_gc_d05", "c4_u16_gc")}
    readouts["d128"] = dict(failing, ruled_out=[])  # hard runs not all done yet
    monkeypatch.setattr(R, "candidate_readout", lambda runs, reg, name, *a: readouts[name])
    monkeypatch.setattr(R, "load_regime", lambda path=None, stage="a": regime)
    out = R.regime_readout("/nonexistent-stage-a")
    assert out["pending"] == ["d128"] and out["chosen"] is None
    readouts["d128"]["ruled_out"] = ["reach", "clip"]
    out = R.regime_readout("/nonexistent-stage-a")
    assert out["pending"] == [] and out["chosen"] is None and set(out["ruled_out"]) == set(readouts)
    R.print_readout(out)
    text = capsys.readouterr().out
    assert "d128 (reach, clip)" in text and "chosen regime: none qualifies (stage B is not run)" in text
    # one complete candidate that meets every criterion among ruled-out ones is chosen
    readouts["d128"] = {"qualifies": True, "dose_per_token": 0.001, "spread": 0.02, "checks": {"complete": True}}
    readouts["d128"]["ruled_out"] = []
    out = R.regime_readout("/nonexistent-stage-a")
    assert out["pending"] == [] and out["chosen"] == "d128"


def test_a_criterion_without_runs_reads_na_not_fail():
    regime = R.load_regime()
    out = R.candidate_readout([_hard_run(s, deep=True) for s in range(5)], regime, "tight", 15, 5)
    cells = {c: R._cell(out, c) for c in out["checks"]}
    assert cells == {
        "reach": "FAIL", "clip": "pass", "widening_not_protective": "n/a", "not_saturated": "pass",
        "grad_clip_rare": "pass", "complete": "FAIL",
    }  # fmt: skip


def test_only_hard_only_criteria_may_rule_a_candidate_out(tmp_path):
    text = (REPO / "analysis" / "regime.yaml").read_text()
    bad = tmp_path / "regime.yaml"
    bad.write_text(text.replace("criteria: [reach, clip,", "criteria: [widening_not_protective, reach, clip,"))
    with pytest.raises(ValueError, match=r"rule_out_on_hard.criteria has \['widening_not_protective'\]; allowed"):
        R.load_regime(bad)


def test_readout_counts_each_config_of_the_sweep_once(tmp_path):
    """A copy of a run folder and a folder of another config (e.g. made by older code) next to the stage-A runs:
    the readout counts each of the sweep's configs once and nothing else."""
    import shutil

    from devtools.synthetic_runs import ArmSpec, write_folder
    from experiments.config import apply_overrides, from_dict

    specs = [s for s in expand("regime_search") if s.meta["point"].get("regime") == "u16" and s.config.seed == 0]
    for spec in specs:  # the sweep's own configs (hard, nsr, widen_small of u16, seed 0)
        write_folder(tmp_path / spec.run_id, spec.config, dict(spec.meta), ArmSpec())
    shutil.copytree(tmp_path / specs[0].run_id, tmp_path / f"{specs[0].run_id}-copy")
    other = from_dict(apply_overrides(specs[0].config.to_dict(), {"train.lr": 5e-5}))  # a config not in the sweep
    write_folder(tmp_path / "hard-other", other, dict(specs[0].meta), ArmSpec())
    out = R.regime_readout(tmp_path)["candidates"]["u16"]
    assert len(specs) == 3 and out["runs"] == 3 and out["done"] == 3


def test_readout_measures_only_done_runs(tmp_path):
    """A running run is counted (runs, done) but none of its steps enter a measure: a run's first steps would
    otherwise pass for a whole run (a running widen_small run once moved u16's reward-AUC difference by 0.04)."""
    from devtools.synthetic_runs import ArmSpec, write_folder

    specs = [
        s
        for s in expand("regime_search")
        if s.meta["point"].get("regime") == "u16" and s.meta["arm"] == "hard" and s.config.seed in (0, 1)
    ]
    write_folder(tmp_path / specs[0].run_id, specs[0].config, dict(specs[0].meta), ArmSpec())
    write_folder(tmp_path / specs[1].run_id, specs[1].config, dict(specs[1].meta), ArmSpec(skill=3.0), "running")
    metrics = tmp_path / specs[1].run_id / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"clip_frac_low":', '"clip_frac_low":0.5,"x":'))
    out = R.regime_readout(tmp_path)["candidates"]["u16"]
    done = R.read_run(tmp_path / specs[0].run_id)
    assert out["runs"] == 2 and out["done"] == 1
    assert out["clip_frac"] == pytest.approx(done.clip_frac)
    assert out["hard_late_pass1"] == pytest.approx(done.late_pass1)


def test_make_all_writes_the_stage_a_readout(tmp_path, capsys):
    """make_all writes tables/stage_a.md (what `python -m analysis.power regime` prints) when stage-A runs exist."""
    from analysis import make_all
    from devtools.synthetic_runs import ArmSpec, write_folder

    specs = [s for s in expand("regime_search") if s.meta["point"].get("regime") == "u16" and s.meta["arm"] == "hard"]
    for spec in specs:
        write_folder(tmp_path / "runs" / "regime_search" / spec.run_id, spec.config, dict(spec.meta), ArmSpec())
    make_all.make_all(tmp_path / "runs", tmp_path / "out")
    printed = capsys.readouterr().out
    text = (tmp_path / "out" / "tables" / "stage_a.md").read_text()
    expected = R.readout_markdown(R.regime_readout(tmp_path / "runs"))
    assert text.endswith(expected) and "| done | 5 | 0 | 0 | 0 | 0 | 0 |" in text and "| criterion reach |" in text
    # the synthetic hard runs fail a hard-only criterion, so u16 is ruled out (not pending) by its hard runs alone
    assert "ruled out on their done hard runs" in text and "u16 (reach" in text
    pending = "u16_gc, tight, d128, u16_gc_d05, c4_u16_gc"
    assert f"stage A readout (tables/stage_a.md): incomplete ({pending} pending)" in printed


def _gate_file(path: Path, diffs_per_run: list[float], states_per_run: int = 20) -> None:
    """A stage-A2 gate file: 8 baseline runs, each state's soft - hard on the training split = its run's value
    plus a small state-to-state wobble."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, d in enumerate(diffs_per_run):
        for k in range(states_per_run):
            x = 0.2 + 0.001 * k
            wobble = 1e-5 * ((k % 3) - 1)
            mets = {"hard": {"clip_frac": 0.03, "rescue_frac": 0.0, "dose": 0.0}, "soft": {"clip_frac": 0.03,
                    "rescue_frac": 0.0, "dose": 0.004}}  # fmt: skip
            lines.append({"run": i, "step": 20 * (k + 1), "seed": 201 + i, "sft_seed": 201 + i, "before": math.nan,
                          "after": {"hard": math.nan, "soft": math.nan}, "train_before": x - 1e-4,
                          "train_after": {"hard": x, "soft": x + d + wobble}, "metrics": mets})  # fmt: skip
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in lines))


def test_stage_a2_gate_is_holm_across_candidates(tmp_path):
    """The gate reads each candidate's file: one-sided t over the 8 run means, Holm over all three candidates; it is
    decided early only where Holm's first step (p < alpha / 3) or the raw p (>= alpha) already decides it."""
    a2 = R.load_regime(stage="a2")
    up = [2e-5, 3e-5, 1e-5, 2.5e-5, 1.5e-5, 2e-5, 3e-5, 2.2e-5]  # clearly > 0
    _gate_file(tmp_path / "tl44.jsonl", up)
    _gate_file(tmp_path / "tl116.jsonl", [-x for x in up])  # clearly < 0
    g = R.gate_readout(a2, {}, tmp_path)
    assert g["tl44"]["state"] == "complete" and g["tl44"]["runs"] == 8 and g["tl44"]["states"] == 160
    assert g["tl44"]["passes"] is True and g["tl116"]["passes"] is False  # decided before tl116g16's gate
    assert g["tl116g16"] == {"state": "not run", "states": 0, "passes": None}
    assert g["tl44"]["mean"] == pytest.approx(np.mean(up), abs=1e-6) and g["tl44"]["lower"] < np.mean(up)
    assert g["tl44"]["hard_change"] == pytest.approx(1e-4) and g["tl44"]["dose"] == pytest.approx(0.004)
    weak = [x * 1e-6 + 8e-7 for x in (3, -1, 2, 1, 4, -2, 3, 1)]  # p between alpha / 3 and alpha
    _gate_file(tmp_path / "tl116g16.jsonl", weak, states_per_run=5)  # incomplete: still running
    assert R.gate_readout(a2, {}, tmp_path)["tl116g16"]["state"] == "running"
    _gate_file(tmp_path / "tl116g16.jsonl", weak)
    g = R.gate_readout(a2, {}, tmp_path)
    assert 0.05 / 3 < g["tl116g16"]["p"] < 0.05
    assert g["tl116g16"]["p_holm"] == pytest.approx(min(1.0, 2 * g["tl116g16"]["p"]))  # Holm's second step
    (tmp_path / "tl116.jsonl").unlink()  # tl116 ruled out on its hard runs: p = 1 in the family
    g = R.gate_readout(a2, {"tl116": True}, tmp_path)
    assert g["tl116"]["passes"] is False and g["tl116"]["p_holm"] == 1.0 and g["tl44"]["passes"] is True
