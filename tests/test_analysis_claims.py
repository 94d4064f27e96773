"""analysis.claims: the verdict rule, the claims file against the real sweep files, and bad claims files."""

import math

import numpy as np
import pandas as pd
import pytest

from analysis import claims, tables
from analysis.claims import CONTRADICTS, INCONCLUSIVE, NO_DATA, NOT_REPRODUCED, SUPPORTS, Comparison, Side
from analysis.summary import STEP_METRICS
from experiments.sweep import load_sweep


@pytest.mark.parametrize(
    "expect, mean, p_holm, power, want",
    [
        ("greater", 0.05, 0.01, 0.9, SUPPORTS),
        ("greater", -0.05, 0.01, 0.9, CONTRADICTS),
        ("greater", 0.01, 0.30, 0.9, NOT_REPRODUCED),  # powered to see the sesoi, saw nothing
        ("greater", 0.01, 0.30, 0.5, INCONCLUSIVE),  # not powered: no conclusion
        ("less", -0.05, 0.01, 0.1, SUPPORTS),
        ("less", 0.05, 0.01, 0.1, CONTRADICTS),
        ("less", 0.0, 0.9, 0.95, NOT_REPRODUCED),
        ("not_less", 0.0, 0.01, 0.9, SUPPORTS),  # the test is of mean = -margin; 0 is above it
        ("not_less", -0.05, 0.01, 0.9, CONTRADICTS),
        ("not_less", -0.01, 0.2, 0.99, INCONCLUSIVE),  # no-harm claims are never "not reproduced"
        ("not_greater", 0.0, 0.01, 0.9, SUPPORTS),
        ("not_greater", 0.05, 0.01, 0.9, CONTRADICTS),
    ],
)
def test_verdict_rule(expect, mean, p_holm, power, want):
    t = Comparison(Side("a", {}), Side("b", {}), "pass@1", expect, 0.02, 0.02)
    assert claims.verdict(t, mean, p_holm, power, 5, min_pairs=3) == want


def test_too_few_seeds_or_none():
    t = Comparison(Side("a", {}), Side("b", {}), "pass@1", "greater", 0.0, 0.02)
    assert claims.verdict(t, 0.1, 0.001, 1.0, 2, min_pairs=3) == INCONCLUSIVE
    assert claims.verdict(t, math.nan, math.nan, math.nan, 0, min_pairs=3) == NO_DATA


def test_combine():
    assert claims.combine([SUPPORTS, SUPPORTS]) == SUPPORTS
    assert claims.combine([SUPPORTS, SUPPORTS, NO_DATA]) == INCONCLUSIVE  # a planned part has no runs yet
    assert claims.combine([CONTRADICTS, INCONCLUSIVE]) == CONTRADICTS
    assert claims.combine([CONTRADICTS, SUPPORTS]) == INCONCLUSIVE  # mixed evidence
    assert claims.combine([SUPPORTS, INCONCLUSIVE]) == INCONCLUSIVE
    assert claims.combine([NOT_REPRODUCED, INCONCLUSIVE]) == NOT_REPRODUCED  # a powered part saw nothing
    assert claims.combine([NOT_REPRODUCED, CONTRADICTS]) == CONTRADICTS
    assert claims.combine([NO_DATA]) == NO_DATA


def summary_of(values: dict[str, list[float]], metric="pass@1") -> pd.DataFrame:
    rows = [
        {"sweep": "s", "label": arm, "arm": arm, "point": {}, "seed": i, "baseline": "hard", metric: v}
        for arm, vs in values.items()
        for i, v in enumerate(vs)
    ]
    return pd.DataFrame(rows)


def evaluate_one(values, expect="greater", margin=0.0, metric="pass@1", sesoi=0.02):
    t = Comparison(Side("nsr", {}), Side("hard", {}), metric, expect, margin, sesoi)
    c = claims.Claim("c", "claim", "src", "s", (t,))
    return claims.evaluate(summary_of(values, metric), [c], min_pairs=3)[0]


