"""analysis.make_all and the figures, on synthetic runs laid out exactly as the real sweep files expand.

The grid: sweeps/{delta, judge_executor, rescue_vs_decay}.yaml expanded by the real ``experiments.sweep.expand`` with a
small preset (30 steps, eval of 256 prompts x 4 samples), each run written by devtools.synthetic_runs with an arm
effect we choose, so the claims the effects imply must come out. Then make_all twice (with two worker processes,
then inline from the parsed-log cache the first filled): every file present and non-empty, byte-identical the second
time, README block rewritten in place, missing runs listed.
"""

import os
import shutil
import warnings
from pathlib import Path

import nbformat
import numpy as np
import pytest
import yaml

from analysis import figures, make_all
from analysis.load import load_runs
from analysis.summary import summarize
from devtools.synthetic_runs import ArmSpec, write_folder
from experiments.config import RunConfig, apply_overrides
from experiments.sweep import SWEEPS_DIR, expand

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

REPO = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "runs"
SWEEPS = ("delta", "judge_executor", "judge_executor_sigma", "rescue_vs_decay")
# arm effects (log-odds of solving a problem by the end of training; entropy rebounds)
EFFECTS = {
    "delta": {
        "hard": ArmSpec(),
        "nsr": ArmSpec(skill=1.0, rescue=0.004),
        "widened": ArmSpec(skill=-0.3),
        "widened_dose": ArmSpec(skill=-0.3),
        "noclip": ArmSpec(skill=-0.5),
    },
    "judge_executor": {
        "hard": ArmSpec(),
        "noisy_decision": ArmSpec(skill=-1.2, entropy_spikes=2),
        "clean_decision": ArmSpec(skill=0.5),
    },
    "judge_executor_sigma": {  # the judge_executor claim's collapse test: the noisy arm's reward falls
        "hard": ArmSpec(),
        "noisy_decision": ArmSpec(skill=-1.2, entropy_spikes=2),
        "clean_decision": ArmSpec(skill=0.5),
    },
    "rescue_vs_decay": {
        "hard": ArmSpec(),
        "nsr": ArmSpec(skill=1.0, rescue=0.004),
        "soft": ArmSpec(skill=-0.5),
        "pushout": ArmSpec(skill=-1.0),
        "nsr_pushout": ArmSpec(skill=0.2, rescue=0.004),
        "widened": ArmSpec(skill=-0.5),
    },
}
SKIPPED = "nsr-delta0.5-s4"  # one run of the grid left out: make_all must list it as missing


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    presets, sweeps_dir, runs = root / "presets", root / "sweeps", root / "runs"
    presets.mkdir()
    sweeps_dir.mkdir()
    small = {"train.steps": 30, "eval.every": 15, "eval.n_prompts": 256, "eval.n_samples": 4}
    (presets / "mini.yaml").write_text(yaml.safe_dump(apply_overrides(RunConfig().to_dict(), small)))
    skipped, written = [], {}
    for name in SWEEPS:
        shutil.copy(SWEEPS_DIR / f"{name}.yaml", sweeps_dir / f"{name}.yaml")
        for spec in expand(sweeps_dir / f"{name}.yaml", preset="mini", presets_dir=presets):
            if spec.run_id.startswith(SKIPPED):
                skipped.append(spec.run_id)
                continue
            h = spec.config.run_hash()
            if h in written:  # a config shared by two sweeps runs once, in the first sweep's folder
                continue
            written[h] = runs / spec.sweep / spec.run_id
            write_folder(written[h], spec.config, spec.meta, EFFECTS[name][spec.meta["arm"]])
    # a copy of a run folder elsewhere under the runs root (a backup): counted once, never as another seed
    shutil.copytree(next(p for p in written.values() if p.name.startswith("nsr-delta0.2-s0")),
                    runs / "backup" / "old" / "nsr-delta0.2-s0-copy")  # fmt: skip
    readme = root / "README.md"
    readme.write_text("# Title\n\nintro\n\n<!-- claims:start -->\nold block\n<!-- claims:end -->\n\n## Next\ntext\n")
    out = root / "out"
    kw = dict(readme=readme, sweeps_dir=sweeps_dir, presets_dir=presets, quiet=True)
    first = make_all.make_all(runs, out, jobs=2, cache=root / "cache", **kw)  # worker processes, cache filled
    snapshot = {p: p.read_bytes() for p in first["files"]}
    second = make_all.make_all(runs, out, jobs=1, cache=root / "cache", **kw)  # inline, every run from the cache
    return {
        "written": written,
        "root": root,
        "runs": runs,
        "out": out,
        "readme": readme,
        "first": first,
        "second": second,
        "snapshot": snapshot,
        "skipped": skipped,
    }


