"""Sweep expansion (experiments/sweep.py): every paper sweep expands and validates, ids are stable, rerunning one
run resolves exactly the grid's config, and bad input fails with the file, the key and the allowed values."""

import argparse
import re
import textwrap

import pytest

from experiments import sweep as sweeps
from experiments.config import load_config
from experiments.run import resolve
from experiments.sweep import SweepError, expand, load_sweep, resolve_run

SWEEPS = ["main", "advantage_magnitude", "judge_executor", "rescue_vs_decay", "delta", "clip_asymmetry", "related"]
MIN_SEEDS = {"rescue_vs_decay": 5, "delta": 5}  # CPU evidence grid: these two need >= 5 seeds, the others >= 3
CLUSTER_PRESETS = ["qwen2.5-math-7b-dapo", "qwen3-8b-dapo", "qwen3-30b-a3b-gspo"]
ID = re.compile(r"^[A-Za-z0-9_.+-]+-[0-9a-f]{8}$")


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


@pytest.fixture
def presets(tmp_path):
    """A presets folder with two small complete presets (one capping seeds), independent of sweeps/presets."""
    d = tmp_path / "presets"
    d.mkdir()
    write(d, "p1.yaml", "backend: tiny\ntrain: {steps: 5}\n")
    write(d, "p2.yaml", "preset: {max_seeds: 1}\nbackend: tiny\ntrain: {steps: 7}\n")
    return d


# ---------------------------------------------------------------- the paper's sweep files
@pytest.mark.parametrize("name", SWEEPS)
def test_paper_sweeps_expand_on_tiny_and_cluster(name):
    sw = load_sweep(name)
    assert sw.description and sw.baseline in sw.arms
    assert len(sw.seeds) >= MIN_SEEDS.get(name, 3)
    tiny = expand(name, preset="tiny")
    assert len({r.meta["seed"] for r in tiny}) == len(sw.seeds)  # tiny keeps every seed
    assert all(r.config.backend == "tiny" and ID.match(r.run_id) for r in tiny)
    assert {r.meta["arm"] for r in tiny} == set(sw.arms)
    # the evidence plan's preset too (it sets the tiny-scale Clip-Cov / KL-Cov fractions, which once made two
    # `related` arms one config there)
    assert len(expand(name, preset="tiny-regime")) == len(tiny)
    smoke = expand(name, preset="tiny-smoke")  # max_seeds: 1 -> one run per arm and point
    assert {r.meta["seed"] for r in smoke} == {sw.seeds[0]}
    assert len(smoke) * len(sw.seeds) == len(tiny)
    cluster = expand(name)  # the sweep's own preset(s)
    assert {r.meta["preset"] for r in cluster} == set(sw.presets) <= set(CLUSTER_PRESETS)
    assert all(r.config.backend == "openrlhf" for r in cluster)


def test_run_ids_are_stable_and_carry_the_config_hash():
    a, b = expand("delta", preset="tiny"), expand("delta", preset="tiny")
    assert [r.run_id for r in a] == [r.run_id for r in b]
    for r in a:
        assert r.run_id.endswith("-" + r.config.run_hash())
    ids = [r.run_id for r in a]
    assert "nsr-delta0.2-s3-" in " ".join(ids) and any(i.startswith("widened-widen0.5-s4-") for i in ids)


def test_delta_sweep_meta_and_values():
    runs = expand("delta", preset="tiny")
    arms = {r.meta["arm"] for r in runs}
    assert arms >= {"hard", "nsr", "widened"}  # and the controls the sweep file adds next to them
    nsr = [r for r in runs if r.meta["arm"] == "nsr"]
    assert sorted({r.meta["point"]["loss.delta"] for r in nsr}) == [0.05, 0.1, 0.2, 0.3, 0.5]
    assert all(r.config.loss.delta == r.meta["point"]["loss.delta"] and r.config.loss.rule == "nsr" for r in nsr)
    hard = [r for r in runs if r.meta["arm"] == "hard"]
    assert len(hard) == 5 and all(r.meta["point"] == {} for r in hard)  # no delta axis on the baseline
    widened = [r for r in runs if r.meta["arm"] == "widened"]
    for r in widened:  # eps + delta with the hard rule; the label stays a number for plots
        d = r.meta["point"]["widen"]
        assert isinstance(d, float) and r.config.loss.rule == "hard"
        assert r.config.loss.eps_low == pytest.approx(0.2 + d) and r.config.loss.eps_high == pytest.approx(0.28 + d)
    for r in runs:
        assert r.meta["sweep"] == "delta" and r.meta["baseline"] == "hard" and r.meta["preset"] == "tiny"
        assert r.meta["seed"] == r.config.seed