def test_evaluate_pairs_by_seed():
    hard = [0.30, 0.35, 0.32, 0.40, 0.31]
    res = evaluate_one({"hard": hard, "nsr": [h + d for h, d in zip(hard, [0.05, 0.06, 0.04, 0.05, 0.05])]})
    row = res["rows"][0]
    assert res["verdict"] == SUPPORTS and row["n"] == 5 and row["mean"] == pytest.approx(0.05)
    # the seed effect (0.30 .. 0.40) is larger than the arm effect: only pairing makes it significant
    assert row["lo"] > 0 and row["hi"] < 0.1
    worse = evaluate_one({"hard": hard, "nsr": [h - 0.05 for h in hard]})
    assert worse["verdict"] == CONTRADICTS
    mixed = evaluate_one({"hard": hard, "nsr": [h + d for h, d in zip(hard, [0.05, -0.04, 0.01, -0.02, 0.03])]})
    assert mixed["verdict"] == INCONCLUSIVE and mixed["rows"][0]["power"] < 0.8
    # ten seeds, differences within +-0.005 of 0: the test could see 0.02 and saw nothing
    tight = [0.003, -0.004, 0.001, 0.0, -0.002, 0.004, -0.001, 0.002, -0.003, 0.0]
    null = evaluate_one(
        {"hard": [0.3 + i / 100 for i in range(10)], "nsr": [0.3 + i / 100 + d for i, d in enumerate(tight)]}
    )
    assert null["verdict"] == NOT_REPRODUCED and null["rows"][0]["power"] > 0.99 and null["power"] > 0.99


def test_holm_corrects_the_comparisons_of_one_claim():
    hard = [0.30, 0.35, 0.32, 0.40, 0.31]
    d = [0.02, 0.05, 0.0, 0.04, 0.03]  # t = 3.26, p = 0.031 alone: supports
    nsr = [h + x for h, x in zip(hard, d)]
    one = evaluate_one({"hard": hard, "nsr": nsr})
    assert one["verdict"] == SUPPORTS and one["rows"][0]["p_holm"] == pytest.approx(one["rows"][0]["p"])
    s = summary_of({"hard": hard, "nsr": nsr})
    s["pass@2"] = s["pass@3"] = s["pass@1"]
    tests = tuple(
        Comparison(Side("nsr", {}), Side("hard", {}), m, "greater", 0.0, 0.02) for m in ("pass@1", "pass@2", "pass@3")
    )
    three = claims.evaluate(s, [claims.Claim("c", "x", "y", "s", tests)], min_pairs=3)[0]
    p = three["rows"][0]["p"]
    assert p < 0.05 < 3 * p
    assert [r["p_holm"] for r in three["rows"]] == pytest.approx([3 * p] * 3)  # three equal p-values: each x 3
    assert three["verdict"] == INCONCLUSIVE  # significant alone, not after Holm; too few seeds to be powered
    # the interval shown is the unadjusted one, the same as the tables'
    assert (three["rows"][0]["lo"], three["rows"][0]["hi"]) == (one["rows"][0]["lo"], one["rows"][0]["hi"])


def test_three_same_sign_seeds_are_not_enough_for_a_noisy_difference():
    # a percentile bootstrap would call this significant (all three differences > 0); the t-interval does not
    res = evaluate_one({"hard": [0.3, 0.31, 0.29], "nsr": [0.31, 0.8, 0.32]})
    assert res["rows"][0]["lo"] < 0 and res["verdict"] == INCONCLUSIVE


def test_missing_arm_and_missing_metric():
    res = evaluate_one({"hard": [0.3, 0.3, 0.3]})
    assert res["verdict"] == NO_DATA and res["rows"][0]["note"] == "no runs"
    c = claims.Claim("c", "x", "y", "s", (Comparison(Side("nsr", {}), Side("widened", {}), "pass@1", "greater"),))
    res = claims.evaluate(summary_of({"hard": [0.3] * 3, "nsr": [0.4] * 3}), [c])[0]
    assert res["verdict"] == NO_DATA and res["rows"][0]["note"] == "no runs of widened"
    md = claims.render([res])
    assert "nsr − widened > 0" in md and "**no data**" in md


