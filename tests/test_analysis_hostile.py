"""Hostile inputs to the analysis (issue 16, analysis items 1, 2, 7, 8, 9, 11): each gave a wrong answer without a
word, or a crash, on the previous code. Built from copies of the hand-made fixture (tests/fixtures/runs), so every
test runs in a few seconds; one make_all run covers the items that need the whole pipeline."""

import gzip
import json
import shutil
import warnings
from pathlib import Path

import pytest
import yaml

from analysis import make_all
from analysis.figures import delta_x
from analysis.load import RunWarning, load_runs
from analysis.summary import summarize
from experiments.config import IDENTITY_SCHEME, from_dict

FIXTURE = Path(__file__).parent / "fixtures" / "runs"


def fixture_copy(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    shutil.copytree(FIXTURE / "rescue_vs_decay", root / "rescue_vs_decay")
    return root


def run_dir(root: Path, prefix: str) -> Path:
    return next((root / "rescue_vs_decay").glob(f"{prefix}-*"))


def load(root: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        return load_runs(root)


def rewrite_metrics(path: Path, edit) -> None:
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    rows = edit(rows)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def excluded(rs, prefix: str) -> tuple[str, str]:
    rec = rs.runs[rs.runs["run_id"].str.startswith(prefix)].iloc[0]
    assert not rec["included"] and rec["run"] not in set(rs.members["run"])
    assert rec["run"] not in set(rs.steps["run"]) and rec["run"] not in set(rs.eval_counts()["run"])
    return rec["state"], rec["problem"]


# ----------------------------------------------------------------------------------------- item 1: incomplete runs
def test_a_done_run_short_of_its_steps_is_incomplete_and_excluded(tmp_path):
    root = fixture_copy(tmp_path)
    rewrite_metrics(run_dir(root, "nsr-s1"), lambda rows: rows[:2])  # 2 of 6 rows, status still "done"
    rs = load(root)
    state, why = excluded(rs, "nsr-s1")
    assert state == "incomplete" and "2 of 6 metric rows" in why
    assert sorted(summarize(rs).query("arm == 'nsr'")["seed"]) == [0, 2]
    assert any(i.kind == "incomplete" and i.run_id.startswith("nsr-s1") for i in rs.issues)


def test_a_cut_eval_file_is_incomplete_not_an_earlier_step(tmp_path):
    root = fixture_copy(tmp_path)
    path = run_dir(root, "hard-s0") / "eval.jsonl.gz"
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[: len(data) // 2]))  # the final step's labels are gone
    state, why = excluded(load(root), "hard-s0")
    assert state == "incomplete" and "final eval missing (last eval at step 0" in why


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda rows: [], "metrics.jsonl has no rows"),
        (lambda rows: [*rows[:-1], {**rows[-1], "reward_mean": float("nan")}], "reward_mean: 1 value(s) not a finite"),
        (lambda rows: [*rows[:-1], {**rows[-1], "entropy": "high"}], "entropy: 1 value(s) not a finite number"),
        (lambda rows: [*rows[:-1], {**rows[-1], "clip_frac_low": 1e400}], "clip_frac_low: 1 value(s)"),
    ],
)
def test_empty_nan_or_non_numeric_metrics_are_incomplete(tmp_path, edit, words):
    root = fixture_copy(tmp_path)
    rewrite_metrics(run_dir(root, "soft-s2"), edit)
    state, why = excluded(load(root), "soft-s2")
    assert state == "incomplete" and words in why


# ----------------------------------------------------------------------------------------- item 2: copies
def test_a_copy_anywhere_under_the_root_is_counted_once(tmp_path):
    root = fixture_copy(tmp_path)
    src = run_dir(root, "nsr-s0")
    shutil.copytree(src, root / "backup" / "2026-11" / src.name)
    rs = load(root)
    s = summarize(rs)
    assert len(s) == 9 and s["run"].is_unique and sorted(s.query("arm == 'nsr'")["seed"]) == [0, 1, 2]
    copy = rs.runs[rs.runs["folder"].str.startswith("backup/")].iloc[0]
    assert not copy["included"] and copy["copy_of"] == f"rescue_vs_decay/{src.name}"
    assert delta_x(s, rs.runs).shape == (9,)  # used to crash on the duplicated run key


