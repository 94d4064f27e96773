"""The paper's claims, checked on the CPU grid: supports / contradicts / not reproduced at this scale / untestable
here / inconclusive, with the numbers.

    python -m analysis.claims [--runs results/runs]      # print the claims table (make_all also writes it)
    python -m analysis.claims --claims analysis/posthoc.yaml   # the post-hoc readings, labelled as such

The claims are data (analysis/claims.yaml): each is a list of planned paired comparisons ``a - b`` of one summary
metric between two arms of one sweep, with the direction the paper predicts and the smallest effect of interest
(``sesoi``). Each comparison shows the same 95% Student-t interval of the same-seed differences as the tables and
figures (analysis.stats.interval). Its verdict comes from the t-test p-values, Holm-corrected over the comparisons
of its claim; a directional comparison that is not significant is "not reproduced at this scale" when the test had
>= 80% power to see the smallest effect of interest (at the upper 80% confidence limit of the paired SD, level
0.05 / number of planned comparisons),
and "inconclusive" when it did not.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.stats as sps

from analysis.stats import ALPHA, POWER_TARGET, holm, interval, paired_differences, power, t_test
from analysis.summary import pairs
from analysis.tables import counterparts, fmt, mixed_pairs, select_labels
from experiments.config import ConfigError
from experiments.yamlio import load_yaml
from nsr.registry import Registry
from nsr.validate import check, check_choice, is_number

CLAIMS_FILE = Path(__file__).with_name("claims.yaml")
POSTHOC_FILE = Path(__file__).with_name("posthoc.yaml")
SUPPORTS, CONTRADICTS, INCONCLUSIVE, NO_DATA = "supports", "contradicts", "inconclusive", "no data"
NOT_REPRODUCED = "not reproduced at this scale"
UNTESTABLE = "untestable here"
"""A comparison whose baseline arm shows no variation over the pairs (e.g. no hard run has an entropy spike): what the
claim says a rule avoids or changes does not happen here, so no power can be claimed for it."""

# expect -> (null value of a - b given the margin, sign of a - b the paper predicts). The test is of mean = null;
# a significant mean on the predicted side supports, on the other side contradicts.
EXPECT: Registry = Registry("expect")
EXPECT.register("greater")(lambda margin: (0.0, 1))
EXPECT.register("less")(lambda margin: (0.0, -1))
EXPECT.register("not_less")(lambda margin: (-margin, 1))
EXPECT.register("not_greater")(lambda margin: (margin, -1))
DIRECTIONAL = ("greater", "less")
"""Comparisons that predict an effect (they need a sesoi); the others predict no harm beyond a margin."""


SYMBOL = {"greater": "> 0", "less": "< 0", "not_less": "> -{m}", "not_greater": "< {m}"}


@dataclass(frozen=True)
class Side:
    """An arm, optionally pinned to grid values."""

    arm: str
    point: dict

    def __str__(self) -> str:
        return self.arm + "".join(
            f" {k.rsplit('.', 1)[-1]}={v:g}" if isinstance(v, float) else f" {k}={v}" for k, v in self.point.items()
        )


@dataclass(frozen=True)
class Comparison:
    a: Side
    b: Side
    metric: str
    expect: str
    margin: float = 0.0
    sesoi: float = math.nan
    """Smallest effect of interest (metric units) for greater / less: what "not reproduced" has the power to see."""


@dataclass(frozen=True)
class Claim:
    id: str
    claim: str
    source: str
    sweep: str
    tests: tuple[Comparison, ...]


def _side(value, where: str) -> Side:
    if isinstance(value, str):
        return Side(value, {})
    if isinstance(value, dict) and set(value) <= {"arm", "point"} and isinstance(value.get("arm"), str):
        point = value.get("point") or {}
        check(isinstance(point, dict), f"{where}.point", point, "a mapping of axis: value")
        return Side(value["arm"], dict(point))
    check(False, where, value, "an arm name or {arm: NAME, point: {axis: value}}")


def load_claims(path: str | Path = CLAIMS_FILE) -> tuple[list[Claim], int]:
    """(claims, min_pairs) from a claims file; ValueError naming the file and key on any bad entry."""
    path = Path(path)
    try:
        data = load_yaml(path) or {}
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping with keys min_pairs, claims")
    unknown = set(data) - {"min_pairs", "claims"}
    if unknown:
        raise ValueError(f"{path}: unknown key {sorted(unknown)[0]!r}; allowed: min_pairs, claims")
    min_pairs = data.get("min_pairs", 3)
    ok = isinstance(min_pairs, int) and not isinstance(min_pairs, bool) and min_pairs >= 2
    check(ok, f"{path}: min_pairs", min_pairs, "an integer >= 2")
    claims, seen = [], set()
    for i, c in enumerate(data.get("claims") or []):
        where = f"{path}: claims[{i}]"
        need = {"id", "claim", "source", "sweep", "tests"}
        if not isinstance(c, dict) or need - set(c) or set(c) - need:
            raise ValueError(f"{where}: needs exactly the keys {', '.join(sorted(need))}, got {sorted(c or {})}")
        if c["id"] in seen:
            raise ValueError(f"{where}.id={c['id']!r} is used twice")
        seen.add(c["id"])
        tests = []
        for j, t in enumerate(c["tests"] or []):
            tw = f"{where}.tests[{j}]"
            if not isinstance(t, dict) or {"a", "b", "metric", "expect"} - set(t):
                raise ValueError(f"{tw}: needs a, b, metric, expect (margin, sesoi optional), got {t!r}")
            extra = set(t) - {"a", "b", "metric", "expect", "margin", "sesoi"}
            if extra:
                raise ValueError(
                    f"{tw}: unknown key {sorted(extra)[0]!r}; allowed: a, b, metric, expect, margin, sesoi"
                )
            check_choice(f"{tw}.expect", t["expect"], EXPECT)
            margin = t.get("margin", 0.0)
            check(is_number(margin) and margin >= 0, f"{tw}.margin", margin, "a number >= 0")
            sesoi = t.get("sesoi")
            if t["expect"] in DIRECTIONAL:
                allowed = f"a number > 0 (the smallest effect of interest, needed by expect: {t['expect']})"
                check(is_number(sesoi) and sesoi > 0, f"{tw}.sesoi", sesoi, allowed)
            tests.append(
                Comparison(
                    _side(t["a"], f"{tw}.a"),
                    _side(t["b"], f"{tw}.b"),
                    str(t["metric"]),
                    t["expect"],
                    float(margin),
                    float(sesoi) if sesoi is not None else math.nan,
                )
            )
        if not tests:
            raise ValueError(f"{where}.tests is empty; allowed: a list of at least one test")
        claims.append(Claim(str(c["id"]), str(c["claim"]), str(c["source"]), str(c["sweep"]), tuple(tests)))
    return claims, min_pairs


# ------------------------------------------------------------------------------------------- evaluation
def verdict(
    test: Comparison, mean: float, p_holm: float, pw: float, n: int, min_pairs: int, untestable: bool = False
) -> str:
    """One comparison's verdict from its mean difference, Holm-adjusted p-value and power at the sesoi;
    ``untestable``: its baseline arm shows no variation (:data:`UNTESTABLE`)."""
    if n == 0:
        return NO_DATA
    if untestable and n >= min_pairs:
        return UNTESTABLE
    if n < min_pairs or not np.isfinite(p_holm):
        return INCONCLUSIVE
    null, sign = EXPECT[test.expect](test.margin)
    if p_holm < ALPHA:
        return SUPPORTS if sign * (mean - null) > 0 else CONTRADICTS
    if test.expect in DIRECTIONAL and np.isfinite(pw) and pw >= POWER_TARGET:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def combine(verdicts: list[str]) -> str:
    """A claim's verdict: supports if every planned comparison has data and supports; contradicts if some contradict
    and none support; untestable here if a part cannot be tested (its baseline shows no variation) and none
    contradicts; not reproduced at this scale if some powered comparison saw nothing and none contradicts (the
    claim needs all its parts); else inconclusive (also: supporting parts while others have no runs yet); no data
    when no comparison has data."""
    have = [v for v in verdicts if v != NO_DATA]
    if not have:
        return NO_DATA
    if all(v == SUPPORTS for v in have):
        return SUPPORTS if len(have) == len(verdicts) else INCONCLUSIVE
    if CONTRADICTS in have:
        return CONTRADICTS if SUPPORTS not in have else INCONCLUSIVE
    if UNTESTABLE in have:  # a part of the claim cannot be tested here, and no part contradicts it
        return UNTESTABLE
    if NOT_REPRODUCED in have:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def comparisons(s: pd.DataFrame, test: Comparison) -> list[dict]:
    """Every (label of a, its counterpart in b) pair of one test, with the paired difference of test.metric."""
    out = []
    ignore = set(test.a.point) | set(test.b.point)
    for la in select_labels(s, test.a.arm, test.a.point):
        cps = counterparts(s, la, test.b.arm, test.b.point, ignore=ignore)
        if len(cps) != 1 or test.metric not in s.columns:
            if test.metric not in s.columns:
                why = f"no {test.metric} in the runs"
            else:
                why = f"no runs of {test.b}" if not cps else f"{len(cps)} candidates: {', '.join(cps)}"
            out.append(
                {
                    "a": la,
                    "b": str(test.b),
                    "mean": math.nan,
                    "lo": math.nan,
                    "hi": math.nan,
                    "n": 0,
                    "note": why,
                    "p": math.nan,
                    "sd": math.nan,
                }
            )
            continue
        ga, gb = s[s["label"] == la], s[s["label"] == cps[0]]
        diffs, seeds = paired_differences(dict(zip(pairs(ga), ga[test.metric])), dict(zip(pairs(gb), gb[test.metric])))
        mean, lo, hi, n = interval(diffs)
        null, _ = EXPECT[test.expect](test.margin)
        sd = float(np.std(diffs, ddof=1)) if n >= 2 else math.nan
        base = dict(zip(pairs(gb), gb[test.metric]))
        flat = n >= 2 and len({float(base[k]) for k in seeds}) == 1  # the baseline arm shows no variation
        note = f"no variation in {cps[0]}: every run {fmt(float(base[seeds[0]]))}" if flat else ""
        out.append({"a": la, "b": cps[0], "mean": mean, "lo": lo, "hi": hi, "n": n, "note": note, "untestable": flat,
                    "p": t_test(diffs, null), "sd": sd, "mixed": mixed_pairs(s, la, cps[0], seeds)})  # fmt: skip
    return out


SD_CONFIDENCE = 0.8
"""Power uses the upper one-sided limit of the paired SD at this confidence."""


def _power_at_sesoi(test: Comparison, sd: float, n: int, m: int) -> float:
    """Power to see the sesoi (directional tests) or to show the margin with no true difference (the others), at
    level ALPHA / m (Holm's first step: the strictest level a comparison of the claim can face), at the upper
    one-sided 80% confidence limit of the paired SD (chi-square): with 3-5 seeds the observed SD alone can be small
    by luck and would call a comparison powered that is not."""
    if sd == 0 and n >= 2:
        return 1.0  # every seed gave the same difference (e.g. no spike in any run of either arm): taken as powered
    effect = test.sesoi if test.expect in DIRECTIONAL else test.margin
    if not (effect > 0) or n < 2 or not np.isfinite(sd):
        return math.nan
    sd_upper = sd * math.sqrt((n - 1) / sps.chi2.ppf(1 - SD_CONFIDENCE, n - 1))
    return power(effect, sd_upper, n, ALPHA / max(m, 1))


def evaluate(summary: pd.DataFrame, claims: list[Claim], min_pairs: int = 3) -> list[dict]:
    """Per claim: {claim, verdict, power, rows: [{test, a, b, mean, lo, hi, n, mixed, p, p_holm, power, verdict}]};
    Holm over every planned comparison of the claim (one without data counts, with p = 1)."""
    results = []
    for c in claims:
        s = summary[summary["sweep"] == c.sweep]
        rows = []
        for t in c.tests:
            comps = comparisons(s, t) if len(s) else []
            if not comps:
                comps = [{"a": str(t.a), "b": str(t.b), "mean": math.nan, "lo": math.nan, "hi": math.nan, "n": 0,
                          "note": "no runs", "p": math.nan, "sd": math.nan}]  # fmt: skip
            rows += [{"test": t, **r} for r in comps]
        # Holm over every planned comparison: one without data (fewer than min_pairs pairs) enters with p = 1
        m = len(rows)
        tested = [r["n"] >= min_pairs and np.isfinite(r["p"]) for r in rows]
        adjusted = holm([r["p"] if ok else 1.0 for r, ok in zip(rows, tested)])
        for r, ph, ok in zip(rows, adjusted, tested):
            r["p_holm"] = float(ph) if ok else math.nan
            r["power"] = _power_at_sesoi(r["test"], r["sd"], r["n"], m) if r["n"] else math.nan
            r["verdict"] = verdict(
                r["test"], r["mean"], r["p_holm"], r["power"], r["n"], min_pairs, r.get("untestable", False)
            )
        powers = [r["power"] for r in rows if np.isfinite(r["power"])]
        results.append({"claim": c, "verdict": combine([r["verdict"] for r in rows]), "rows": rows,
                        "power": min(powers) if powers else math.nan})  # fmt: skip
    return results


def _signed(x: float) -> str:
    return "–" if not np.isfinite(x) else ("+" if x > 0 else "") + fmt(x)


def _p(x: float) -> str:
    return "–" if not np.isfinite(x) else ("<0.001" if x < 0.001 else f"{x:.3f}")


def _pct(x: float) -> str:
    return "–" if not np.isfinite(x) else f"{100 * x:.0f}%"


def expectation(t: Comparison) -> str:
    """``late_pass@1: nsr − hard > 0 (sesoi 0.02)``."""
    rule = SYMBOL[t.expect].format(m=fmt(t.margin))
    extra = f" (sesoi {fmt(t.sesoi)})" if t.expect in DIRECTIONAL else ""
    return f"{rule}{extra}"


def render(results: list[dict], runs_hint: str = "--preset tiny", posthoc: bool = False) -> str:
    """The claims table (markdown): one row per claim, one line per comparison inside it."""
    header = (
        "| claim (paper) | comparison: expected | a − b [95% t-CI] (seeds) | Holm p | power at sesoi | verdict |\n"
        "|---|---|---|---|---|---|\n"
    )
    lines = []
    for res in results:
        c = res["claim"]
        tests, nums, ps, pws = [], [], [], []
        for r in res["rows"]:
            t = r["test"]
            tests.append(f"{t.metric}: {r['a']} − {r['b']} {expectation(t)}")
            if r["n"] == 0:
                nums.append(f"{r['verdict']}" + (f" ({r['note']})" if r.get("note") else ""))
            else:
                ci = f"[{_signed(r['lo'])}, {_signed(r['hi'])}]" if np.isfinite(r["lo"]) else "[–]"
                mixed = f"; {r['mixed']} legacy/current" if r.get("mixed") else ""
                why = f" ({r['note']})" if r.get("untestable") else ""
                nums.append(f"{_signed(r['mean'])} {ci} ({r['n']}{mixed}): {r['verdict']}{why}")
            ps.append(_p(r.get("p_holm", math.nan)))
            pws.append(_pct(r.get("power", math.nan)))
        claim = f"**{c.claim}** ({c.source}; sweep `{c.sweep}`)"
        lines.append(
            f"| {claim} | {'<br>'.join(tests)} | {'<br>'.join(nums)} | {'<br>'.join(ps)} | {'<br>'.join(pws)} "
            f"| **{res['verdict']}** |"
        )
    sweeps = sorted({res["claim"].sweep for res in results})
    label = "Post-hoc readings (chosen after seeing the grid; not planned tests). " if posthoc else ""
    regen = (
        f"{label}Regenerate: run the sweeps on the CPU testbed (`python -m slurm.submit SWEEP "
        f"{runs_hint}` for SWEEP in {', '.join(f'`{s}`' for s in sweeps)}), then `python -m analysis.make_all`. "
        "Rule (analysis/claims.py): 95% Student-t interval of the same-seed differences (the interval of every table "
        "and figure); t-test p-values Holm-corrected within a claim; a directional comparison that is not "
        "significant is *not reproduced at this scale* when its power to see the smallest effect of interest "
        "(sesoi, fixed per comparison in the claims file; upper 80% confidence limit of the paired SD, level 0.05 / "
        "planned comparisons) is >= 80%, else *inconclusive*; *untestable here* when the baseline arm shows no "
        "variation over the pairs (what the claim says a rule avoids does not happen here); fewer than min_pairs "
        "seeds is inconclusive; "
        '"k legacy/current" counts pairs of a run by older code and one by today\'s.\n'
    )
    return header + "\n".join(lines) + "\n\n" + regen


def main(argv=None) -> int:
    from analysis.load import RUNS_ROOT, load_runs
    from analysis.summary import summarize

    p = argparse.ArgumentParser(prog="python -m analysis.claims", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=str(RUNS_ROOT), help="results folder (<runs>/<sweep>/<run_id>/)")
    p.add_argument("--claims", default=str(CLAIMS_FILE), help="claims file")
    a = p.parse_args(argv)
    claims, min_pairs = load_claims(a.claims)
    posthoc = Path(a.claims).resolve() == POSTHOC_FILE.resolve()
    print(render(evaluate(summarize(load_runs(a.runs)), claims, min_pairs), posthoc=posthoc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
