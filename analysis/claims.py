"""The paper's claims, checked on the CPU grid: supports / contradicts / inconclusive, with the numbers.

    python -m analysis.claims [--runs results/runs]      # print the claims table (make_all also writes it)

The claims are data (analysis/claims.yaml): each is a list of paired comparisons ``a - b`` of one summary metric
between two arms of one sweep, with the direction the paper predicts. The verdict of a comparison comes from a
95% interval of the same-seed differences; the interval used is the wider of the percentile bootstrap (as in the
tables) and the Student-t interval, because over 3-5 seeds the bootstrap alone is too narrow (analysis.stats).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from analysis.load import YAML_LOADER
from analysis.stats import bootstrap_ci, paired_differences, t_interval
from analysis.tables import counterparts, fmt, select_labels
from nsr.registry import Registry

CLAIMS_FILE = Path(__file__).with_name("claims.yaml")
SUPPORTS, CONTRADICTS, INCONCLUSIVE, NO_DATA = "supports", "contradicts", "inconclusive", "no data"

# expect -> rule(lo, hi, margin) -> verdict; lo, hi bound the 95% interval of a - b.
EXPECT: Registry = Registry("expect")


@EXPECT.register("greater")
def _greater(lo, hi, margin):
    return SUPPORTS if lo > 0 else CONTRADICTS if hi < 0 else INCONCLUSIVE


@EXPECT.register("less")
def _less(lo, hi, margin):
    return SUPPORTS if hi < 0 else CONTRADICTS if lo > 0 else INCONCLUSIVE


@EXPECT.register("not_less")
def _not_less(lo, hi, margin):
    return SUPPORTS if lo > -margin else CONTRADICTS if hi < -margin else INCONCLUSIVE


@EXPECT.register("not_greater")
def _not_greater(lo, hi, margin):
    return SUPPORTS if hi < margin else CONTRADICTS if lo > margin else INCONCLUSIVE


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
        if not isinstance(point, dict):
            raise ValueError(f"{where}.point={point!r} is not valid; allowed: a mapping of axis: value")
        return Side(value["arm"], dict(point))
    raise ValueError(f"{where}={value!r} is not valid; allowed: an arm name or {{arm: NAME, point: {{axis: value}}}}")


def load_claims(path: str | Path = CLAIMS_FILE) -> tuple[list[Claim], int]:
    """(claims, min_pairs) from a claims file; ValueError naming the file and key on any bad entry."""
    path = Path(path)
    data = yaml.load(path.read_text(), Loader=YAML_LOADER) or {}
    unknown = set(data) - {"min_pairs", "claims"}
    if unknown:
        raise ValueError(f"{path}: unknown key {sorted(unknown)[0]!r}; allowed: min_pairs, claims")
    min_pairs = data.get("min_pairs", 3)
    if not isinstance(min_pairs, int) or min_pairs < 2:
        raise ValueError(f"{path}: min_pairs={min_pairs!r} is not valid; allowed: an integer >= 2")
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
                raise ValueError(f"{tw}: needs a, b, metric, expect (margin optional), got {t!r}")
            extra = set(t) - {"a", "b", "metric", "expect", "margin"}
            if extra:
                raise ValueError(f"{tw}: unknown key {sorted(extra)[0]!r}; allowed: a, b, metric, expect, margin")
            if t["expect"] not in set(EXPECT):
                raise ValueError(f"{tw}.expect={t['expect']!r} is not valid; allowed: {', '.join(EXPECT)}")
            margin = t.get("margin", 0.0)
            if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin < 0:
                raise ValueError(f"{tw}.margin={margin!r} is not valid; allowed: a number >= 0")
            tests.append(
                Comparison(
                    _side(t["a"], f"{tw}.a"), _side(t["b"], f"{tw}.b"), str(t["metric"]), t["expect"], float(margin)
                )
            )
        if not tests:
            raise ValueError(f"{where}.tests is empty; allowed: a list of at least one test")
        claims.append(Claim(str(c["id"]), str(c["claim"]), str(c["source"]), str(c["sweep"]), tuple(tests)))
    return claims, min_pairs


# ------------------------------------------------------------------------------------------- evaluation
def interval(diffs: np.ndarray, seed: int = 0) -> tuple[float, float, float, int]:
    """(mean, lo, hi, n): the wider of the 95% percentile-bootstrap and Student-t intervals of the mean."""
    mean, blo, bhi, n = bootstrap_ci(diffs, seed=seed)
    _, tlo, thi, _ = t_interval(diffs)
    if n < 2:
        return mean, math.nan, math.nan, n
    return mean, min(blo, tlo), max(bhi, thi), n


def verdict(test: Comparison, lo: float, hi: float, n: int, min_pairs: int) -> str:
    """One comparison's verdict (see analysis/claims.yaml for the rule)."""
    if n == 0:
        return NO_DATA
    if n < min_pairs or not (np.isfinite(lo) and np.isfinite(hi)):
        return INCONCLUSIVE
    return EXPECT[test.expect](lo, hi, test.margin)