def test_a_legacy_folder_counts_only_when_no_current_run_of_its_config_exists(tmp_path):
    """A folder whose recorded hash differs from today's (made by older code) is the same config as a current folder
    of it: the current one counts, the legacy one is a copy; alone, the legacy one counts and is flagged."""
    root = fixture_copy(tmp_path)
    src = run_dir(root, "nsr-s0")
    recorded = next(line for line in (src / "config.yaml").read_text().splitlines() if "run_hash:" in line)
    body = yaml.safe_load((src / "config.yaml").read_text())
    body.pop("meta")
    today = f"  run_hash: {from_dict(body).run_hash()}"  # the fixture as if written by today's code
    scheme = f"\n  identity: {IDENTITY_SCHEME}"
    (src / "config.yaml").write_text((src / "config.yaml").read_text().replace(recorded, today + scheme))
    old = root / "old-code" / "nsr-s0-0ld0ld00"
    shutil.copytree(src, old)
    cfg = (old / "config.yaml").read_text().replace(today, "  run_hash: 0ld0ld00")
    (old / "config.yaml").write_text(cfg.replace("git_commit: fixture", "git_commit: 0ldc0mm1t"))
    rs = load(root)
    runs = rs.runs.set_index("folder")
    assert runs.at["old-code/nsr-s0-0ld0ld00", "legacy"] and not runs.at[f"rescue_vs_decay/{src.name}", "legacy"]
    assert runs.at[f"rescue_vs_decay/{src.name}", "included"] and not runs.at["old-code/nsr-s0-0ld0ld00", "included"]
    shutil.rmtree(src)  # now the legacy folder is the only run of that config
    rs = load(root)
    inc = rs.included[rs.included["folder"].str.startswith("old-code")]
    assert inc["legacy"].all() and len(inc) == 1 and len(summarize(rs)) == 9
    assert make_all.legacy_note(inc) == [
        "1 legacy run(s) from commit(s) 0ldc0mm1t: made by older code (the hash in their config.yaml differs from "
        "today's); each is counted because no run of its config by today's code exists"
    ]


# ----------------------------------------------------------------------------------------- the pipeline
@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    root = fixture_copy(tmp)
    # item 9: a run whose meta.sweep climbs out of --out
    evil = root / "rescue_vs_decay" / "evil"
    shutil.copytree(run_dir(root, "soft-s0"), evil)
    cfg = (evil / "config.yaml").read_text().replace("sweep: rescue_vs_decay", "sweep: ../../../outside/pwned")
    (evil / "config.yaml").write_text(cfg.replace("run_hash: ", "run_hash: evil"))
    # item 7: a binary status.json and a non-object one; a non-numeric metric value
    for name, status in (("binstatus", b"\x00\xff\x01"), ("liststatus", b"[1]")):
        d = root / "rescue_vs_decay" / name
        shutil.copytree(run_dir(root, "soft-s1"), d)
        (d / "status.json").write_bytes(status)
        (d / "config.yaml").write_text((d / "config.yaml").read_text().replace("run_hash: ", f"run_hash: {name}"))
    rewrite_metrics(run_dir(root, "hard-s1"), lambda rows: [{**r, "rescue_frac": "n/a"} for r in rows])
    # item 11: runs of `make demo`
    demo = root / "demo" / "nsr-demo"
    shutil.copytree(run_dir(root, "nsr-s2"), demo)
    cfg = (demo / "config.yaml").read_text().replace("sweep: rescue_vs_decay", "sweep: demo")
    cfg = cfg.replace("\nseed: 2\n", "\nseed: 99\n")  # its own config, not a copy of nsr-s2
    (demo / "config.yaml").write_text(cfg.replace("run_hash: ", "run_hash: demo"))
    out = tmp / "out"
    res = make_all.make_all(root, out, quiet=True, sweeps_dir=tmp / "no-sweeps")
    return {"tmp": tmp, "root": root, "out": out, "res": res}


def test_nothing_is_written_outside_out(hostile):
    assert not (hostile["tmp"] / "outside").exists() and not any(hostile["tmp"].rglob("pwned*"))
    out = hostile["out"].resolve()
    assert all(Path(f).resolve().is_relative_to(out) for f in hostile["res"]["files"])
    bad = [i for i in hostile["res"]["issues"] if i.kind == "bad_meta"]
    assert len(bad) == 1 and "meta.sweep='../../../outside/pwned' is not valid" in bad[0].message


def test_bad_status_files_and_non_numbers_are_reported_not_fatal(hostile):
    bad = [i for i in hostile["res"]["issues"] if i.kind == "bad_status"]
    assert sorted(Path(i.message.split(":")[0]).parent.name for i in bad) == ["binstatus", "liststatus"]
    runs = hostile["res"]["summary"]["run"]
    assert not runs.str.contains("binstatus|liststatus|hard-s1").any()
    status = (hostile["out"] / "tables" / "status.md").read_text()
    assert "not a JSON object" in status and "rescue_frac: 6 value(s) not a finite number" in status


def test_demo_runs_are_not_tabled(hostile):
    s = hostile["res"]["summary"]
    assert "demo" not in set(s["sweep"]) and not (hostile["out"] / "tables" / "demo.md").exists()
    assert "demo: 1 run(s)" in (hostile["out"] / "tables" / "status.md").read_text()


def test_out_at_a_file_or_unwritable_is_a_clear_error(tmp_path, capsys):
    target = tmp_path / "file.txt"
    target.write_text("x")
    assert make_all.main(["--runs", str(FIXTURE), "--out", str(target), "--no-readme"]) == 2
    assert "--out" in capsys.readouterr().err and target.read_text() == "x"
    with pytest.raises(make_all.OutputError, match="is a file"):
        make_all.make_all(FIXTURE, target, quiet=True)
    with pytest.raises(make_all.OutputError, match="outside the output folder"):
        make_all.write_text(tmp_path / "a" / ".." / ".." / "escape.md", "x", under=tmp_path / "a")


