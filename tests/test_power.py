"""analysis.power: the paired-design sample size, checked against an independent closed form and a Monte-Carlo
estimate of the paired t-test's power (a few seconds)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from analysis import power as P
from analysis import stats


def guenther_n(sd, effect, alpha, power, m):
    """Guenther's (1981) closed form for the one-sample t-test: z-approximation + z_{alpha/2}^2 / 2."""
    za = sps.norm.ppf(1 - alpha / m / 2)
    zb = sps.norm.ppf(power)
    return math.ceil(((za + zb) * sd / effect) ** 2 + za**2 / 2)


@pytest.mark.parametrize("sd", [0.015, 0.028, 0.05])
@pytest.mark.parametrize("effect", [0.01, 0.02])
@pytest.mark.parametrize("m", [1, 3])
def test_n_agrees_with_guenther_closed_form(sd, effect, m):
    n = P.n_paired(sd, effect, 0.05, 0.8, m)
    assert abs(n - guenther_n(sd, effect, 0.05, 0.8, m)) <= 1
    assert P.power_paired(n, sd, effect, 0.05, m) >= 0.8 > P.power_paired(n - 1, sd, effect, 0.05, m)


def test_the_issue_numbers_are_what_it_computes():
    """Issue 12 quotes: SD 0.028, effect 0.01 -> about 64 pairs, about 85 with Holm over 3; 0.02 -> about 18-23."""
    assert P.n_paired(0.028, 0.01) == 64
    assert P.n_paired(0.028, 0.01, contrasts=3) == 85
    assert P.n_paired(0.028, 0.02) == 18
    assert P.n_paired(0.028, 0.02, contrasts=3) == 24  # alpha / 3 (Holm's first step) asks one more than 23


@pytest.mark.parametrize("n,m", [(64, 1), (85, 3), (12, 1)])
def test_power_matches_monte_carlo(n, m):
    """Simulated paired differences N(effect, sd): the t-test's rejection rate is the computed power."""
    sd, effect, alpha, reps = 0.028, 0.01, 0.05, 20_000
    rng = np.random.default_rng(n * 10 + m)
    d = rng.normal(effect, sd, size=(reps, n))
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
    rate = float((np.abs(t) > sps.t.ppf(1 - alpha / m / 2, n - 1)).mean())
    want = P.power_paired(n, sd, effect, alpha, m)
    assert abs(rate - want) < 4 * math.sqrt(want * (1 - want) / reps)


def test_mde_inverts_n():
    for pairs in (20, 88, 128):
        e = P.mde(pairs, 0.028, contrasts=3)
        assert P.power_paired(pairs, 0.028, e, contrasts=3) == pytest.approx(0.8, abs=1e-6)
        assert P.n_paired(0.028, e * 1.0001, contrasts=3) <= pairs


def test_t_interval_is_scipys():
    x = [0.01, -0.02, 0.03, 0.005, 0.0]
    mean, lo, hi, n = stats.interval(x + [float("nan")])
    ref = sps.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=sps.sem(x))
    assert n == 5 and mean == pytest.approx(np.mean(x))
    assert (lo, hi) == pytest.approx(ref)
    assert math.isnan(stats.interval([1.0])[1])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sd": 0.0, "effect": 0.01}, r"sd=0\.0 is not valid; allowed: a finite number > 0"),
        ({"sd": 0.03, "effect": 0.0}, r"effect=0\.0 is not valid"),
        ({"sd": 0.03, "effect": 0.01, "contrasts": 0}, r"contrasts=0 is not valid; allowed: an integer >= 1"),
        ({"sd": 0.03, "effect": 0.01, "power": 1.0}, r"power=1\.0 is not valid"),
    ],
)
def test_bad_designs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        P.n_paired(**kwargs)


def test_cli_prints_the_computed_table(capsys):
    assert P.main([]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| late_pass1"))
    assert row.split("|")[2:6] == [" 64 ", " 85 ", " 18 ", " 24 "]
    assert P.main(["n", "--sd", "0.028", "--effect", "0.01", "--contrasts", "3"]) == 0
    assert capsys.readouterr().out.strip() == "85"
    assert P.main(["n", "--sd", "-1", "--effect", "0.01"]) == 2
    assert "sd=-1.0 is not valid" in capsys.readouterr().err
