"""analysis: statistics, loading run folders (good, partial and corrupted), per-run summary and tables.

The fixture tests/fixtures/runs has a `rescue_vs_decay` sweep (hard / nsr / soft x seeds 0-2, 6 steps, eval of 2
problems x 4 samples + greedy at steps 0 and 6) with numbers chosen to be checked by hand, and a `broken` sweep with
one folder per way a run folder goes wrong. Regenerate the golden table with UPDATE_GOLDEN=1 after a deliberate
format change, and review the diff.
"""

import gzip
import itertools
import json
import math
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import stats, summary, tables
from analysis.load import RunWarning, count_eval, load_runs, read_rows
from analysis.summary import STEP_METRICS, eval_curves, final_window, summarize

FIXTURE = Path(__file__).parent / "fixtures" / "runs"
GOLDEN = FIXTURE / "_golden"


def load_fixture(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        return load_runs(FIXTURE, **kw)


# ------------------------------------------------------------------------------------------------ stats
def brute_pass_at_k(n, c, k):
    """Fraction of the k-subsets of n samples (the first c correct) with at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_brute_force_over_subsets():
    cases = [(n, c, k) for n in range(1, 9) for c in range(n + 1) for k in range(1, n + 1)]
    n, c, k_ = (np.array(x) for x in zip(*cases))
    for k in range(1, 9):
        sel = k_ == k
        got = stats.pass_at_k(n[sel], c[sel], k)
        want = [brute_pass_at_k(a, b, k) for a, b in zip(n[sel], c[sel])]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # a large n, against the closed form with exact integers
    got = stats.pass_at_k([100, 100, 100], [0, 3, 100], 16)
    want = [1 - math.comb(100 - c, 16) / math.comb(100, 16) for c in (0, 3, 100)]
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_pass_at_k_bad_input():
    assert np.isnan(stats.pass_at_k([4], [2], 8)).all()  # fewer samples than k
    with pytest.raises(ValueError, match="0 <= c <= n"):
        stats.pass_at_k([4], [5], 1)
    with pytest.raises(ValueError, match="k=0"):
        stats.pass_at_k([4], [1], 0)
    assert stats.pass_k_values(8) == [1, 2, 4, 8] and stats.pass_k_values(16) == [1, 2, 4, 8, 16]
    assert stats.pass_k_values(12) == [1, 2, 4, 8, 12] and stats.pass_k_values(1) == [1]


def test_pass_at_k_is_the_nearest_float_to_the_exact_fraction():
    from fractions import Fraction

    for n, c, k in [(4, 1, 2), (7, 3, 4), (16, 5, 8), (64, 9, 32)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert stats.pass_at_k([n], [c], k)[0] == float(exact)


def test_pass_at_k_lookup_table_and_sorting_paths_agree(monkeypatch):
    rng = np.random.default_rng(3)
    n = rng.integers(1, 40, 5000)
    c = rng.integers(0, 40, 5000) % (n + 1)
    by_table = {k: stats.pass_at_k(n, c, k) for k in (1, 2, 8, 16)}
    monkeypatch.setattr(stats, "PASS_TABLE_MAX", 0)  # every key beyond the table: np.unique
    for k, got in by_table.items():
        np.testing.assert_array_equal(got, stats.pass_at_k(n, c, k))
        assert np.isnan(got[n < k]).all() and not np.isnan(got[n >= k]).any()


def test_interval_is_student_t_with_scipy_quantiles():
    for df, q in [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423)]:
        assert stats.t_quantile(0.95, df) == pytest.approx(q, abs=1e-4)
    mean, lo, hi, n = stats.interval([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3) and hi - mean == pytest.approx(4.3027 * 1.0 / math.sqrt(3), abs=1e-4)
    assert mean - lo == pytest.approx(hi - mean)
    one = stats.interval([0.5, np.nan])
    assert one[0] == 0.5 and np.isnan(one[1]) and one[3] == 1
    assert stats.interval([])[3] == 0


def test_interval_does_not_call_three_same_sign_values_significant():
    # the percentile bootstrap (no longer used) excluded 0 whenever three differences shared a sign; t does not
    _, lo, hi, _ = stats.interval([0.01, 0.5, 0.02])
    assert lo < 0 < hi


def test_interval_per_column_equals_interval_per_seed_set():
    Y = np.array([[1.0, 2.0, np.nan], [3.0, 4.0, 5.0], [2.0, 3.0, 7.0]])
    mean, lo, hi, n = stats.interval(Y, axis=0)
    np.testing.assert_allclose(mean, [2.0, 3.0, 6.0])
    for j in range(3):
        assert (mean[j], lo[j], hi[j], n[j]) == pytest.approx(stats.interval(Y[:, j]))
    m1, l1, h1, n1 = stats.interval(Y[:1], axis=0)
    assert np.isnan(l1).all() and list(n1) == [1, 1, 0]


def test_holm_and_power():
    np.testing.assert_allclose(stats.holm([0.01, 0.04, 0.03, np.nan]), [0.03, 0.06, 0.06, np.nan])
    assert stats.holm([0.5])[0] == 0.5
    # power grows with the effect and the seeds; at effect 0 it is the level
    assert stats.power(0.0 + 1e-12, 1.0, 5) == pytest.approx(0.05, abs=1e-3)
    assert stats.power(0.02, 0.02, 5) < stats.power(0.02, 0.02, 10) < stats.power(0.04, 0.02, 10)
    assert stats.power(1.0, 1.0, 10) == pytest.approx(0.803, abs=0.002)  # G*Power: one-sample t, d = 1, n = 10
    assert np.isnan(stats.power(0.1, 0.0, 5)) and np.isnan(stats.power(0.1, 1.0, 1))
    assert stats.t_test([1.0, 1.0, 1.0]) == 0.0 and stats.t_test([0.0, 0.0]) == 1.0


# ------------------------------------------------------------------------------------------------ loading
def test_broken_folders_are_listed_never_fatal():
    with pytest.warns(RunWarning):
        rs = load_runs(FIXTURE)
    kinds = {(i.run_id.split("-")[0], i.kind) for i in rs.issues}
    assert {
        ("failed", "failed"),
        ("running", "running"),
        ("truncated", "truncated"),
        ("truncated", "incomplete"),
        ("corrupt", "corrupt_lines"),
        ("noconfig", "no_config"),
        ("noeval", "no_eval"),
        ("noeval", "incomplete"),
        ("cuteval", "truncated"),
        ("cuteval", "incomplete"),
    } <= kinds
    failed = next(i for i in rs.issues if i.kind == "failed")
    assert "loss is nan" in failed.message
    runs = rs.runs.set_index("run_id")
    assert not runs.filter(like="noconfig", axis=0).shape[0]  # no config: skipped, only listed
    for name in ("failed", "running", "truncated", "cuteval", "noeval"):
        assert runs.loc[runs.index.str.startswith(name), "included"].item() is False, name
    assert runs.loc[runs.index.str.startswith("truncated"), "state"].item() == "incomplete"
    assert "5 of 6 metric rows" in runs.loc[runs.index.str.startswith("truncated"), "problem"].item()
    assert "final eval" in runs.loc[runs.index.str.startswith("cuteval"), "problem"].item()
    # a corrupt line in the middle is reported, the run is complete (6 of 6 rows) and counted
    corrupt = "broken/" + runs.index[runs.index.str.startswith("corrupt")][0]
    assert list(rs.steps.set_index("run").loc[corrupt, "step"]) == [1, 2, 3, 4, 5, 6]
    # excluded runs are in no frame the tables read
    counted = set(rs.members["run"])
    assert not any(r.startswith(("broken/truncated", "broken/cuteval", "broken/failed")) for r in counted)
    assert set(rs.steps["run"]) <= counted and set(rs.eval_counts()["run"]) <= counted


def test_states_select_partial_runs():
    rs = load_fixture(states=("done", "running"))
    assert rs.runs.set_index("run_id").filter(like="running", axis=0)["included"].item()
    assert rs.steps["run"].str.contains("running").any()


def test_read_rows_reports_truncation_and_corruption(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{bad\n{"step": 2}\n{"step": 3')
    rows, problems = read_rows(p)
    assert [r["step"] for r in rows] == [1, 2]
    assert [k for k, _ in problems] == ["truncated", "corrupt_lines"]
    p.write_text('{"step": 1}\n{"step": 2}\n')
    assert read_rows(p) == ([{"step": 1}, {"step": 2}], [])


def test_eval_counts_from_arrow_and_python_paths_agree(tmp_path):
    rows = [
        {"step": 0, "benchmark": "b", "problem_id": p, "decoding": d, "sample": s, "correct": (p + s) % 2}
        for p in range(3)
        for d, ns in (("greedy", 1), ("sampled", 4))
        for s in range(ns)
    ]
    good = tmp_path / "eval.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = tmp_path / "bad" / "eval.jsonl.gz"
    bad.parent.mkdir()
    with gzip.open(bad, "wt") as f:  # a truncated last line forces the python reader
        f.write("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 0, "bench')
    a, pa = count_eval(good)
    b, pb = count_eval(bad)
    assert pa == [] and [k for k, _ in pb] == ["truncated"]
    pd.testing.assert_frame_equal(a, b)
    assert list(a.loc[a["decoding"] == "sampled", "c"]) == [2, 2, 2] and set(a["n"]) == {1, 4}


def test_tensorboard_only_run_is_read_with_openrlhf_names(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "main" / "nsr-s0-00000000"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(
        "loss: {rule: nsr}\nseed: 0\nmeta: {sweep: main, arm: nsr, seed: 0, baseline: hard, point: {}}\n"
    )
    (run / "status.json").write_text('{"state": "done"}')
    w = SummaryWriter(str(run / "tensorboard" / "ppo_1130T20:00"))
    for step in (1, 2, 3):
        w.add_scalar("train/rollout/reward_mean", 0.1 * step, step)
        w.add_scalar("train/entropy_loss", 1.0 / step, step)
        w.add_scalar("train/ppo_clip_ratio", 0.03, step)
        w.add_scalar("train/nsr_rescue_frac", 0.004, step)
        w.add_scalar("train/actor_grad_norm", 0.5, step)
    w.close()
    with pytest.warns(RunWarning, match="no_eval"):
        rs = load_runs(tmp_path)
    assert rs.runs["metrics_source"].tolist() == ["tensorboard"]
    st = rs.steps
    assert st["step"].tolist() == [1, 2, 3]
    np.testing.assert_allclose(st["reward_mean"], [0.1, 0.2, 0.3], rtol=1e-6)
    np.testing.assert_allclose(st["entropy"], [1.0, 0.5, 1 / 3], rtol=1e-6)
    np.testing.assert_allclose(st["clip_frac"], 0.03, rtol=1e-6)
    s = summarize(rs)
    assert s["final_reward"].item() == pytest.approx(0.3, rel=1e-6)
    assert s["rescue_frac"].item() == pytest.approx(0.004, rel=1e-6)


# ------------------------------------------------------------------------------------------------ summary (golden)
def raw_eval(run_dir: Path) -> list[dict]:
    with gzip.open(run_dir / "eval.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def test_summary_matches_the_raw_files():
    rs = load_fixture(sweeps=["rescue_vs_decay"])
    s = summarize(rs).set_index("run")
    assert len(s) == 9 and set(s["label"]) == {"hard", "nsr", "soft"}
    for run, path in rs.runs.set_index("run")["path"].items():
        metrics = [json.loads(line) for line in open(Path(path) / "metrics.jsonl")]
        w = final_window(len(metrics))
        assert s.at[run, "final_reward"] == pytest.approx(np.mean([m["reward_mean"] for m in metrics[-w:]]))
        assert s.at[run, "clip_frac"] == pytest.approx(
            np.mean([m["clip_frac_low"] + m["clip_frac_high"] for m in metrics])
        )
        ev = [r for r in raw_eval(Path(path)) if r["step"] == 6]
        sampled = [r for r in ev if r["decoding"] == "sampled"]
        for k in (1, 2, 4):
            per = [brute_pass_at_k(4, sum(r["correct"] for r in sampled if r["problem_id"] == p), k) for p in (0, 1)]
            assert s.at[run, f"pass@{k}"] == pytest.approx(np.mean(per))
        greedy = [r["correct"] for r in ev if r["decoding"] == "greedy"]
        assert s.at[run, "greedy"] == pytest.approx(np.mean(greedy))
        assert s.at[run, "eval_step"] == 6


def test_summary_hand_values():
    s = summarize(load_fixture(sweeps=["rescue_vs_decay"]))
    by = s.set_index(["label", "seed"])
    # 6 steps -> the final window is the last step: reward 0.1 * 6 + 0.01 * seed + arm offset
    assert by.at[("hard", 0), "final_reward"] == pytest.approx(0.6)
    assert by.at[("nsr", 1), "final_reward"] == pytest.approx(0.66)
    # hard's entropy 0.5 0.4 0.3 0.45 0.2 0.1 rises by half while the reward keeps rising: not a spike
    assert by.at[("hard", 2), "entropy_spike"] == 0
    assert by.at[("nsr", 0), "entropy_spike"] == 0 and by.at[("soft", 0), "entropy_spike"] == 0
    # hard seed 0 at step 6: problem 0 has 1 of 4 correct, problem 1 none; greedy right on problem 0 only
    assert by.at[("hard", 0), "pass@1"] == pytest.approx(1 / 8)
    assert by.at[("hard", 0), "pass@2"] == pytest.approx((1 - 3 / 6) / 2)
    assert by.at[("hard", 0), "pass@4"] == pytest.approx(0.5)
    assert by.at[("hard", 0), "greedy"] == pytest.approx(0.5)
    assert by.at[("nsr", 0), "rescue_frac"] == pytest.approx(0.004)
    assert set(STEP_METRICS) <= set(s.columns)


def test_paired_difference_pairs_by_seed():
    s = summarize(load_fixture(sweeps=["rescue_vs_decay"]))
    d = tables.paired_vs_baseline(s, metrics=["pass@1", "final_reward"]).set_index(["label", "metric"])
    # nsr pass@1 by seed 3/8, 3/8, 4/8; hard 1/8, 2/8, 2/8 -> differences 2/8, 1/8, 2/8
    assert d.at[("nsr", "pass@1"), "mean"] == pytest.approx(5 / 24)
    assert d.at[("nsr", "pass@1"), "n"] == 3 and d.at[("nsr", "pass@1"), "vs"] == "hard"
    assert d.at[("nsr", "final_reward"), "mean"] == pytest.approx(0.05)  # same seed offsets cancel exactly
    lo, hi = d.at[("nsr", "pass@1"), "lo"], d.at[("nsr", "pass@1"), "hi"]
    # the t-interval of the differences 2/8, 1/8, 2/8: mean 5/24, sd sqrt(1/192), t(0.975, 2) = 4.3027
    half = 4.302653 * math.sqrt(1 / 192) / math.sqrt(3)
    assert (lo, hi) == pytest.approx((5 / 24 - half, 5 / 24 + half), abs=1e-6)
    assert "soft" in d.index.get_level_values(0) and "hard" not in d.index.get_level_values(0)


def test_counterparts_match_on_shared_axes():
    s = pd.DataFrame(
        {
            "label": ["hard", "noisy sigma=0.1", "noisy sigma=0.2", "clean sigma=0.1", "clean sigma=0.2"],
            "arm": ["hard", "noisy", "noisy", "clean", "clean"],
            "point": [{}, {"s": 0.1}, {"s": 0.2}, {"s": 0.1}, {"s": 0.2}],
            "baseline": "hard",
            "seed": 0,
        }
    )
    assert tables.counterparts(s, "noisy sigma=0.2", "clean") == ["clean sigma=0.2"]
    assert tables.counterparts(s, "noisy sigma=0.2", "hard") == ["hard"]
    assert tables.counterparts(s, "noisy sigma=0.2", "clean", ignore={"s"}) == ["clean sigma=0.1", "clean sigma=0.2"]
    assert tables.select_labels(s, "noisy", {"s": 0.1}) == ["noisy sigma=0.1"]
    assert tables.label_order(s)[0] == "hard"


def test_golden_table():
    s = summarize(load_fixture(sweeps=["rescue_vs_decay"]))
    t = tables.sweep_tables(s, "rescue_vs_decay")
    for kind in ("md", "tex"):
        path = GOLDEN / f"rescue_vs_decay.{kind}"
        if os.environ.get("UPDATE_GOLDEN"):
            path.parent.mkdir(exist_ok=True)
            path.write_text(t[kind])
        assert t[kind] == path.read_text(), f"{path} differs; UPDATE_GOLDEN=1 rewrites it after a deliberate change"
    assert "| nsr | 3 |" in t["md"] and "\\begin{tabular}" in t["tex"]


def test_main_table_puts_paper_and_ours_side_by_side(tmp_path):
    paper = tables.load_paper()
    assert {"Qwen2.5-Math-7B", "Qwen3-8B", "Qwen3-30B-A3B"} <= set(paper["model"])
    row = paper[(paper["model"] == "Qwen2.5-Math-7B") & (paper["metric"] == "pass@1")].iloc[0]
    assert (row.baseline, row.nsr, row.delta) == (35.83, 40.76, 4.93)
    # our main-sweep runs: the fixture's runs relabelled as a main sweep of Qwen2.5-Math-7B (DAPO, token level)
    rs = load_fixture(sweeps=["rescue_vs_decay"])
    s = summarize(rs)
    s = s[s["arm"].isin(["hard", "nsr"])].assign(sweep="main")
    runs = rs.runs.assign(**{"model.name": "Qwen/Qwen2.5-Math-7B"})
    s = s.rename(columns={"pass@1[countdown3]": "pass@1[AIME24]"})
    md = tables.main_table(s, runs, paper)["md"]
    line = next(x for x in md.splitlines() if x.startswith("| Qwen2.5-Math-7B | DAPO | AIME24 | pass@1 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4:7] == ["35.83", "40.76", "4.93"]
    assert cells[7] == f"{100 * 5 / 24:.2f}" and cells[8] == f"{100 * 10 / 24:.2f}" and cells[10] == "3"
    assert cells[9].startswith(f"{tables.fmt(100 * 5 / 24)}*")
    # a benchmark only other sweeps' runs evaluate on (a column of NaN here) gives no row
    other = tables.main_table(s.assign(**{"pass@1[countdown4]": np.nan}), runs, paper)["md"]
    assert "countdown4" not in other and other == md
    with pytest.raises(ValueError, match="missing column"):
        bad = tmp_path / "p.csv"
        bad.write_text("model,metric\nx,pass@1\n")
        tables.load_paper(bad)


def test_eval_curves_per_step():
    rs = load_fixture(sweeps=["rescue_vs_decay"])
    cur = eval_curves(rs.eval_counts())
    at0 = cur[cur["step"] == 0]
    # step 0: one correct sample of 4 per problem for every run; greedy always wrong
    np.testing.assert_allclose(at0["pass@1"], 0.25)
    np.testing.assert_allclose(at0["pass@4"], 1.0)
    np.testing.assert_allclose(at0["greedy"], 0.0)
    assert len(cur) == 18


def test_eval_samples_is_the_tidy_per_sample_frame():
    rs = load_fixture(sweeps=["rescue_vs_decay"])
    ev = rs.eval_samples()
    assert list(ev.columns) == ["run", "step", "benchmark", "problem_id", "decoding", "sample", "correct"]
    assert len(ev) == 9 * 2 * 2 * (1 + 4)  # runs x eval steps x problems x (greedy + 4 sampled)
    counts = ev.groupby(["run", "step", "benchmark", "decoding", "problem_id"])["correct"].agg(["size", "sum"])
    c = rs.eval_counts().set_index(["run", "step", "benchmark", "decoding", "problem_id"])
    assert (counts["size"] == c["n"]).all() and (counts["sum"] == c["c"]).all()


def test_runs_of_two_presets_are_kept_apart(tmp_path):
    src = next((FIXTURE / "rescue_vs_decay").glob("nsr-s0-*"))
    for i, preset in enumerate(("tiny", "tiny-smoke")):
        dst = tmp_path / "rescue_vs_decay" / f"{src.name}-{preset}"
        shutil.copytree(src, dst)
        cfg = (dst / "config.yaml").read_text().replace("preset: fixture", f"preset: {preset}")
        cfg = cfg.replace("  n_prompts: ", f"  n_prompts: {i + 1}")  # another preset: another config (hash)
        cfg = cfg.replace("run_hash: ", f"run_hash: {preset}-")
        (dst / "config.yaml").write_text(cfg.replace(f"run_id: {src.name}", f"run_id: {dst.name}"))
    rs = load_runs(tmp_path)
    assert sorted(rs.members["label"]) == ["nsr preset=tiny", "nsr preset=tiny-smoke"]


def test_ratio_bins_are_summed_per_run_and_drawn_against_the_theory(tmp_path):
    """ratio_bins.jsonl (tiny backend) -> RunSet.ratio_bins() sums over steps; the theory figure gains the
    empirical row, whose points sit where the logged weight / clipped counts put them."""
    root = tmp_path / "runs"
    shutil.copytree(FIXTURE / "rescue_vs_decay", root / "rescue_vs_decay")
    run_dir = next((root / "rescue_vs_decay").iterdir())
    n = 4  # 3 bins over depth [0, 1) + the deeper one
    rows = [
        {"step": s, "delta": 0.2, "executor": "noisy", "pos_clipped": [4, 2, 2, 9], "pos_rescued": [2, 1, 0, 0],
         "pos_weight": [0.9, 0.3, 0.0, 0.0], "neg_clipped": [1, 1, 1, 1], "neg_rescued": [1, 0, 0, 0],
         "neg_weight": [0.5, 0.0, 0.0, 0.0]}
        for s in (1, 2)
    ]  # fmt: skip
    (run_dir / "ratio_bins.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        rs = load_runs(root)
    bins = rs.ratio_bins()
    pos = bins[bins["side"] == "pos"].sort_values("bin")
    assert pos["clipped"].tolist() == [8, 4, 4, 18] and pos["rescued"].tolist() == [4, 2, 0, 0]
    assert pos["weight"].tolist() == pytest.approx([1.8, 0.6, 0.0, 0.0]) and len(bins) == 2 * n
    from analysis import figures

    files = figures.theory(tmp_path / "theory", bins=bins)
    assert files and files[0].stat().st_size > 0
    plain = figures.theory(tmp_path / "theory_plain")
    assert files[0].stat().st_size > plain[0].stat().st_size  # the second row was drawn


# ------------------------------------------------------------------------------------------------ spike metric
def _trace(entropy, reward):
    return pd.DataFrame({"step": np.arange(1, len(entropy) + 1), "entropy": entropy, "reward_mean": reward})


def _noise(n, scale, seed):
    import torch

    return scale * torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).numpy()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spike_metric_on_synthetic_traces(seed):
    n = 400
    t = np.arange(n, dtype=np.float64)
    reward_up = 0.2 + 0.3 * (1 - np.exp(-t / 100)) + _noise(n, 0.02, seed)
    flat_reward = 0.5 + _noise(n, 0.02, seed + 10)
    decay = 0.05 + 0.5 * np.exp(-t / 80)
    jitter = np.exp(_noise(n, 0.1, seed + 20))  # 10% multiplicative noise at every step
    spike = np.exp(np.log(3) * np.exp(-0.5 * ((t - 250) / 8) ** 2))  # entropy x3 around step 250
    dip = 0.12 * np.exp(-0.5 * ((t - 250) / 12) ** 2)  # ... while the reward falls by 0.12
    # a monotone collapse with noise: no spike
    assert summary.entropy_spike(_trace(decay * jitter, reward_up)) == 0
    # a steady upward drift (entropy x10 over the run) under random rewards: no spike
    assert summary.entropy_spike(_trace(0.05 * np.exp(np.log(10) * t / n) * jitter, flat_reward)) == 0
    # a real spike tied to a reward fall: about log 3
    got = summary.entropy_spike(_trace(decay * spike * jitter, reward_up - dip))
    assert math.log(1.5) <= got <= math.log(3) + 0.1  # smoothing over 20 steps takes some of the peak
    assert 0 < summary.spike_steps(_trace(decay * spike * jitter, reward_up - dip)) < 0.15
    # the same rise while the reward holds: not a spike
    assert summary.entropy_spike(_trace(decay * spike * jitter, reward_up)) == 0


def test_summary_keeps_one_run_per_label_and_seed():
    """Two runs on one (sweep, label, seed) (e.g. an old folder whose arm's values changed since): the current one
    is kept, the other reported, so the table's n and the paired comparison agree."""
    from types import SimpleNamespace

    members = pd.DataFrame(
        [
            {"run": r, "sweep": "s", "run_id": r, "label": lab, "arm": lab, "seed": 0, "baseline": "hard", "point": {}}
            for r, lab in (("old-hard", "hard"), ("new-hard", "hard"), ("nsr", "nsr"))
        ]
    )
    steps = pd.DataFrame({"run": ["old-hard", "new-hard", "nsr"], "step": [1, 1, 1], "reward_mean": [0.1, 0.2, 0.3]})
    runs = pd.DataFrame({"run": ["old-hard", "new-hard", "nsr"], "legacy": [True, False, False]})
    rs = SimpleNamespace(members=members, steps=steps, runs=runs, notes=[])
    s = summarize(rs, with_eval=False)
    assert list(s["run"]) == ["new-hard", "nsr"] and not s["legacy"].any()
    assert rs.notes == ["s: old-hard is a second run of label 'hard' seed 0; not counted"]
    # two runs of today's code on one label (the arm's values changed): the one today's sweep file holds is kept
    current = runs.assign(legacy=False)
    rs = SimpleNamespace(members=members.assign(in_file=[True, False, True]), steps=steps, runs=current, notes=[])
    assert list(summarize(rs, with_eval=False)["run"]) == ["old-hard", "nsr"]


def test_paired_table_keeps_a_label_without_baseline_runs():
    s = pd.DataFrame(
        [
            {
                "sweep": "s",
                "run": f"{a}{i}",
                "label": a,
                "arm": a,
                "seed": i,
                "point": {},
                "baseline": "hard",
                "pass@1": 0.4 + 0.01 * i,
            }  # fmt: skip
            for a in ("nsr", "soft")
            for i in range(3)
        ]
    )
    d = tables.paired_vs_baseline(s, ["pass@1"])
    assert list(d["label"]) == ["nsr", "soft"] and set(d["vs"]) == {"hard (no run)"} and (d["n"] == 0).all()


def test_one_run_readout_recomputes_from_the_files(tmp_path):
    """analysis.readings' one-run table (docs/testbed.md, "What a tiny run shows"): pass@1 / pass@8 from the sampled
    eval rows of the first and last eval, window means of metrics.jsonl, recomputed here from the raw files."""
    from analysis.readings import one_run_row, one_run_table
    from devtools.synthetic_runs import ArmSpec, write_sweep

    (run_id,) = write_sweep(tmp_path, "delta", {"hard": ArmSpec()}, seeds=[0], steps=50, every=10, n_prompts=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        rs = load_runs(tmp_path)
    got = one_run_row(rs, f"delta/{run_id}")
    folder = tmp_path / "delta" / run_id
    rows = [json.loads(line) for line in gzip.open(folder / "eval.jsonl.gz", "rt")]
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for name, step in (("first", 0), ("last", 50)):
        per_problem = {}
        for r in rows:
            if r["step"] == step and r["decoding"] == "sampled":
                per_problem.setdefault(r["problem_id"], []).append(r["correct"])
        assert got[f"pass@1 {name}"] == pytest.approx(np.mean([np.mean(v) for v in per_problem.values()]))
        assert got[f"pass@8 {name}"] == pytest.approx(
            np.mean([brute_pass_at_k(8, sum(v), 8) for v in per_problem.values()])
        )
    assert got["entropy first"] == pytest.approx(np.mean([m["entropy"] for m in metrics[:10]]))
    clipped = [m["clip_frac_low"] + m["clip_frac_high"] for m in metrics[-10:]]
    assert got["clip_frac last"] == pytest.approx(np.mean(clipped))
    assert got["steps"] == (1, 10, 41, 50) and got["evals"] == (0, 50)
    table = one_run_table(rs, "delta", 0, ["hard", "nsr delta=0.2"])
    assert f"`delta/{run_id}`" in table and "| nsr delta=0.2 | (no run) |" in table
    assert table.endswith("(evals at steps 0 and 50; step windows 1-10 and 41-50)")  # also when the last is missing


def test_hard_run_proxies_recompute_from_the_files(tmp_path):
    """analysis.readings' clip fraction by seed and in-zone clipped mass per token of a regime candidate's hard runs
    (docs/evidence.md), recomputed here from metrics.jsonl and ratio_bins.jsonl; other arms are not read."""
    from analysis.readings import hard_run_proxies
    from devtools.synthetic_runs import ArmSpec, write_folder
    from experiments.sweep import expand

    specs = [s for s in expand("regime_a2") if s.meta["point"]["regime"] == "tl44" and s.config.seed in (101, 102)]
    bins = {101: ([5, 3, 0, 0, 0, 0, 0, 0, 0, 1, 2], [4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 6]),
            102: ([1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 3])}  # fmt: skip
    clip = {}
    for spec in specs:
        folder = tmp_path / "regime_a2" / spec.run_id
        write_folder(folder, spec.config, dict(spec.meta), ArmSpec())
        if spec.meta["arm"] != "hard":
            continue
        pos, neg = bins[spec.config.seed]
        rows = [{"step": 1, "delta": 0.2, "executor": "noisy", "pos_clipped": pos, "neg_clipped": neg,
                 "pos_rescued": [0] * 11, "neg_rescued": [0] * 11, "pos_weight": [0.0] * 11,
                 "neg_weight": [0.0] * 11}]  # fmt: skip
        (folder / "ratio_bins.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        metrics = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        clip[spec.config.seed] = np.mean([m["clip_frac_low"] + m["clip_frac_high"] for m in metrics])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        (got,) = hard_run_proxies(load_runs(tmp_path))
    assert (got["sweep"], got["candidate"], got["seeds"], got["delta"]) == ("regime_a2", "tl44", [101, 102], 0.2)
    assert got["clip_by_seed"] == pytest.approx([clip[101], clip[102]])
    assert (got["clip_min"], got["clip_max"]) == pytest.approx((min(clip.values()), max(clip.values())))
    in_zone, total = (9 + 4) + (1 + 4), (11 + 10) + (1 + 7)  # bins 0-9 of both sides / all clipped tokens
    assert got["in_zone_share"] == pytest.approx(in_zone / total)
    assert got["in_zone_mass"] == pytest.approx(np.mean(list(clip.values())) * in_zone / total)
