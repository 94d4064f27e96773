"""Stage D as registered (analysis/regime.yaml ``stage_d``, sweeps/regime_d.yaml): the plan the readout reads, the
sweep it names, the runs that sweep expands to (their ids pinned in the plan, so an edit of the preset that would move
a run is caught), the pilot's configuration they keep, seeds no pilot run used, and make_all keeping the sweep out of
its outputs until every planned run is done."""

import re

import pytest
import yaml

from analysis import make_all, stage_d
from analysis.load import flatten
from experiments.config import load_config
from experiments.config_errors import ConfigError
from experiments.openrlhf import precision
from experiments.rundir import REPO_ROOT
from experiments.sweep import expand, load_sweep

PILOT = REPO_ROOT / "results" / "pilot_d"


def _plan() -> dict:
    return stage_d.load_plan()


def test_the_plan_names_the_sweep_and_its_runs():
    plan = _plan()
    sweep = load_sweep(plan["sweep"])
    assert plan["sealed"] is True and sweep.name == plan["sweep"] == "regime_d"
    assert set(sweep.arms) == {plan["control"], plan["treatment"]} == {"hard", "nsr"}
    assert list(sweep.seeds) == plan["seeds"] and len(plan["seeds"]) >= 6
    runs = expand(plan["sweep"])
    order = [f"{arm}-s{seed}" for seed in plan["seeds"] for arm in (plan["control"], plan["treatment"])]
    assert [rid.rsplit("-", 1)[0] for rid in plan["run_ids"]] == order  # pair order: seed by seed, hard then nsr
    assert sorted(plan["run_ids"]) == sorted(r.run_id for r in runs)
    assert make_all.sealed_sweeps()[plan["sweep"]] == "stage_d"
    preset = REPO_ROOT / "sweeps" / "presets" / f"{plan['preset']}.yaml"
    assert preset.is_file() and re.fullmatch(r"[0-9a-f]{64}", plan["preset_sha256_at_registration"])


def test_the_runs_keep_the_pilot_configuration_but_seed_steps_rule_and_recording(tmp_path):
    """Every stage run is the pilot's P4 run (nsr) or its hard twin but for the seed, 30 steps and the step-1
    recording; the precision replay accepts its hard runs (the only refusal left is the missing recorded batch)."""
    p4 = yaml.safe_load((PILOT / "p4-nsr-mix4-lr1e-5-s101-10steps" / "config.yaml").read_text())
    p4.pop("meta", None)

    pilot = flatten(p4)
    runs = expand("regime_d")
    for run in runs:
        mine = flatten(run.config.to_dict())
        diff = {k for k in set(mine) | set(pilot) if mine.get(k) != pilot.get(k)}
        assert diff <= {"seed", "train.steps", "loss.rule", "logging.record_batches"}, (run.run_id, diff)
        assert mine["train.steps"] == 30 and mine["logging.record_batches"] == (1,)
    hard = next(r for r in runs if r.config.loss.rule == "hard")
    with pytest.raises(ConfigError, match="recorded no step-1 batch"):
        precision.check(hard.config, tmp_path)


def test_no_pilot_run_used_a_stage_seed_and_none_is_in_the_stage_folder():
    plan = _plan()
    pilot_seeds = {load_config(p).seed for p in PILOT.glob("*/config.yaml")}
    assert pilot_seeds and not pilot_seeds & set(plan["seeds"])
    folder = REPO_ROOT / "results" / "runs" / plan["sweep"]
    pilot_names = {p.parent.name for p in PILOT.glob("*/config.yaml")}
    assert not pilot_names & {p.name for p in folder.glob("*")}