def test_excluded_runs_are_counted_on_stderr(tmp_path, capsys):
    root = fixture_copy(tmp_path)
    rewrite_metrics(run_dir(root, "nsr-s1"), lambda rows: rows[:3])
    rs = load(root)
    counts = make_all.warn_excluded(rs)
    err = capsys.readouterr().err
    assert counts == {"incomplete": 1} and "1 run folder(s) excluded" in err and "3 of 6 metric rows" in err


# ----------------------------------------------------------------------------------------- the fast readers
# metrics.jsonl and ratio_bins.jsonl are parsed by pyarrow when they are plain; anything else falls back to the
# line-by-line reading. Both must give the same frames, so every kind of file is read both ways here.
def _both_metric_readings(path: Path):
    from analysis import load as load_mod
    from experiments.rundir import read_rows

    table = load_mod._arrow_table(path)
    fast = None if table is None else load_mod._metrics_table_frame(table)
    slow = load_mod._steps_frame(read_rows(path)[0])
    return (None if fast is None else load_mod._steps_frame([], fast)), slow


@pytest.mark.parametrize(
    "edit, fast",
    [
        (lambda rows: rows, True),
        (lambda rows: [{**r, "phase": "rl", "gated": r["step"] % 2 == 0} for r in rows], True),  # text, booleans
        (lambda rows: [{**r, "entropy": None if r["step"] == 2 else r["entropy"]} for r in rows], True),  # a null
        (lambda rows: [{**r, "extra": 1 if r["step"] < 3 else 0.5} for r in rows], True),  # ints, then floats
        (lambda rows: [*rows[:-1], {k: v for k, v in rows[-1].items() if k != "rescue_frac"}], True),  # a missing one
        (lambda rows: [{**r, "hist": [1, 2]} for r in rows], False),  # a list: not a plain column
        (lambda rows: [*rows[:-1], {**rows[-1], "reward_mean": float("nan")}], False),  # NaN: pyarrow takes it
        (lambda rows: [*rows[:-1], {**rows[-1], "clip_frac_low": 1e400}], False),  # Infinity
        (lambda rows: [*rows[:-1], {**rows[-1], "entropy": "high"}], False),  # a type change: pyarrow refuses
    ],
)
def test_metrics_read_by_pyarrow_equal_the_line_by_line_reading(tmp_path, edit, fast):
    import pandas as pd

    root = fixture_copy(tmp_path)
    d = run_dir(root, "soft-s2")
    rewrite_metrics(d, edit)
    quick, slow = _both_metric_readings(d / "metrics.jsonl")
    assert (quick is not None) == fast
    if quick is not None:
        pd.testing.assert_frame_equal(quick[0], slow[0], check_exact=True)
        assert quick[1] == slow[1] == []


@pytest.mark.parametrize(
    "edit, fast",
    [
        (lambda r: r, True),
        (lambda r: {**r, "pos_weight": [0.1, 0.2, 0.3]} if r["step"] == 2 else r, False),  # a shorter list
        (lambda r: {**r, "neg_rescued": None} if r["step"] == 1 else r, False),  # a null
        (lambda r: {**r, "pos_weight": [float("nan"), 0.0, 0.0, 0.0]} if r["step"] == 3 else r, False),  # NaN
    ],
)
def test_ratio_bins_read_by_pyarrow_equal_the_line_by_line_sums(tmp_path, edit, fast):
    import numpy as np
    import pandas as pd

    from analysis import load as load_mod
    from experiments.rundir import RunDir

    rng = np.random.default_rng(5)
    rows = []
    for s in (1, 2, 3):
        row = {"step": s, "delta": 0.2, "executor": "noisy"}
        for side in ("pos", "neg"):
            row |= {
                f"{side}_clipped": rng.integers(0, 50, 4).tolist(),
                f"{side}_rescued": rng.integers(0, 9, 4).tolist(),
            }
            row[f"{side}_weight"] = rng.random(4).round(6).tolist()  # float sums depend on the order of the adds
        rows.append(edit(row))
    d = tmp_path / "run"
    d.mkdir()
    (d / "ratio_bins.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = load_mod._arrow_table(d / "ratio_bins.jsonl")
    assert (table is not None and load_mod._bin_sums(table) is not None) == fast
    if fast:
        got, bad = load_mod._run_bins(RunDir(d), "r")
        want = pd.DataFrame(
            [{"run": "r", "delta": 0.2, "executor": "noisy", "side": side, "bin": b}
             | {w: sum(r[f"{side}_{w}"][b] for r in rows) for w in ("clipped", "rescued", "weight")}
             for side in ("pos", "neg") for b in range(4)]
        )  # fmt: skip
        pd.testing.assert_frame_equal(got, want, check_exact=True)
        assert bad == []