def test_main_preset_axis_and_gspo_factor():
    runs = expand("main")
    assert len(runs) == 3 * 2 * 2 * 3
    assert {r.meta["point"]["preset"] for r in runs} == set(CLUSTER_PRESETS)
    gspo = [r for r in runs if r.meta["point"]["base"] == "gspo"]
    for r in gspo:
        c = r.config
        assert (c.loss.level, c.loss.eps_low, c.loss.eps_high, c.loss.delta) == ("sequence", 3e-4, 4e-4, 4e-4)
        assert c.train.agg_mode == "seq-mean-token-mean"
    tiny = expand("main", preset="tiny")  # --preset collapses the preset axis
    assert len(tiny) == 2 * 2 * 3 and all("preset" not in r.meta["point"] for r in tiny)
    assert {r.run_id.split("-s")[0] for r in tiny} == {"dapo-hard", "dapo-nsr", "gspo-hard", "gspo-nsr"}


def test_clip_asymmetry_random_reward_control():
    runs = expand("clip_asymmetry", preset="tiny")
    kinds = {r.meta["arm"]: r.config.advantages.kind for r in runs}
    assert kinds == {"task": "group_norm", "random_reward": "random_reward"}
    assert len({(r.config.loss.eps_low, r.config.loss.eps_high) for r in runs}) == 9


def test_rerun_one_resolves_the_grid_config():
    """`python -m experiments.run --sweep delta --run ID --preset tiny` resolves exactly the grid's RunSpec."""
    runs = expand("delta", preset="tiny")
    spec = runs[7]
    args = argparse.Namespace(sweep="sweeps/delta.yaml", run_id=spec.run_id, preset="tiny", config=None, overrides=[])
    cfg, run_id, sweep, meta = resolve(args)
    assert (cfg, run_id, sweep, meta) == (spec.config, spec.run_id, "delta", spec.meta)
    assert resolve_run("delta", spec.run_id, preset="tiny") == spec
    # and the recorded overrides over the preset file give the same config (the dry-run's command line)
    assert load_config(spec.preset_path, spec.overrides) == spec.config


def test_rerun_finds_the_preset_from_the_run_id():
    """An id from a `--preset tiny` grid resolves without --preset (the id ends in its config hash)."""
    spec = expand("delta", preset="tiny")[5]
    assert spec.run_id not in {r.run_id for r in expand("delta")}
    assert resolve_run("delta", spec.run_id) == spec
    args = argparse.Namespace(sweep="delta", run_id=spec.run_id, preset=None, config=None, overrides=[])
    assert resolve(args)[0] == spec.config and resolve(args)[3]["preset"] == "tiny"
    with pytest.raises(SweepError, match="no run"):
        resolve_run("delta", spec.run_id[:-8] + "00000000")


def test_an_id_of_another_preset_is_named_and_help_shows_ids_that_exist(capsys):
    """An id of the sweep's own preset given with --preset tiny (and the reverse) is refused naming its preset and the
    fix; experiments.run --sweep S --run ID without --preset says which preset it found; every id slurm.submit's
    --help shows resolves under the preset its line names."""
    from experiments.run import main as run_main
    from slurm import submit

    own, tiny = expand("delta")[4], expand("delta", preset="tiny")[4]
    with pytest.raises(SweepError, match=rf"{own.run_id!r} is a run of preset 'qwen2.5-math-7b-dapo', not of --preset "
                                         r"tiny .*; drop --preset \(it is the sweep's own preset\)"):  # fmt: skip
        resolve_run("delta", own.run_id, preset="tiny")
    with pytest.raises(SweepError, match=rf"{tiny.run_id!r} is a run of preset 'tiny', not of --preset tiny-regime"
                                         r".*; use --preset tiny$"):  # fmt: skip
        resolve_run("delta", tiny.run_id, preset="tiny-regime")
    assert run_main(["--sweep", "delta", "--run", tiny.run_id, "--dry-run"]) == 0
    assert f"run {tiny.run_id}: a run of preset tiny (found without --preset)" in capsys.readouterr().err
    shown = re.findall(r"python -m slurm\.submit (\w+)( --preset [\w-]+)? --only ([\w.-]+)", submit.__doc__)
    assert len(shown) == 2
    for sweep, preset, run_id in shown:
        preset = preset.split()[-1] if preset else None
        assert resolve_run(sweep, run_id, preset=preset).run_id == run_id


