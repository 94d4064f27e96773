"""The judge/executor collapse test at larger ratio noise, exactly as pre-registered in analysis/regime.yaml
(section ``judge_executor``, committed before any run of sweeps/judge_executor_sigma.yaml).

A noisy_decision run collapses when its late training reward (mean ``reward_mean`` over the steps s with
late_window[0] x steps < s <= late_window[1] x steps, i.e. 301-400 of 400) is below that of the clean_decision run
of the same sigma and seed by more than ``reward_margin``; a sigma collapses when at least ``min_seeds`` of its
seeds do. The report is the smallest sigma that collapses, or that none did up to the largest.

Power (not part of the pre-registration; computed after the runs from their spread): with each seed's difference
noisy - clean normal with mean -drop and the sigma's paired SD taken at its upper one-sided 80% confidence limit
(:func:`analysis.stats.sd_upper`, as the claims table does), the probability that at least ``min_seeds`` of the
planned seeds fall below -reward_margin (:func:`collapse_power`), at the smallest collapse of interest ``sesoi`` (a
mean drop of late training reward, fixed in analysis/claims.yaml next to the claim the test belongs to), and the
mean drop the rule calls collapsed with 80% power (:func:`collapse_mde`).

    python -m analysis.collapse [--runs results/runs] [--sesoi DROP]   # the table and the one-line verdict
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import numpy as np
from scipy import optimize
from scipy import stats as sps

from analysis.load import RUNS_ROOT, RunWarning, load_runs
from analysis.regime import load_regime
from analysis.stats import POWER_TARGET, interval, sd_upper
from analysis.summary import WARM_START
from experiments.yamlio import load_yaml

SWEEP = "judge_executor_sigma"


def late_reward(steps, total: int, window) -> float:
    """Mean ``reward_mean`` over the steps s with window[0] * total < s <= window[1] * total (NaN if none)."""
    lo, hi = window[0] * total, window[1] * total
    sel = steps[(steps["step"] > lo) & (steps["step"] <= hi)]["reward_mean"]
    return float(sel.mean()) if len(sel) else math.nan


def collapse_power(drop: float, sd: float, n: int, margin: float, need: int) -> float:
    """P(at least ``need`` of ``n`` independent seeds have noisy - clean < -``margin``) when each seed's difference is
    normal with mean -``drop`` and SD ``sd``: per seed p = Phi((drop - margin) / sd), then the binomial tail. With
    sd 0 a seed is below the margin exactly when drop > margin. NaN when sd is not a number."""
    if not np.isfinite(sd) or not np.isfinite(drop) or sd < 0:
        return math.nan
    p = float(drop > margin) if sd == 0 else float(sps.norm.cdf((drop - margin) / sd))
    return float(sps.binom.sf(need - 1, n, p))


def collapse_mde(sd: float, n: int, margin: float, need: int, target: float = POWER_TARGET) -> float:
    """The mean drop the rule calls collapsed with probability ``target``: margin + sd x Phi^-1(p*), where p* is the
    per-seed probability whose binomial tail P(at least ``need`` of ``n``) equals ``target``."""
    if not np.isfinite(sd) or sd < 0:
        return math.nan
    p_star = optimize.brentq(lambda p: sps.binom.sf(need - 1, n, p) - target, 1e-12, 1 - 1e-12, xtol=1e-14)
    return float(margin + sd * sps.norm.ppf(p_star))


def judge_collapse(rs, plan: dict | None = None, sweep: str = SWEEP, sesoi: float | None = None) -> dict:
    """{"rows": one dict per sigma, "verdict": the report line}, from the runs of ``sweep`` in the RunSet ``rs``.

    A row: sigma, pairs (seeds with both decisions), noisy / clean late reward (means over those seeds), the mean
    paired difference noisy - clean with its 95% t-interval, the collapsed seeds, and the sigma's verdict:
    "collapses" (>= min_seeds collapsed), "no collapse" (every planned seed paired, fewer collapsed), or
    "incomplete" (neither yet). With 2 or more pairs also: sd (of the paired differences), sd_upper (its upper 80%
    limit), power (of the rule at a mean drop of ``sesoi`` over the planned seeds; NaN without ``sesoi``) and mde (the
    mean drop it sees with 80% power); NaN otherwise.
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
        sd = float(np.std(diff, ddof=1)) if len(diff) >= 2 else math.nan
        sd_up = sd_upper(sd, len(diff))
        n_plan = len(plan["seeds"])
        pw = collapse_power(float(sesoi), sd_up, n_plan, margin, need) if sesoi is not None else math.nan
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
                "sd": sd,
                "sd_upper": sd_up,
                "power": pw,
                "mde": collapse_mde(sd_up, n_plan, margin, need),
            }
        )
    return {"rows": rows, "verdict": report_line(rows, plan), "sesoi": sesoi}


