"""analysis.claims: the verdict rule, the claims file against the real sweep files, and bad claims files."""

import math

import numpy as np
import pandas as pd
import pytest

from analysis import claims
from analysis.claims import CONTRADICTS, INCONCLUSIVE, NO_DATA, SUPPORTS, Comparison, Side
from analysis.summary import STEP_METRICS
from sweeps import load_sweep


@pytest.mark.parametrize(
    "expect, lo, hi, margin, want",
    [
        ("greater", 0.01, 0.2, 0, SUPPORTS),
        ("greater", -0.2, -0.01, 0, CONTRADICTS),
        ("greater", -0.01, 0.2, 0, INCONCLUSIVE),
        ("less", -0.2, -0.01, 0, SUPPORTS),
        ("less", 0.01, 0.2, 0, CONTRADICTS),
        ("less", -0.2, 0.01, 0, INCONCLUSIVE),
        ("not_less", -0.01, 0.05, 0.02, SUPPORTS),  # at worst 0.01 below: within the 0.02 margin
        ("not_less", -0.05, -0.03, 0.02, CONTRADICTS),  # surely more than 0.02 worse
        ("not_less", -0.05, 0.01, 0.02, INCONCLUSIVE),
        ("not_greater", -0.05, 0.005, 0.01, SUPPORTS),
        ("not_greater", 0.02, 0.05, 0.01, CONTRADICTS),
        ("not_greater", -0.05, 0.02, 0.01, INCONCLUSIVE),
    ],
)
def test_verdict_rule(expect, lo, hi, margin, want):
    t = Comparison(Side("a", {}), Side("b", {}), "pass@1", expect, margin)
    assert claims.verdict(t, lo, hi, 5, min_pairs=3) == want


def test_too_few_seeds_or_none():
    t = Comparison(Side("a", {}), Side("b", {}), "pass@1", "greater")
    assert claims.verdict(t, 0.1, 0.2, 2, min_pairs=3) == INCONCLUSIVE
    assert claims.verdict(t, math.nan, math.nan, 0, min_pairs=3) == NO_DATA


def test_combine():
    assert claims.combine([SUPPORTS, SUPPORTS, NO_DATA]) == SUPPORTS
    assert claims.combine([CONTRADICTS, INCONCLUSIVE]) == CONTRADICTS
    assert claims.combine([CONTRADICTS, SUPPORTS]) == INCONCLUSIVE  # mixed evidence
    assert claims.combine([SUPPORTS, INCONCLUSIVE]) == INCONCLUSIVE
    assert claims.combine([NO_DATA]) == NO_DATA


def summary_of(values: dict[str, list[float]], metric="pass@1") -> pd.DataFrame:
    rows = [
        {"sweep": "s", "label": arm, "arm": arm, "point": {}, "seed": i, "baseline": "hard", metric: v}
        for arm, vs in values.items()
        for i, v in enumerate(vs)
    ]
    return pd.DataFrame(rows)


def evaluate_one(values, expect="greater", margin=0.0, metric="pass@1"):
    c = claims.Claim("c", "claim", "src", "s", (Comparison(Side("nsr", {}), Side("hard", {}), metric, expect, margin),))
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
    assert mixed["verdict"] == INCONCLUSIVE


def test_three_same_sign_seeds_are_not_enough_for_a_noisy_difference():
    # the bootstrap alone would call this significant (all three differences > 0); the t interval does not
    res = evaluate_one({"hard": [0.3, 0.3, 0.3], "nsr": [0.31, 0.8, 0.32]})
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
    known_metrics = set(STEP_METRICS) | {"pass@1", "greedy"}
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
            ONE + "[{a: {arm: n, at: 1}, b: h, metric: m, expect: less}]}]",
            "a=.* is not valid",
        ),
        ("min_pairs: 1\nclaims: []", "min_pairs=1 is not valid"),
        ("claimz: []", "unknown key 'claimz'"),
    ],
)
def test_bad_claims_file(tmp_path, text, match):
    p = tmp_path / "claims.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        claims.load_claims(p)