def test_resolve_unknown_run_lists_close_ids():
    runs = expand("delta", preset="tiny")
    typo = runs[3].run_id[:-1] + "x"
    with pytest.raises(SweepError, match=r"delta\.yaml: no run .* closest: " + re.escape(runs[3].run_id)):
        resolve_run("delta", typo, preset="tiny")


# ---------------------------------------------------------------- the format
def test_precedence_factors_arms_grid_and_seed_cap(tmp_path, presets):
    p = write(
        tmp_path,
        "s.yaml",
        """
        preset: p1
        base: {loss.rule: nsr, loss.delta: 0.3, train.lr: 1.0e-4}
        factors:
          lvl: {tok: {loss.level: token}, seq: {loss.level: sequence, loss.delta: 1.0e-4}}
        arms:
          hard: {loss.rule: hard}
          nsr: {grid: {train.lr: [1.0e-3, 2.0e-3]}}
        seeds: [3, 4]
        baseline: hard
        """,
    )
    runs = expand(p, presets_dir=presets)
    assert len(runs) == 2 * (1 + 2) * 2
    by = {r.run_id.rsplit("-", 1)[0]: r for r in runs}
    assert set(by) >= {"tok-hard-s3", "seq-nsr-lr0.001-s4", "tok-nsr-lr0.002-s3"}
    assert by["tok-hard-s3"].config.loss.rule == "hard" and by["tok-hard-s3"].config.loss.delta == 0.3  # base
    assert by["tok-hard-s3"].config.train.lr == 1e-4 and by["tok-hard-s3"].config.train.steps == 5  # base, preset
    seq = by["seq-nsr-lr0.001-s4"]
    assert (seq.config.loss.level, seq.config.loss.delta, seq.config.train.lr) == ("sequence", 1e-4, 1e-3)
    assert seq.meta["point"] == {"lvl": "seq", "train.lr": 1e-3} and seq.config.seed == 4
    capped = expand(p, preset="p2", presets_dir=presets)  # p2 keeps only the first seed
    assert {r.config.seed for r in capped} == {3} and all(r.config.train.steps == 7 for r in capped)


def test_grid_without_arms_is_one_default_arm(tmp_path, presets):
    p = write(tmp_path, "g.yaml", "preset: p1\ngrid: {loss.eps_high: [0.2, 0.3]}\nseeds: [0]\n")
    runs = expand(p, presets_dir=presets)
    assert [r.meta["arm"] for r in runs] == ["default", "default"] and runs[0].meta["baseline"] is None