@pytest.mark.parametrize("path, at_least", [(claims.CLAIMS_FILE, 7), (claims.CLAIMS_FILE.with_name("posthoc.yaml"), 4)])
def test_claims_file_names_real_sweeps_arms_axes_and_metrics(path, at_least):
    claim_list, min_pairs = claims.load_claims(path)
    assert min_pairs >= 3 and len(claim_list) >= at_least
    known_metrics = set(STEP_METRICS) | {"pass@1", "late_pass@1", "greedy"}
    for c in claim_list:
        sw = load_sweep(c.sweep)
        for t in c.tests:
            assert t.metric in known_metrics, (c.id, t.metric)
            for side in (t.a, t.b):
                assert side.arm in sw.arms, (c.id, side.arm, list(sw.arms))
                arm = sw.arms[side.arm]
                axes = set(arm["grid"]) | set(arm["factors"])
                assert set(side.point) <= axes, (c.id, side, axes)
                for k, v in side.point.items():
                    allowed = arm["grid"][k] if k in arm["grid"] else [lab for lab, _ in arm["factors"][k]]
                    assert any(np.isclose(v, a) for a in allowed), (c.id, k, v, allowed)


ONE = "claims: [{id: a, claim: x, source: y, sweep: s, tests: "


@pytest.mark.parametrize(
    "text, match",
    [
        ("claims: [{id: a, claim: x, source: y, sweep: s}]", "needs exactly the keys"),
        ("claims: [{id: a, claim: x, source: y, sweep: s, tests: []}]", "tests is empty"),
        (
            "claims: [{id: a, claim: x, source: y, sweep: s, tests: [{a: n, b: h, metric: m, expect: bigger}]}]",
            "expect='bigger' is not valid; allowed: greater, less, not_less, not_greater",
        ),
        (
            ONE + "[{a: n, b: h, metric: m, expect: less, margin: -1}]}]",
            "margin=-1 is not valid",
        ),
        (
            ONE + "[{a: {arm: n, at: 1}, b: h, metric: m, expect: less, sesoi: 0.1}]}]",
            "a=.* is not valid",
        ),
        (ONE + "[{a: n, b: h, metric: m, expect: less}]}]", "sesoi=None is not valid; allowed: a number > 0"),
        (ONE + "[{a: n, b: h, metric: m, expect: less, sesoi: 0.1}, {a: n, a: h}]}]", "duplicate key 'a'"),
        ("min_pairs: 1\nclaims: []", "min_pairs=1 is not valid"),
        ("claimz: []", "unknown key 'claimz'"),
    ],
)
def test_bad_claims_file(tmp_path, text, match):
    p = tmp_path / "claims.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        claims.load_claims(p)


def test_pairs_of_a_legacy_and_a_current_run_are_counted_and_shown():
    s = summary_of({"hard": [0.40, 0.42, 0.38], "nsr": [0.45, 0.44, 0.43]})
    s["legacy"] = [False, False, False, True, False, True]  # nsr seeds 0 and 2 made by older code
    (row,) = claims.comparisons(s, Comparison(Side("nsr", {}), Side("hard", {}), "pass@1", "greater", 0.0, 0.02))
    assert row["n"] == 3 and row["mixed"] == 2
    assert tables.compare(s, "nsr", "hard", "pass@1")["mixed"] == 2
    claim = claims.Claim(
        "c",
        "nsr beats hard",
        "test",
        "s",
        (Comparison(Side("nsr", {}), Side("hard", {}), "pass@1", "greater", 0.0, 0.02),),
    )
    text = claims.render(claims.evaluate(s, [claim]))
    assert "(3; 2 legacy/current)" in text


def test_holm_counts_planned_comparisons_without_runs():
    s = summary_of({"hard": [0.40, 0.42, 0.38, 0.41], "nsr": [0.50, 0.53, 0.47, 0.52]})
    t_have = Comparison(Side("nsr", {}), Side("hard", {}), "pass@1", "greater", 0.0, 0.02)
    t_none = Comparison(Side("soft", {}), Side("hard", {}), "pass@1", "greater", 0.0, 0.02)
    one = claims.evaluate(s, [claims.Claim("a", "x", "src", "s", (t_have,))])[0]
    two = claims.evaluate(s, [claims.Claim("b", "x", "src", "s", (t_have, t_none))])[0]
    p1, p2 = one["rows"][0]["p_holm"], two["rows"][0]["p_holm"]
    assert p2 == pytest.approx(min(1.0, 2 * p1))  # the family has two planned comparisons, one without runs
    assert two["verdict"] != claims.SUPPORTS  # supporting one part while the other has no runs is not support


