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
and "inconclusive" when it did not. A claim may also take in a pre-registered collapse test (``collapse:`` in the
claims file; analysis.collapse, decided by its own count rule and stated power, outside the claim's Holm family). Each
claim's row names the testbed its runs come from (preset, model, task, steps: read from the runs' configs).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import collapse
from analysis.regime import load_regime
from analysis.stats import ALPHA, POWER_TARGET, holm, interval, paired_differences, power, sd_upper, t_test
from analysis.summary import pairs
from analysis.tables import counterparts, fmt, mixed_pairs, select_labels
from experiments.config import ConfigError
from experiments.yamlio import load_yaml
from nsr.registry import Registry
from nsr.value_checks import check, check_choice, is_number

CLAIMS_FILE = Path(__file__).with_name("claims.yaml")
POSTHOC_FILE = Path(__file__).with_name("posthoc.yaml")
SUPPORTS, CONTRADICTS, INCONCLUSIVE, NO_DATA = "supports", "contradicts", "inconclusive", "no data"
NOT_REPRODUCED = "not reproduced at this scale"
UNTESTABLE = "untestable here"
"""A comparison where the metric does not move: every run of both arms over the pairs shows one and the same value
(e.g. no hard and no nsr run has an entropy spike): what the claim says a rule avoids or changes does not happen
here, so no power can be claimed for it. A flat baseline alone is not enough (no clean run spikes, every noisy run
does: that is an effect, tested as any other)."""

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
class CollapseTest:
    """A claim's part read by the pre-registered collapse test (analysis.collapse) on ``sweep``: one row per sigma,
    decided by the plan's count rule (analysis/regime.yaml, section judge_executor), with the power to see a mean drop
    of late training reward of ``sesoi``. ``metric`` / ``expect`` / ``margin`` let it be drawn with the comparisons."""

    sweep: str
    sesoi: float
    metric: str = "late_reward"
    expect: str = "less"
    margin: float = math.nan


@dataclass(frozen=True)
class Claim:
    id: str
    claim: str
    source: str
    sweep: str
    tests: tuple[Comparison, ...]
    collapse: CollapseTest | None = None


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
        need, optional = {"id", "claim", "source", "sweep", "tests"}, {"collapse"}
        if not isinstance(c, dict) or need - set(c) or set(c) - need - optional:
            raise ValueError(
                f"{where}: needs exactly the keys {', '.join(sorted(need))} (optional: {', '.join(sorted(optional))}), "
                f"got {sorted(c or {})}"
            )
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
        collapse = _collapse_test(c["collapse"], f"{where}.collapse") if "collapse" in c else None
        claims.append(Claim(str(c["id"]), str(c["claim"]), str(c["source"]), str(c["sweep"]), tuple(tests), collapse))
    return claims, min_pairs


def _collapse_test(value, where: str) -> CollapseTest:
    allowed = "{sweep: NAME, sesoi: DROP} (DROP > 0: the smallest mean drop of late training reward of interest)"
    ok = isinstance(value, dict) and set(value) == {"sweep", "sesoi"} and isinstance(value.get("sweep"), str)
    check(ok, where, value, allowed)
    check(is_number(value["sesoi"]) and value["sesoi"] > 0, f"{where}.sesoi", value["sesoi"], "a number > 0")
    return CollapseTest(value["sweep"], float(value["sesoi"]))


def collapse_sesoi(claims: list[Claim], sweep: str) -> float | None:
    """The smallest collapse of interest of the claim whose collapse test reads ``sweep`` (None if no claim's does)."""
    return next((c.collapse.sesoi for c in claims if c.collapse and c.collapse.sweep == sweep), None)