def report_line(rows: list[dict], plan: dict) -> str:
    """The pre-registered report: the smallest sigma that collapses (every smaller one decided), or none did."""
    for r in rows:
        if r["verdict"] == "collapses":
            return f"the smallest sigma that collapses is {r['sigma']:g}"
        if r["verdict"] == "incomplete":
            return f"undecided: sigma {r['sigma']:g} has {r['pairs']} of {len(plan['seeds'])} seed pairs"
    return f"none collapsed up to sigma {max(r['sigma'] for r in rows):g}" if rows else "no sigma planned"


CLAIMS_FILE = Path(__file__).with_name("claims.yaml")


def claims_sesoi(path: str | Path = CLAIMS_FILE, sweep: str = SWEEP) -> float | None:
    """``collapse.sesoi`` of the claim in the claims file whose collapse test reads ``sweep`` (None if none does): the
    command line's default. The file is read as data here (analysis.claims, which validates it, imports this
    module); make_all takes the value from the loaded claims."""
    for c in (load_yaml(path) or {}).get("claims") or []:
        coll = c.get("collapse") if isinstance(c, dict) else None
        if isinstance(coll, dict) and coll.get("sweep") == sweep:
            return float(coll["sesoi"])
    return None


def _num(x) -> str:
    return "-" if x is None else f"{x:g}"


def render(out: dict, plan: dict | None = None) -> str:
    plan = plan or load_regime()["judge_executor"]
    sesoi = out.get("sesoi")
    lo, hi = plan["late_window"]
    lines = [
        "### Judge/executor at larger ratio noise: the pre-registered collapse test (analysis/regime.yaml)\n",
        f"Late training reward = mean reward_mean over the steps s with {lo:g} T < s <= {hi:g} T (T = train.steps); "
        "a noisy_decision run "
        f"collapses when it is below the clean_decision run of the same sigma and seed by more than "
        f"{plan['reward_margin']}; a sigma collapses when at least {plan['min_seeds']} of {len(plan['seeds'])} "
        "seeds do.\n",
        "| sigma | pairs | noisy late reward | clean late reward | noisy − clean [95% t-interval] | collapsed seeds | "
        f"verdict | power at a drop of {_num(sesoi)} | drop seen with 80% power |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        ci = f"{r['diff']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}]" if r["pairs"] else "-"
        seeds = ", ".join(map(str, r["collapsed"])) or "none"
        pw = f"{100 * r['power']:.0f}%" if np.isfinite(r.get("power", math.nan)) else "-"
        mde = f"{r['mde']:.3f}" if np.isfinite(r.get("mde", math.nan)) else "-"
        lines.append(
            f"| {r['sigma']:g} | {r['pairs']} | {r['noisy']:.3f} | {r['clean']:.3f} | {ci} | {seeds} | {r['verdict']} "
            f"| {pw} | {mde} |"
        )
    lines += [
        "",
        f"**Report:** {out['verdict']}.",
        "",
        f"Power (computed after the runs, not pre-registered): the probability that at least {plan['min_seeds']} of "
        f"{len(plan['seeds'])} seeds fall below the margin when the noisy arm's late training reward is lower by a "
        "mean drop, each seed's difference normal with the sigma's paired SD at its upper one-sided 80% confidence "
        f"limit; the smallest collapse of interest, a mean drop of {_num(sesoi)}, is fixed in analysis/claims.yaml.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.collapse", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=str(RUNS_ROOT), help="results folder <runs>/<sweep>/<run_id>/")
    p.add_argument("--sesoi", type=float, default=None,
                   help="smallest collapse of interest, a mean drop of late training reward, for the power column "
                        "(default: the judge_executor claim's collapse.sesoi in analysis/claims.yaml)")  # fmt: skip
    a = p.parse_args(argv)
    if a.sesoi is not None and not (math.isfinite(a.sesoi) and a.sesoi > 0):
        p.error(f"--sesoi {a.sesoi}: not valid; allowed: a number > 0 (a mean drop of late training reward)")
    if a.sesoi is None:
        a.sesoi = claims_sesoi()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        rs = load_runs(a.runs)
    print(render(judge_collapse(rs, sesoi=a.sesoi)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