def test_every_output_is_written_and_non_empty(grid):
    out = grid["out"]
    for name in SWEEPS:
        for suffix in (".md", ".tex", "_runs.csv"):
            assert (out / "tables" / f"{name}{suffix}").stat().st_size > 100
        assert (out / "figures" / f"{name}_dynamics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for fig in ("delta_sweep", "judge_executor", "theory_expected_weight", "forest", "pass_at_k"):
        assert (out / "figures" / f"{fig}.png").stat().st_size > 10_000
    for table in ("main.md", "main.tex", "claims.md", "status.md"):
        assert (out / "tables" / table).stat().st_size > 100


def test_rerun_is_byte_identical(grid):
    assert [str(p) for p in grid["first"]["files"]] == [str(p) for p in grid["second"]["files"]]
    for path, data in grid["snapshot"].items():
        assert path.read_bytes() == data, f"{path} changed on an identical rerun"


def test_missing_runs_are_listed(grid):
    status = grid["first"]["status"]
    assert status["delta"]["missing"] == sorted(grid["skipped"]) and len(grid["skipped"]) == 1
    assert len(status["delta"]["done"]) == 64 and "missing" not in status["rescue_vs_decay"]
    md = (grid["out"] / "tables" / "status.md").read_text()
    assert "| delta | 64 | 0 | 0 | 0 | 0 | 1 | 1 | 0 |" in md and f"delta missing: {grid['skipped'][0]}" in md


def test_claims_follow_the_planted_effects(grid):
    verdicts = {r["claim"].id: r["verdict"] for r in grid["first"]["claims"]}
    assert verdicts["beats_widening"] == "supports"
    assert verdicts["stochastic_beats_decay"] == "supports"
    assert verdicts["rescue_not_pushout"] == "supports"
    assert verdicts["judge_executor"] == "supports"
    assert verdicts["magnitude"] == "no data" and verdicts["clip_low_random"] == "no data"


def test_a_shared_run_is_one_run_counted_in_each_sweep(grid):
    """rescue_vs_decay's hard / nsr / widened are delta's runs (one folder each, under delta/): each sweep counts
    them, the grid counts them once, and the backup copy is never another seed."""
    s = grid["first"]["summary"]
    rvd, delta = s[s["sweep"] == "rescue_vs_decay"], s[s["sweep"] == "delta"]
    assert sorted(rvd["arm"].unique()) == sorted(EFFECTS["rescue_vs_decay"])
    assert (rvd.groupby("arm").size() == 5).all()
    shared = set(rvd["run"]) & set(delta["run"])
    assert len(shared) == 15 and all(r.startswith("delta/") for r in shared)  # hard, nsr delta=0.2, widened 0.2
    assert s.groupby("sweep")["run"].apply(lambda r: r.is_unique).all()
    assert not s["run"].str.contains("backup").any()
    copies = [i for i in grid["first"]["issues"] if i.kind == "copy"]
    assert len(copies) == 1 and "backup/old/nsr-delta0.2-s0-copy" in copies[0].message
    # the claim that rescue_vs_decay's widened arm used to duplicate is tested once, on delta
    ids = [r["claim"].id for r in grid["first"]["claims"]]
    assert ids.count("beats_widening") == 1 and "beats_widening_delta" not in ids


def test_tables_figures_and_claims_give_one_interval(grid):
    """The same comparison has the same interval in the sweep table, the claims table and the forest plot's data."""
    from analysis import stats, tables

    s = grid["first"]["summary"]
    res = next(r for r in grid["first"]["claims"] if r["claim"].id == "rescue_not_pushout")
    row = next(r for r in res["rows"] if r["a"] == "nsr")
    g = s[s["sweep"] == "rescue_vs_decay"]
    diffs = tables.paired_vs_baseline(g, metrics=["late_pass@1"]).set_index("label").loc["nsr"]
    assert (diffs["mean"], diffs["lo"], diffs["hi"]) == pytest.approx((row["mean"], row["lo"], row["hi"]))
    md = (grid["out"] / "tables" / "rescue_vs_decay.md").read_text()
    assert tables.cell(row["mean"], row["lo"], row["hi"], signif=True).split(" [")[1] in md
    # a figure band is the same function over the seed pairs
    a = g[g["label"] == "nsr"].set_index("seed")["late_pass@1"]
    b = g[g["label"] == "hard"].set_index("seed")["late_pass@1"]
    mean, lo, hi, _ = stats.interval((a - b).to_numpy()[:, None], axis=0)
    assert (mean[0], lo[0], hi[0]) == pytest.approx((row["mean"], row["lo"], row["hi"]))


def test_readme_block_is_rewritten_in_place(grid):
    text = grid["readme"].read_text()
    assert text.startswith("# Title\n\nintro\n\n<!-- claims:start -->\n") and text.endswith("## Next\ntext\n")
    assert "old block" not in text and "| claim (paper) |" in text
    assert "](out/figures/theory_expected_weight.png)" in text and "delta_sweep.png" in text


def test_readme_counts_are_generated(tmp_path, capsys):
    """Every run count in the README is written by make_all from the runs (count markers), never typed; an unknown
    key is refused, naming it and the allowed keys, before any run is read."""
    readme = tmp_path / "README.md"
    marker = "<!-- count:{} -->{}<!-- /count -->".format
    readme.write_text(
        f"All {marker('runs', 291)} runs ({marker('folders', '')} folders); rescue_vs_decay "
        f"{marker('done:rescue_vs_decay', 1)} of {marker('expected:rescue_vs_decay', 1)}, delta "
        f"{marker('missing:delta', 1)} of {marker('expected:delta', 1)} missing; {marker('spikes', 4)} spikes: "
        f"{marker('spike_runs', 'x')}.\n"
        f"<!-- claims:start -->\nold\n<!-- claims:end -->\nTail: {marker('runs', 0)} runs.\n"
    )
    res = make_all.make_all(FIXTURE, tmp_path / "out", readme=readme, quiet=True)
    s, status = res["summary"], res["status"]["rescue_vs_decay"]
    spiked = sorted(s.loc[s["entropy_spike"] > 0, "run"].unique())
    n, folders = s["run"].nunique(), len(load_runs(FIXTURE).runs)
    text = readme.read_text()
    assert n >= 9 and folders > n
    assert text.startswith(
        f"All {marker('runs', n)} runs ({marker('folders', folders)} folders); rescue_vs_decay "
        f"{marker('done:rescue_vs_decay', len(status['done']))} of "
    )
    # the fixture's preset is not a preset file: its sweep's runs cannot be listed (make_all notes why)
    assert f"{marker('expected:rescue_vs_decay', '?')}, delta " in text
    n_delta = len(expand("delta", preset="tiny"))
    assert f"{marker('missing:delta', n_delta)} of {marker('expected:delta', n_delta)} missing" in text
    listed = ", ".join(f"`{r}`" for r in spiked) or "none"
    assert f"{marker('spikes', len(spiked))} spikes: {marker('spike_runs', listed)}" in text
    assert text.endswith(f"Tail: {marker('runs', n)} runs.\n") and "\nold\n" not in text
    before = readme.read_bytes()
    make_all.make_all(FIXTURE, tmp_path / "out", readme=readme, quiet=True)
    assert readme.read_bytes() == before  # a rerun changes nothing
    for key in ("run", "done:nosuchsweep", "missing"):
        bad = tmp_path / "bad.md"
        bad.write_text(f"{marker(key, 1)}\n<!-- claims:start -->\n<!-- claims:end -->\n")
        with pytest.raises(make_all.ReadmeError, match=f"count marker key '{key}' is not valid; allowed: runs, fold"):
            make_all.make_all(FIXTURE, tmp_path / "out2", readme=bad, quiet=True)
        assert not (tmp_path / "out2" / "tables").exists() and bad.read_text().startswith(marker(key, 1))
    assert make_all.main(["--runs", str(FIXTURE), "--out", str(tmp_path / "out2"), "--readme", str(bad)]) == 2
    assert "count marker key 'missing' is not valid" in capsys.readouterr().err


def test_readme_without_markers_is_untouched(grid, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    make_all.make_all(FIXTURE, tmp_path / "out", readme=readme, quiet=True)
    assert readme.read_text() == "no markers\n"


def test_delta_x_places_nsr_at_delta_and_widened_at_its_extra_width(grid):
    rs = load_runs(grid["runs"], sweeps=["delta"])
    s = summarize(rs, with_eval=False)
    x = figures.delta_x(s, rs.runs)
    by = dict(zip(s["label"], x))
    assert by["nsr delta=0.3"] == pytest.approx(0.3) and by["widened widen=0.1"] == pytest.approx(0.1)
    assert np.isnan(by["hard"])


def test_theory_monte_carlo_matches_the_closed_form():
    import torch

    import nsr

    for ex in ("noisy", "clean"):
        cfg = nsr.LossConfig(rule="nsr", delta=0.3, executor=ex)
        r = np.array([1.3, 1.45, 1.6, 1.75])
        mc = figures.monte_carlo_weight(r, 1, cfg, n=20_000)
        np.testing.assert_allclose(mc, nsr.expected_weight(torch.as_tensor(r), 1, cfg).numpy(), atol=0.01)
        r = np.array([0.65, 0.7, 0.75])
        mc = figures.monte_carlo_weight(r, -1, cfg, n=20_000)
        np.testing.assert_allclose(mc, nsr.expected_weight(torch.as_tensor(r), -1, cfg).numpy(), atol=0.01)


def test_cli_on_the_fixture(tmp_path, capsys):
    rc = make_all.main(["--runs", str(FIXTURE), "--out", str(tmp_path), "--no-readme"])
    out = capsys.readouterr().out
    assert rc == 0 and "rescue_vs_decay: 9 done" in out and "failed" in out and "wrote" in out
    assert "broken/failed-s10-53597e52: failed" in (tmp_path / "tables" / "status.md").read_text()
    assert make_all.main(["--runs", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2


def test_notebook_executes(tmp_path):
    import jupytext
    from nbclient import NotebookClient

    nb = jupytext.read(REPO / "notebooks" / "explore_runs.py")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    os.environ["NSR_RUNS"] = str(FIXTURE)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            NotebookClient(
                nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
            ).execute()
    finally:
        del os.environ["NSR_RUNS"]
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "sweep: rescue_vs_decay" in text and "| claim (paper) |" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the dynamics figure rendered
    nbformat.validate(nb)


def test_benchmark_runs_at_a_tiny_size(tmp_path, capsys):
    from devtools import bench_make_all as bench

    args = ["--dir", str(tmp_path), "--sweeps", "1", "--arms", "2", "--seeds", "2", "--steps", "20", "--every", "10"]
    assert bench.main([*args, "--prompts", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "grid: 4 runs x 20 steps" in out and "make_all cold" in out and "median wall" in out
    assert (tmp_path / "out" / "tables" / "sweep0.md").exists() and not (tmp_path / "cache").exists()
    assert bench.main([*args, "--prompts", "8", "--repeats", "1", "--warm"]) == 0
    assert "make_all warm (cached logs)" in capsys.readouterr().out
    assert len(list((tmp_path / "cache" / "analysis").rglob("*.pkl.z"))) == 4  # one entry per run


def test_screening_forest_lists_every_arm_once_with_the_table_interval(tmp_path):
    """related + dgg screening: each arm minus hard, the same interval as the sweep table's (tables.compare); an arm
    whose runs also sit in the dgg sweep (the same configs, e.g. nsr) is listed once."""
    import pandas as pd

    from analysis.tables import compare

    rng = np.random.default_rng(0)
    rows = []
    for sweep, arms in (("related", ("hard", "nsr", "gppo")), ("dgg", ("hard", "nsr", "dgg"))):
        for arm in arms:
            for seed in range(3):
                run = f"{'related' if arm in ('hard', 'nsr') else sweep}/{arm}-s{seed}"  # shared configs: one run
                rows.append({"sweep": sweep, "run": run, "label": arm, "arm": arm, "seed": seed, "point": {},
                             "baseline": "hard", "late_pass@1": rng.uniform(0.3, 0.5), "reward_auc": 0.4})  # fmt: skip
    summary = pd.DataFrame(rows)
    shared = {r["run"]: r["late_pass@1"] for r in rows if r["sweep"] == "related"}
    summary["late_pass@1"] = [shared.get(r, v) for r, v in zip(summary["run"], summary["late_pass@1"])]
    items = figures.screening_rows(summary)
    assert [(sw, lab) for sw, lab, _ in items] == [("related", "nsr"), ("related", "gppo"), ("dgg", "dgg")]
    for sw, lab, d in items:
        got = d[d["metric"] == "late_pass@1"].iloc[0]
        want = compare(summary[summary["sweep"] == sw], lab, "hard", "late_pass@1")
        assert (got["mean"], got["lo"], got["hi"], got["n"]) == (want["mean"], want["lo"], want["hi"], 3)
    (png,) = figures.screening(summary, tmp_path / "screening")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_status_lists_a_few_ids_per_state_and_counts_the_rest():
    from analysis.make_all import LISTED, status_markdown

    ids = [f"nsr-s{i}-{i:08x}" for i in range(LISTED + 5)]
    md = status_markdown({"confirm": {"done": ["hard-s0-00000000"], "missing": ids}}, [], [])
    line = next(x for x in md.splitlines() if x.startswith("- confirm missing:"))
    assert ids[LISTED - 1] in line and ids[LISTED] not in line and "and 5 more" in line
    assert "| confirm | 1 |" in md and f"| {LISTED + 5} |" in md  # the table still counts every run


def test_a_template_sweep_claims_no_run(tmp_path):
    """A `status: template` sweep (placeholder values) is not credited with the runs of other sweeps that share a
    config: the confirm template at --preset tiny shares 25 configs with the delta / rescue_vs_decay grids."""
    import pandas as pd

    from analysis.load import sweep_members

    text = (SWEEPS_DIR / "delta.yaml").read_text()
    (tmp_path / "delta.yaml").write_text(text)
    (tmp_path / "tmpl.yaml").write_text(text.replace("name: delta", "name: tmpl") + "status: template\n")
    (tmp_path / "copy.yaml").write_text(text.replace("name: delta", "name: copy"))
    members, notes = sweep_members(pd.DataFrame({"meta.preset": ["tiny"]}), tmp_path)
    spec = expand(tmp_path / "delta.yaml", preset="tiny")[0]
    assert not notes and sorted(m["sweep"] for m in members[spec.config.run_hash()]) == ["copy", "delta"]


def test_notes_on_sweeps_name_files_from_the_repo_wherever_it_lies(tmp_path):
    """A sweep that cannot expand on a preset is noted with paths relative to the checkout, so the generated tables
    are the same in every clone."""
    import pandas as pd

    from analysis.load import sweep_members

    sweeps = tmp_path / "somewhere" / "sweeps"
    (sweeps / "presets").mkdir(parents=True)
    (sweeps / "dgg.yaml").write_text((SWEEPS_DIR / "dgg.yaml").read_text())
    (sweeps / "presets" / "smollm2-trl-cpu.yaml").write_text(
        (SWEEPS_DIR / "presets" / "smollm2-trl-cpu.yaml").read_text()
    )
    _, notes = sweep_members(pd.DataFrame({"meta.preset": ["smollm2-trl-cpu"]}), sweeps, sweeps / "presets")
    assert notes and all("not expanded" in n for n in notes)
    assert not any(str(tmp_path) in n for n in notes) and "sweeps/dgg.yaml" in notes[0]


def test_notes_are_one_line_per_sweep_unless_verbose(capsys):
    """The notes load_runs makes when a sweep's configs are not valid on a preset the runs were made with (here the
    real ones: every sweep file against the tiny and smollm2-trl-cpu presets) print as one line per sweep, naming the
    presets; --verbose prints each in full; other notes pass unchanged."""
    import pandas as pd

    from analysis.load import sweep_members
    from experiments.sweep import PRESETS_DIR, SWEEPS_DIR

    runs = pd.DataFrame({"meta.preset": ["smollm2-trl-cpu", "tiny-regime"]})
    _, notes = sweep_members(runs, SWEEPS_DIR, PRESETS_DIR)
    swept = sorted({n.split(" ")[0] for n in notes})
    assert "dgg" in swept and all("not expanded" in n for n in notes)
    other = "3 legacy run(s) made by older code"
    lines = make_all.note_lines([*notes, other])
    assert lines[0] == other and len(lines) == 1 + len(swept)
    for sweep, line in zip(swept, sorted(lines[1:])):
        presets = sorted({n.split("(preset ")[1].split(")")[0] for n in notes if n.startswith(f"{sweep} ")})
        assert line == (f"{sweep}: not matched against the runs of preset {', '.join(presets)}: its configs are not "
                        "valid on that preset (--verbose or tables/status.md say why)")  # fmt: skip
    assert make_all.note_lines([*notes, other], verbose=True) == [*notes, other]
    make_all.print_status({}, notes)
    assert capsys.readouterr().out.count("  note: ") == len(swept)


def test_a_sealed_stage_is_left_out_until_all_its_runs_are_done(grid, tmp_path):
    """A stage of the evidence plan marked sealed (analysis/regime.yaml) keeps its sweep out of every table, figure,
    claim and the README block while a planned run of it is missing (the grid's delta sweep lacks one), and is
    tabled once every planned run is done (rescue_vs_decay has all of them)."""
    regime = tmp_path / "regime.yaml"
    regime.write_text("stage_x:\n  sweep: delta\n  sealed: true\nstage_y:\n  sweep: rescue_vs_decay\n  sealed: true\n")
    assert make_all.sealed_sweeps(regime) == {"delta": "stage_x", "rescue_vs_decay": "stage_y"}
    readme = tmp_path / "README.md"
    readme.write_text(grid["readme"].read_text())
    out = tmp_path / "out"
    kw = dict(readme=readme, sweeps_dir=grid["root"] / "sweeps", presets_dir=grid["root"] / "presets", quiet=True)
    res = make_all.make_all(grid["runs"], out, jobs=1, regime_path=regime, **kw)
    assert "delta" not in set(res["summary"]["sweep"]) and "rescue_vs_decay" in set(res["summary"]["sweep"])
    assert not (out / "tables" / "delta.md").exists() and not (out / "figures" / "delta_dynamics.png").exists()
    assert (out / "tables" / "rescue_vs_decay.md").exists()
    assert all(row["n"] == 0 for r in res["claims"] if r["claim"].sweep == "delta" for row in r["rows"])
    status = (out / "tables" / "status.md").read_text()
    assert "delta: sealed until all its planned runs are done (64 of 65; analysis/regime.yaml, stage_x)" in status
    # the sealed sweep's runs are still counted as runs (the status table), never read for a statistic
    assert len(res["status"]["delta"]["done"]) == 64