# ------------------------------------------------------------------------------------------- evaluation
def verdict(
    test: Comparison, mean: float, p_holm: float, pw: float, n: int, min_pairs: int, untestable: bool = False
) -> str:
    """One comparison's verdict from its mean difference, Holm-adjusted p-value and power at the sesoi;
    ``untestable``: the metric does not move in either arm (:data:`UNTESTABLE`)."""
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
    and none support; not reproduced at this scale if some powered comparison saw nothing and none contradicts (the
    claim needs all its parts; a part that cannot be tested here does not lift a powered null of another); untestable
    here if a part cannot be tested (its metric does not move in either arm) and none contradicts or is a powered
    null; else inconclusive (also: supporting parts while others have no runs yet); no data when no comparison has
    data."""
    have = [v for v in verdicts if v != NO_DATA]
    if not have:
        return NO_DATA
    if all(v == SUPPORTS for v in have):
        return SUPPORTS if len(have) == len(verdicts) else INCONCLUSIVE
    if CONTRADICTS in have:
        return CONTRADICTS if SUPPORTS not in have else INCONCLUSIVE
    if NOT_REPRODUCED in have:
        return NOT_REPRODUCED
    if UNTESTABLE in have:  # a part of the claim cannot be tested here, and no part contradicts it
        return UNTESTABLE
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
        base, other = dict(zip(pairs(gb), gb[test.metric])), dict(zip(pairs(ga), ga[test.metric]))
        values = {float(base[k]) for k in seeds} | {float(other[k]) for k in seeds}
        flat = n >= 2 and len(values) == 1  # the metric does not move: both arms, every pair, one value
        note = f"no variation in {la} nor {cps[0]}: every run {fmt(values.pop())}" if flat else ""
        out.append({"a": la, "b": cps[0], "mean": mean, "lo": lo, "hi": hi, "n": n, "note": note, "untestable": flat,
                    "p": t_test(diffs, null), "sd": sd, "mixed": mixed_pairs(s, la, cps[0], seeds)})  # fmt: skip
    return out


def _power_at_sesoi(test: Comparison, sd: float, n: int, m: int) -> float:
    """Power to see the sesoi (directional tests) or to show the margin with no true difference (the others), at
    level ALPHA / m (Holm's first step: the strictest level a comparison of the claim can face), at the upper
    one-sided 80% confidence limit of the paired SD (chi-square): with 3-5 seeds the observed SD alone can be small
    by luck and would call a comparison powered that is not."""
    if sd == 0 and n >= 2:
        return 1.0  # every seed gave the same difference while the metric moves (a metric that does not move in
        # either arm is untestable and gets no power: evaluate)
    effect = test.sesoi if test.expect in DIRECTIONAL else test.margin
    if not (effect > 0) or n < 2 or not np.isfinite(sd):
        return math.nan
    return power(effect, sd_upper(sd, n), n, ALPHA / max(m, 1))


def collapse_rows(rs, test: CollapseTest) -> list[dict]:
    """The collapse test's rows of a claim: one per planned sigma (analysis.collapse.judge_collapse), each with the
    verdict the plan's count rule gives: collapses = supports, no collapse with power >= 80% at the sesoi = not
    reproduced at this scale, otherwise inconclusive; no data without pairs (or without the run folders, ``rs``)."""
    plan = load_regime()["judge_executor"]
    test = CollapseTest(test.sweep, test.sesoi, margin=float(plan["reward_margin"]))
    if rs is None:
        judged = {"rows": [{"sigma": float(x), "pairs": 0} for x in plan["sigmas"]]}
    else:
        judged = collapse.judge_collapse(rs, plan, sweep=test.sweep, sesoi=test.sesoi)
    rows = []
    for j in judged["rows"]:
        n, sig = j["pairs"], f"ratio_noise={j['sigma']:g}"
        row = {"test": test, "kind": "collapse", "a": f"noisy_decision {sig}", "b": f"clean_decision {sig}", "n": n,
               "mean": j.get("diff", math.nan), "lo": j.get("lo", math.nan), "hi": j.get("hi", math.nan),
               "p": math.nan, "p_holm": math.nan, "power": j.get("power", math.nan), "sd": j.get("sd", math.nan),
               "collapsed": len(j.get("collapsed", [])), "seeds": len(plan["seeds"]), "need": int(plan["min_seeds"]),
               "note": "" if n else "no runs" if rs is not None else "the collapse test reads run folders"}  # fmt: skip
        if n == 0:
            row["verdict"] = NO_DATA
        elif j["verdict"] == "collapses":
            row["verdict"] = SUPPORTS
        elif j["verdict"] == "no collapse" and np.isfinite(row["power"]) and row["power"] >= POWER_TARGET:
            row["verdict"] = NOT_REPRODUCED
        else:
            row["verdict"] = INCONCLUSIVE
        rows.append(row)
    return rows


def testbed(rs, sweeps) -> str:
    """Which testbed the runs of ``sweeps`` come from, read from their configs: per distinct setting,
    ```preset`: model dD x L layers, task, N RL steps``; "–" without run folders or runs."""
    if rs is None or not len(rs.members) or not len(rs.included):
        return "–"
    mem = rs.members[rs.members["sweep"].isin(list(sweeps))]
    cfg = rs.included.drop_duplicates("run").set_index("run")
    seen = []
    for run, preset in zip(mem["run"], mem["preset"]):
        if run not in cfg.index:
            continue
        r = cfg.loc[run]
        text = (f"`{preset}`: {r['model.name']} d{int(r['model.d_model'])} x {int(r['model.n_layer'])} layers, "
                f"{r['task.name']}, {int(r['train.steps'])} RL steps")  # fmt: skip
        if text not in seen:
            seen.append(text)
    return "; ".join(seen) or "–"


def evaluate(summary: pd.DataFrame, claims: list[Claim], min_pairs: int = 3, rs=None) -> list[dict]:
    """Per claim: {claim, verdict, power, testbed, rows: [{test, a, b, mean, lo, hi, n, mixed, p, p_holm, power,
    verdict}]}; Holm over every planned comparison of the claim (one without data counts, with p = 1). A row whose
    metric does not move in either arm (untestable here) gets no power. ``rs``: the RunSet the summary came from; it
    names each claim's testbed and is what a claim's collapse test reads (without it: testbed "–", collapse rows
    no data)."""
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
            flat = r.get("untestable", False)  # nothing moves: no power to claim
            r["power"] = _power_at_sesoi(r["test"], r["sd"], r["n"], m) if r["n"] and not flat else math.nan
            r["verdict"] = verdict(r["test"], r["mean"], r["p_holm"], r["power"], r["n"], min_pairs, flat)
        if c.collapse is not None:  # decided by its own pre-registered rule, outside the Holm family above
            rows += collapse_rows(rs, c.collapse)
        powers = [r["power"] for r in rows if np.isfinite(r["power"])]
        sweeps = [c.sweep] + ([c.collapse.sweep] if c.collapse is not None else [])
        results.append({"claim": c, "verdict": combine([r["verdict"] for r in rows]), "rows": rows,
                        "power": min(powers) if powers else math.nan, "testbed": testbed(rs, sweeps)})  # fmt: skip
    return results


def _signed(x: float) -> str:
    return "–" if not np.isfinite(x) else ("+" if x > 0 else "") + fmt(x)


def _p(x: float) -> str:
    return "–" if not np.isfinite(x) else ("<0.001" if x < 0.001 else f"{x:.3f}")


def _pct(x: float) -> str:
    return "–" if not np.isfinite(x) else f"{100 * x:.0f}%"


def expectation(t: Comparison | CollapseTest) -> str:
    """``late_pass@1: nsr − hard > 0 (sesoi 0.02)``."""
    rule = SYMBOL[t.expect].format(m=fmt(t.margin))
    extra = f" (sesoi {fmt(t.sesoi)})" if t.expect in DIRECTIONAL else ""
    return f"{rule}{extra}"


def render(results: list[dict], runs_hint: str = "--preset tiny", posthoc: bool = False) -> str:
    """The claims table (markdown): one row per claim, one line per comparison inside it."""
    header = (
        "| claim (paper) | comparison: expected | a − b [95% t-CI] (seeds) | Holm p | power at sesoi | testbed "
        "| verdict |\n|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for res in results:
        c = res["claim"]
        tests, nums, ps, pws = [], [], [], []
        for r in res["rows"]:
            t = r["test"]
            if r.get("kind") == "collapse":
                tests.append(
                    f"collapse test (pre-registered): {t.metric}: {r['a']} − {r['b']} < −{fmt(t.margin)} in ≥ "
                    f"{r['need']} of {r['seeds']} seeds (sesoi: mean drop {fmt(t.sesoi)})"
                )
            else:
                tests.append(f"{t.metric}: {r['a']} − {r['b']} {expectation(t)}")
            if r["n"] == 0:
                nums.append(f"{r['verdict']}" + (f" ({r['note']})" if r.get("note") else ""))
            else:
                ci = f"[{_signed(r['lo'])}, {_signed(r['hi'])}]" if np.isfinite(r["lo"]) else "[–]"
                mixed = f"; {r['mixed']} legacy/current" if r.get("mixed") else ""
                why = f" ({r['note']})" if r.get("untestable") else ""
                if r.get("kind") == "collapse":
                    why = f" ({r['collapsed']} of {r['n']} seeds collapsed)"
                nums.append(f"{_signed(r['mean'])} {ci} ({r['n']}{mixed}): {r['verdict']}{why}")
            ps.append(_p(r.get("p_holm", math.nan)))
            pws.append(_pct(r.get("power", math.nan)))
        also = f"; collapse test: sweep `{c.collapse.sweep}`" if c.collapse is not None else ""
        claim = f"**{c.claim}** ({c.source}; sweep `{c.sweep}`{also})"
        lines.append(
            f"| {claim} | {'<br>'.join(tests)} | {'<br>'.join(nums)} | {'<br>'.join(ps)} | {'<br>'.join(pws)} "
            f"| {res.get('testbed', '–')} | **{res['verdict']}** |"
        )
    sweeps = sorted({res["claim"].sweep for res in results} |
                    {res["claim"].collapse.sweep for res in results if res["claim"].collapse is not None})  # fmt: skip
    label = "Post-hoc readings (chosen after seeing the grid; not planned tests). " if posthoc else ""
    regen = (
        f"{label}Regenerate: run the sweeps on the CPU testbed (`python -m slurm.submit SWEEP "
        f"{runs_hint}` for SWEEP in {', '.join(f'`{s}`' for s in sweeps)}), then `python -m analysis.make_all`. "
        "Rule (analysis/claims.py): 95% Student-t interval of the same-seed differences (the interval of every table "
        "and figure); t-test p-values Holm-corrected within a claim; a directional comparison that is not "
        "significant is *not reproduced at this scale* when its power to see the smallest effect of interest "
        "(sesoi, fixed per comparison in the claims file; upper 80% confidence limit of the paired SD, level 0.05 / "
        "planned comparisons) is >= 80%, else *inconclusive*; *untestable here* when the metric does not move "
        "(every run of both arms over the pairs shows one value: what the claim says a rule avoids does not happen "
        "here), with no power shown; fewer than min_pairs "
        "seeds is inconclusive; "
        '"k legacy/current" counts pairs of a run by older code and one by today\'s. '
        "A collapse test (analysis/collapse.py, pre-registered in analysis/regime.yaml) is decided by its own count "
        "rule outside Holm: collapses supports, no collapse is *not reproduced at this scale* when the rule had >= 80% "
        "power to see the sesoi's mean drop (paired SD at its upper 80% limit, computed after the runs), else "
        "*inconclusive*. A claim with a powered null and no contradicting part is *not reproduced at this scale* "
        "even where another part is untestable. Testbed: the preset, model, task and RL steps of the claim's runs, "
        "read from their configs.\n"
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
    rs = load_runs(a.runs)
    print(render(evaluate(summarize(rs), claims, min_pairs, rs=rs), posthoc=posthoc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