def test_power_uses_the_upper_confidence_limit_of_the_sd():
    """3 seeds with a lucky small SD must not make a comparison 'powered': power is computed at the upper 80% limit
    of the SD (chi-square, 2 df: a factor sqrt(2 / chi2.ppf(0.2, 2)) = 2.12), not at the observed SD."""
    from analysis.stats import power

    t = Comparison(Side("a", {}), Side("b", {}), "pass@1", "greater", 0.0, 0.02)
    at_observed = power(0.02, 0.006, 3)
    got = claims._power_at_sesoi(t, 0.006, 3, 1)
    assert at_observed > 0.8 > got
    assert got == pytest.approx(power(0.02, 0.006 * math.sqrt(2 / 0.4462871026284195), 3))


def test_a_metric_that_does_not_move_is_untestable_not_a_null():
    """No hard and no nsr run spikes (entropy_spike 0 everywhere): 'NSR avoids the baseline's spikes' cannot be tested
    here; a zero difference must not read as a powered null (issue: power was taken as 1). A flat baseline against an
    arm that moves is an effect, tested as any other."""
    import pandas as pd

    from analysis.claims import UNTESTABLE, Comparison, Side, combine, comparisons, verdict

    s = pd.DataFrame({"label": ["hard"] * 4 + ["nsr"] * 4, "arm": ["hard"] * 4 + ["nsr"] * 4, "seed": [0, 1, 2, 3] * 2,
                      "point": [{}] * 8, "legacy": [False] * 8, "entropy_spike": [0.0] * 8})  # fmt: skip
    t = Comparison(Side("nsr", {}), Side("hard", {}), "entropy_spike", "less", 0.0, 0.41)
    (row,) = comparisons(s, t)
    assert row["untestable"] and "no variation in nsr nor hard" in row["note"]
    assert verdict(t, row["mean"], 1.0, 1.0, row["n"], 3, row["untestable"]) == UNTESTABLE
    s.loc[s["label"] == "hard", "entropy_spike"] = [0.0, 0.5, 0.0, 0.2]  # the baseline spikes now: testable
    (row,) = comparisons(s, t)
    assert not row["untestable"]
    s.loc[s["label"] == "hard", "entropy_spike"] = 0.0  # a flat baseline, the other arm spikes: an effect, testable
    s.loc[s["label"] == "nsr", "entropy_spike"] = [1.0, 2.0, 1.5, 1.0]
    (row,) = comparisons(s, t)
    assert not row["untestable"] and row["n"] == 4 and row["mean"] == pytest.approx(1.375)
    assert combine([UNTESTABLE, "inconclusive"]) == UNTESTABLE and combine([UNTESTABLE, "contradicts"]) == "contradicts"


def test_an_untestable_row_shows_no_power():
    """A metric that does not move in either arm is untestable: the row has no power (it used to print 100%), and the
    claim's power is the smallest over the rows that have one."""
    s = summary_of({"hard": [0.0] * 4, "nsr": [0.0] * 4}, metric="entropy_spike")
    s["reward_auc"] = [0.40, 0.42, 0.38, 0.41, 0.41, 0.45, 0.37, 0.43]
    flat = Comparison(Side("nsr", {}), Side("hard", {}), "entropy_spike", "less", 0.0, 0.41)
    moves = Comparison(Side("nsr", {}), Side("hard", {}), "reward_auc", "greater", 0.0, 0.01)
    (res,) = claims.evaluate(s, [claims.Claim("c", "x", "src", "s", (flat, moves))])
    untestable, tested = res["rows"]
    assert untestable["verdict"] == claims.UNTESTABLE and math.isnan(untestable["power"])
    assert 0 < tested["power"] < 1 and res["power"] == tested["power"]
    cell = claims.render([res]).splitlines()[2].split(" | ")[4]  # the power column of the claim's row
    assert cell.split("<br>") == ["–", f"{100 * tested['power']:.0f}%"]