BAD = [
    ("preset: p1\narms: {a: {}}\ncolour: red\n", r"unknown key 'colour'; allowed: name, description, preset"),
    ("preset: p1\narms: {a: {loss.dleta: 0.1}}\n", r"arms\.a: unknown key 'loss\.dleta'; allowed: loss\.rule, "),
    ("preset: p1\narms: {a: {loss: {rule: nsr}}}\n", r"'loss' is a section; allowed: dotted keys loss\.rule"),
    (
        "preset: p1\narms: {a: {loss.delta: abc}}\n",
        r"run a-s0 .*loss\.delta='abc' is not valid; allowed: a finite number",
    ),
    ("preset: p1\narms: {a: {loss.delta: 1.5}}\n", r"loss\.delta=1\.5 is not valid; allowed: .*0 <= delta < 1"),
    ("preset: p1\narms: {a: {loss.rule: nrs}}\n", r"rule='nrs' is not valid; allowed: hard, nsr, soft"),
    ("preset: nope\narms: {a: {}}\n", r"preset='nope' not found; allowed: p1, p2"),
    ("preset: p1\ngrid: {loss.delta: []}\n", r"grid\.loss\.delta=\[\] is not valid; allowed: a non-empty list"),
    ("preset: p1\narms: {}\n", r"arms is empty; allowed: at least one arm"),
    ("preset: p1\narms: {a: {}, b: {}}\n", r"runs 'a-s0-\w+' and 'b-s0-\w+' have the same config"),
    ("preset: p1\narms: {a: {}}\nbaseline: b\n", r"baseline='b' is not an arm; allowed: a"),
    ("preset: p1\ngrid: {seed: [1, 2]}\n", r"grid: 'seed' is set by the top-level `seeds` list only"),
    ("preset: p1\narms: {a: {loss.delta: 0.1, grid: {loss.delta: [0.2]}}}\n", r"set by the arm and by its axis"),
    (
        "preset: p1\narms: {a: {}}\nseeds: [1, 1]\n",
        r"seeds=\[1, 1\] is not valid; allowed: a non-empty list",
    ),
    ("preset: p1\narms: {a: {}}\nseeds: []\n", r"seeds=\[\] is not valid"),
    ("preset: p1\narms: {a: {gird: {loss.delta: [0.1]}}}\n", r"unknown key 'gird'; allowed: .*, grid, factors"),
    ("preset: p1\nfactors: {f: {}}\n", r"factors\.f is empty; allowed: at least one labelled option"),
    ("preset: p1\narms: {'a b': {}}\n", r"arms: label 'a b' is not valid; allowed: letters, digits"),
    ("arms: {a: {}}\n", r"preset=None is not valid; allowed: a preset name or a list"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_sweeps_name_file_key_and_allowed(tmp_path, presets, text, message):
    p = write(tmp_path, "bad.yaml", text)
    with pytest.raises(SweepError) as e:
        expand(p, presets_dir=presets)
    assert str(e.value).startswith(str(p)), str(e.value)
    assert re.search(message, str(e.value)), str(e.value)


def test_bad_preset_sections(tmp_path, presets):
    write(presets, "p3.yaml", "preset: {max_seeds: 0}\nbackend: tiny\n")
    write(presets, "p4.yaml", "preset: {seeds: 1}\nbackend: tiny\n")
    p = write(tmp_path, "s.yaml", "preset: p3\narms: {a: {}}\n")
    with pytest.raises(SweepError, match=r"p3\.yaml: preset\.max_seeds=0 is not valid; allowed: an integer >= 1"):
        expand(p, presets_dir=presets)
    with pytest.raises(SweepError, match=r"p4\.yaml: preset: unknown key 'seeds'; allowed: max_seeds"):
        expand(p, preset="p4", presets_dir=presets)


def test_unknown_sweep_lists_the_sweeps():
    with pytest.raises(SweepError, match=r"no such sweep file; available: .*delta.*rescue_vs_decay"):
        sweeps.sweep_path("detla")


# ---------------------------------------------------------------- tie
def test_tie_sets_a_field_to_each_runs_seed(tmp_path, presets):
    sw = write(
        tmp_path,
        "tied.yaml",
        """
        preset: p1
        arms: {hard: {loss.rule: hard}, nsr: {loss.rule: nsr}}
        seeds: [3, 7]
        tie: {sft.seed: seed}
        """,
    )
    runs = expand(sw, presets_dir=presets)
    assert [(r.config.seed, r.config.sft.seed) for r in runs] == [(3, 3), (7, 7), (3, 3), (7, 7)]
    assert runs[0].overrides["sft.seed"] == 3  # `experiments.run <preset> k=v ...` with these overrides is the run


@pytest.mark.parametrize(
    "tie, extra, msg",
    [
        ("{sft.seed: seed}", "base: {sft.seed: 1}", "also set by base"),
        ("{sft.seed: seed}", "grid: {sft.seed: [1, 2]}", "also set by arms.hard (axis)"),
        ("{sft.seed: step}", "", "allowed: seed"),
        ("{sft.sead: seed}", "", "unknown key 'sft.sead'"),
        ("[sft.seed]", "", "allowed: a mapping"),
    ],
)
def test_bad_tie_is_refused(tmp_path, presets, tie, extra, msg):
    sw = write(tmp_path, "bad.yaml", f"preset: p1\narms: {{hard: {{loss.rule: hard}}}}\ntie: {tie}\n{extra}\n")
    with pytest.raises(SweepError, match=re.escape(msg)):
        expand(sw, presets_dir=presets)