def combine(verdicts: list[str]) -> str:
    """Supported if every comparison supports; contradicted if some contradict and none support; else
    inconclusive; no data when no comparison has data."""
    have = [v for v in verdicts if v != NO_DATA]
    if not have:
        return NO_DATA
    if all(v == SUPPORTS for v in have):
        return SUPPORTS
    if CONTRADICTS in have and SUPPORTS not in have:
        return CONTRADICTS
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
                }
            )
            continue
        ga, gb = s[s["label"] == la], s[s["label"] == cps[0]]
        diffs, _ = paired_differences(dict(zip(ga["seed"], ga[test.metric])), dict(zip(gb["seed"], gb[test.metric])))
        mean, lo, hi, n = interval(diffs)
        out.append({"a": la, "b": cps[0], "mean": mean, "lo": lo, "hi": hi, "n": n, "note": ""})
    return out


def evaluate(summary: pd.DataFrame, claims: list[Claim], min_pairs: int = 3) -> list[dict]:
    """Per claim: {claim, verdict, rows: [{test, a, b, mean, lo, hi, n, verdict}]}."""
    results = []
    for c in claims:
        s = summary[summary["sweep"] == c.sweep]
        rows = []
        for t in c.tests:
            comps = comparisons(s, t) if len(s) else []
            if not comps:
                rows.append(
                    {
                        "test": t,
                        "a": str(t.a),
                        "b": str(t.b),
                        "mean": math.nan,
                        "lo": math.nan,
                        "hi": math.nan,
                        "n": 0,
                        "verdict": NO_DATA,
                        "note": "no runs",
                    }
                )
            for r in comps:
                rows.append({"test": t, **r, "verdict": verdict(t, r["lo"], r["hi"], r["n"], min_pairs)})
        results.append({"claim": c, "verdict": combine([r["verdict"] for r in rows]), "rows": rows})
    return results


def _signed(x: float) -> str:
    return "–" if not np.isfinite(x) else ("+" if x > 0 else "") + fmt(x)


def render(results: list[dict], runs_hint: str = "--preset tiny") -> str:
    """The claims table (markdown): one row per claim, one line per comparison inside it."""
    header = (
        "| claim (paper) | comparison: expected | CPU grid: a − b [95% CI] (seeds) | verdict |\n|---|---|---|---|\n"
    )
    lines = []
    for res in results:
        c = res["claim"]
        tests, nums = [], []
        for r in res["rows"]:
            t = r["test"]
            tests.append(f"{t.metric}: {r['a']} − {r['b']} {SYMBOL[t.expect].format(m=fmt(t.margin))}")
            if r["n"] == 0:
                nums.append(f"{r['verdict']}" + (f" ({r['note']})" if r.get("note") else ""))
            else:
                ci = f"[{_signed(r['lo'])}, {_signed(r['hi'])}]" if np.isfinite(r["lo"]) else "[–]"
                nums.append(f"{_signed(r['mean'])} {ci} ({r['n']}): {r['verdict']}")
        claim = f"**{c.claim}** ({c.source}; sweep `{c.sweep}`)"
        lines.append(f"| {claim} | {'<br>'.join(tests)} | {'<br>'.join(nums)} | **{res['verdict']}** |")
    sweeps = sorted({res["claim"].sweep for res in results})
    regen = (
        "Regenerate: run the sweeps on the CPU testbed (`python -m slurm.submit SWEEP "
        f"{runs_hint}` for SWEEP in {', '.join(f'`{s}`' for s in sweeps)}), then `python -m analysis.make_all`. "
        "Rule: analysis/claims.yaml (a comparison is decided by the 95% interval of same-seed differences, the wider "
        "of bootstrap and Student-t; fewer than min_pairs seeds is inconclusive).\n"
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
    print(render(evaluate(summarize(load_runs(a.runs)), claims, min_pairs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