def test_a_powered_null_outweighs_an_untestable_part():
    """A claim needs all its parts: a part that saw nothing with 80% power makes it 'not reproduced at this scale'
    even where another part cannot be tested here; without the powered null it stays 'untestable here'."""
    from analysis.claims import UNTESTABLE

    assert claims.combine([INCONCLUSIVE, UNTESTABLE, NOT_REPRODUCED]) == NOT_REPRODUCED
    assert claims.combine([UNTESTABLE, NOT_REPRODUCED, NO_DATA]) == NOT_REPRODUCED
    assert claims.combine([INCONCLUSIVE, UNTESTABLE]) == UNTESTABLE
    assert claims.combine([UNTESTABLE, NOT_REPRODUCED, CONTRADICTS]) == CONTRADICTS


def test_the_judge_executor_claim_takes_in_the_collapse_test():
    claim = next(c for c in claims.load_claims()[0] if c.id == "judge_executor")
    assert claim.collapse == claims.CollapseTest("judge_executor_sigma", 0.1)
    assert load_sweep(claim.collapse.sweep).arms.keys() >= {"noisy_decision", "clean_decision"}
    loaded = claims.load_claims()[0]
    assert claims.collapse_sesoi(loaded, "judge_executor_sigma") == 0.1 and claims.collapse_sesoi(loaded, "x") is None
    from analysis.collapse import claims_sesoi  # the command line's default: the same value, read as data

    assert claims_sesoi() == 0.1 and claims_sesoi(sweep="delta") is None
    # without the run folders the collapse rows have no data, one per planned sigma; the claim cannot be decided
    s = summary_of({"hard": [0.3] * 3})
    (res,) = claims.evaluate(s, [claim])
    coll = [r for r in res["rows"] if r.get("kind") == "collapse"]
    assert [r["a"] for r in coll] == [f"noisy_decision ratio_noise={x}" for x in (0.3, 0.4, 0.5)]
    assert {r["verdict"] for r in coll} == {NO_DATA} and res["verdict"] == NO_DATA and res["testbed"] == "–"
    md = claims.render([res])
    assert "collapse test (pre-registered): late_reward: noisy_decision ratio_noise=0.3" in md
    assert "in ≥ 3 of 5 seeds (sesoi: mean drop 0.100)" in md and "collapse test: sweep `judge_executor_sigma`" in md


@pytest.mark.parametrize(
    "collapse, match",
    [
        ("{sweep: judge_executor_sigma}", r"collapse=.* is not valid; allowed: \{sweep: NAME, sesoi: DROP\}"),
        ("{sweep: judge_executor_sigma, sesoi: 0}", "collapse.sesoi=0 is not valid; allowed: a number > 0"),
        ("{sweep: s, sesoi: 0.1, seeds: 5}", "collapse=.* is not valid"),
    ],
)
def test_bad_collapse_entry(tmp_path, collapse, match):
    p = tmp_path / "claims.yaml"
    p.write_text(ONE + f"[{{a: n, b: h, metric: m, expect: less, sesoi: 0.1}}], collapse: {collapse}}}]")
    with pytest.raises(ValueError, match=match):
        claims.load_claims(p)


def test_testbed_is_read_from_the_runs_configs():
    """The testbed column names the preset, model, task and RL steps of the claim's runs (every sweep it reads)."""
    from types import SimpleNamespace

    members = pd.DataFrame({"sweep": ["a", "a", "b", "c"], "run": ["r1", "r2", "r3", "r4"],
                            "preset": ["tiny", "tiny", "tiny-regime", "other"]})  # fmt: skip
    included = pd.DataFrame({"run": ["r1", "r2", "r3", "r4"], "model.name": ["tiny-gpt2"] * 4,
                             "model.d_model": [64, 64, 128, 64], "model.n_layer": [2, 2, 4, 2],
                             "task.name": ["countdown3", "countdown3", "countdown4", "countdown3"],
                             "train.steps": [400, 400, 400, 30]})  # fmt: skip
    rs = SimpleNamespace(members=members, included=included)
    assert claims.testbed(rs, ["a"]) == "`tiny`: tiny-gpt2 d64 x 2 layers, countdown3, 400 RL steps"
    assert claims.testbed(rs, ["a", "b"]) == (
        "`tiny`: tiny-gpt2 d64 x 2 layers, countdown3, 400 RL steps; "
        "`tiny-regime`: tiny-gpt2 d128 x 4 layers, countdown4, 400 RL steps"
    )
    assert claims.testbed(rs, ["nope"]) == "–" and claims.testbed(None, ["a"]) == "–"
