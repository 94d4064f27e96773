"""The judge/executor collapse test at larger ratio noise, exactly as pre-registered in analysis/regime.yaml
(section ``judge_executor``, committed before any run of sweeps/judge_executor_sigma.yaml).

A noisy_decision run collapses when its late training reward (mean ``reward_mean`` over the steps s with
late_window[0] x steps < s <= late_window[1] x steps, i.e. 301-400 of 400) is below that of the clean_decision run
of the same sigma and seed by more than ``reward_margin``; a sigma collapses when at least ``min_seeds`` of its
seeds do. The report is the smallest sigma that collapses, or that none did up to the largest.

    python -m analysis.collapse [--runs results/runs]       # the table and the one-line verdict
"""

from __future__ import annotations

import argparse
import math
import warnings

import numpy as np

from analysis.load import RUNS_ROOT, RunWarning, load_runs
from analysis.regime import load_regime
from analysis.stats import interval
from analysis.summary import WARM_START

SWEEP = "judge_executor_sigma"


def late_reward(steps, total: int, window) -> float:
    """Mean ``reward_mean`` over the steps s with window[0] * total < s <= window[1] * total (NaN if none)."""
    lo, hi = window[0] * total, window[1] * total
    sel = steps[(steps["step"] > lo) & (steps["step"] <= hi)]["reward_mean"]
    return float(sel.mean()) if len(sel) else math.nan


def judge_collapse(rs, plan: dict | None = None, sweep: str = SWEEP) -> dict:
    """{"rows": one dict per sigma, "verdict": the report line}, from the runs of ``sweep`` in the RunSet ``rs``.

    A row: sigma, pairs (seeds with both decisions), noisy / clean late reward (means over those seeds), the mean
    paired difference noisy - clean with its 95% t-interval, the collapsed seeds, and the sigma's verdict:
    "collapses" (>= min_seeds collapsed), "no collapse" (every planned seed paired, fewer collapsed), or
    "incomplete" (neither yet).
    """
    plan = plan or load_regime()["judge_executor"]
    window, margin, need = plan["late_window"], float(plan["reward_margin"]), int(plan["min_seeds"])
    members = rs.members[rs.members["sweep"] == sweep] if len(rs.members) else rs.members
    inc = rs.included.set_index("run") if len(rs.included) else None
    groups = dict(tuple(rs.steps.groupby("run", sort=False))) if len(rs.steps) else {}
    late: dict[tuple[str, float, int], float] = {}
    for run in members["run"].unique() if len(members) else []:
        cfg = inc.loc[run]
        if cfg["loss.rule"] not in ("noisy_decision", "clean_decision") or run not in groups:
            continue
        ws = cfg.get(WARM_START)  # a pair: the same seed and the same warm start (analysis.summary.pairs)
        pair = (int(cfg["seed"]), ws if isinstance(ws, str) else "")
        key = (cfg["loss.rule"], round(float(cfg["loss.ratio_noise"]), 6), pair)
        late[key] = late_reward(groups[run], int(cfg["train.steps"]), window)
    rows = []
    for sigma in plan["sigmas"]:
        s = round(float(sigma), 6)
        keys = sorted({k for _, sig, k in late if sig == s and k[0] in plan["seeds"]})
        seeds = [k for k in keys if ("noisy_decision", s, k) in late and ("clean_decision", s, k) in late]
        noisy = np.array([late[("noisy_decision", s, k)] for k in seeds])
        clean = np.array([late[("clean_decision", s, k)] for k in seeds])
        diff = noisy - clean
        collapsed = [k[0] for k, d in zip(seeds, diff) if d < -margin]
        if len(collapsed) >= need:
            verdict = "collapses"
        elif len(seeds) == len(plan["seeds"]):
            verdict = "no collapse"
        else:
            verdict = "incomplete"
        mean, lo, hi, _ = interval(diff) if len(diff) else (math.nan, math.nan, math.nan, 0)
        rows.append(
            {
                "sigma": float(sigma),
                "pairs": len(seeds),
                "noisy": float(noisy.mean()) if len(seeds) else math.nan,
                "clean": float(clean.mean()) if len(seeds) else math.nan,
                "diff": mean,
                "lo": lo,
                "hi": hi,
                "collapsed": collapsed,
                "verdict": verdict,
            }
        )
    return {"rows": rows, "verdict": report_line(rows, plan)}


def report_line(rows: list[dict], plan: dict) -> str:
    """The pre-registered report: the smallest sigma that collapses (every smaller one decided), or none did."""
    for r in rows:
        if r["verdict"] == "collapses":
            return f"the smallest sigma that collapses is {r['sigma']:g}"
        if r["verdict"] == "incomplete":
            return f"undecided: sigma {r['sigma']:g} has {r['pairs']} of {len(plan['seeds'])} seed pairs"
    return f"none collapsed up to sigma {max(r['sigma'] for r in rows):g}" if rows else "no sigma planned"


def render(out: dict, plan: dict | None = None) -> str:
    plan = plan or load_regime()["judge_executor"]
    lo, hi = plan["late_window"]
    lines = [
        "### Judge/executor at larger ratio noise: the pre-registered collapse test (analysis/regime.yaml)\n",
        f"Late training reward = mean reward_mean over the steps s with {lo:g} T < s <= {hi:g} T (T = train.steps); "
        "a noisy_decision run "
        f"collapses when it is below the clean_decision run of the same sigma and seed by more than "
        f"{plan['reward_margin']}; a sigma collapses when at least {plan['min_seeds']} of {len(plan['seeds'])} "
        "seeds do.\n",
        "| sigma | pairs | noisy late reward | clean late reward | noisy − clean [95% t-interval] | collapsed seeds | "
        "verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        ci = f"{r['diff']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}]" if r["pairs"] else "-"
        seeds = ", ".join(map(str, r["collapsed"])) or "none"
        lines.append(
            f"| {r['sigma']:g} | {r['pairs']} | {r['noisy']:.3f} | {r['clean']:.3f} | {ci} | {seeds} | {r['verdict']} |"
        )
    lines += ["", f"**Report:** {out['verdict']}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.collapse", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=str(RUNS_ROOT), help="results folder <runs>/<sweep>/<run_id>/")
    a = p.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        rs = load_runs(a.runs)
    print(render(judge_collapse(rs)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
