"""Stage D's readout (analysis/regime.yaml, section ``stage_d``): a treatment arm against a control arm in whole runs,
paired by seed, decided once by the rule fixed before the runs.

    python -m analysis.regime results/runs/NAME --stage d      # the decision table (or the stage's progress)
    python -m analysis.stage_d results/runs/NAME               # the same

**No interim look.** Until every planned run (each arm x each registered seed) has a done folder in ``root``, the
readout reports progress only (which runs are done, how many steps each has logged) and computes nothing from the
runs' evaluations or training metrics.

**Primary metric** of a run (``stage_d.primary``): the accuracy on benchmark ``benchmark`` under ``decoding`` (greedy:
the one greedy answer per problem; sampled: every sample), at each evaluated step ``s`` with ``lo * T <= s <= hi * T``
(``window: [lo, hi]``, ``T`` = the run's ``train.steps``), averaged over those steps with equal weight. Every
evaluated step in the window must hold every problem the run's step 0 holds (a run evaluated on fewer is an error,
never a silent mean over less).

**Decision** (``stage_d.decision``, ``alpha``, ``sesoi``): with paired differences d = treatment - control over the
seeds, the two-sided (1 - alpha) t interval of mean(d) decides ``better`` (above 0) or ``worse`` (below 0); otherwise
``equivalent`` if the (1 - 2 alpha) interval lies inside (-sesoi, sesoi) (two one-sided tests at alpha), else
``inconclusive``.

**Secondary readings** (decide nothing): per arm, the mean over runs of the training metrics named in
``secondary.metrics`` (each a metrics.jsonl column, averaged over a run's steps; missing columns are left out) and the
dynamic-sampling resampling factor (prompts drawn per prompt kept: OpenRLHF's ``dynamic_filtering_pass_rate`` is
samples kept per prompt drawn x 100), and the premise meter (analysis.premise: reach on each side, in-zone clipped
mass per token).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from analysis.stats import interval

VERDICTS = ("better", "worse", "equivalent", "inconclusive")
REGIME_FILE = Path(__file__).resolve().with_name("regime.yaml")
"""The pre-registered plan (the file analysis.regime reads)."""


class StageDError(ValueError):
    """A run folder or the plan does not fit the stage (two runs of one arm and seed, an evaluation short of problems,
    a plan without a field the readout needs)."""


def load_plan(regime_path: str | Path | None = None) -> dict:
    """The ``stage_d`` section of analysis/regime.yaml, with the fields the readout needs checked."""
    import yaml

    data = yaml.safe_load(Path(regime_path or REGIME_FILE).read_text()) or {}
    plan = data.get("stage_d")
    if not isinstance(plan, dict):
        raise StageDError(f"{regime_path or REGIME_FILE}: no stage_d section (stage D is not registered)")
    need = {"sweep", "control", "treatment", "seeds", "primary", "alpha", "sesoi"}
    missing = sorted(need - set(plan))
    if missing:
        raise StageDError(f"stage_d lacks {', '.join(missing)}; allowed: a section with {', '.join(sorted(need))}")
    prim = plan["primary"]
    if prim.get("decoding") not in ("greedy", "sampled"):
        raise StageDError(f"stage_d.primary.decoding={prim.get('decoding')!r} is not valid; allowed: greedy, sampled")
    lo, hi = prim.get("window", (None, None))
    if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and 0 <= lo <= hi <= 1):
        raise StageDError(
            f"stage_d.primary.window={prim.get('window')!r} is not valid; allowed: [lo, hi], 0<=lo<=hi<=1"
        )
    if not 0 < float(plan["alpha"]) < 0.5 or not float(plan["sesoi"]) > 0:
        raise StageDError(f"stage_d alpha={plan['alpha']} / sesoi={plan['sesoi']}: allowed 0 < alpha < 0.5, sesoi > 0")
    return plan


def _folders(root: Path, plan: dict) -> tuple[dict, list]:
    """{(arm, seed): folder} of the stage's runs in ``root`` and [other folders' names] (not of the stage)."""
    from experiments.rundir import RunDir

    arms, seeds = (plan["control"], plan["treatment"]), set(plan["seeds"])
    runs, other = {}, []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        cfg = RunDir(folder).read_config() or {}
        meta = cfg.get("meta", {})
        key = (meta.get("arm"), cfg.get("seed"))
        if meta.get("sweep") != plan["sweep"] or key[0] not in arms or key[1] not in seeds:
            other.append(folder.name)
            continue
        if key in runs:
            raise StageDError(f"{root}: two runs of arm {key[0]} seed {key[1]}: {runs[key].name} and {folder.name}")
        runs[key] = folder
    return runs, other


def primary_metric(folder: Path, plan: dict) -> dict:
    """{value, steps}: the run's primary metric (module doc) and the evaluated steps it averages."""
    from experiments.rundir import RunDir, read_rows

    rd = RunDir(folder)
    cfg = rd.read_config()
    prim = plan["primary"]
    total = int(cfg["train"]["steps"])
    lo, hi = prim["window"]
    path = rd.log_path("eval.jsonl")
    if not path.exists():
        raise StageDError(f"{folder}: no eval.jsonl(.gz); the primary metric needs the run's evaluations")
    rows, _ = read_rows(path)
    bench = prim.get("benchmark")
    rows = [r for r in rows if r["decoding"] == prim["decoding"] and (bench is None or r["benchmark"] == bench)]
    problems = {r["problem_id"] for r in rows if r["step"] == 0}
    by_step: dict[int, list[int]] = {}
    seen: dict[int, set] = {}
    for r in rows:
        if lo * total <= r["step"] <= hi * total:
            by_step.setdefault(r["step"], []).append(int(r["correct"]))
            seen.setdefault(r["step"], set()).add(r["problem_id"])
    if not by_step:
        raise StageDError(f"{folder}: no {prim['decoding']} evaluation at steps {lo} x {total} to {hi} x {total}")
    for step, ids in seen.items():
        if problems and ids != problems:
            raise StageDError(f"{folder}: step {step} evaluated {len(ids)} problems, step 0 {len(problems)}")
    steps = sorted(by_step)
    return {"value": float(np.mean([np.mean(by_step[s]) for s in steps])), "steps": steps}


def secondary(folder: Path, plan: dict) -> dict:
    """The run's secondary readings (module doc): column means over its steps, the resampling factor, the meter."""
    from analysis.premise import PremiseError
    from analysis.premise import read_run as premise_run
    from experiments.rundir import RunDir, read_rows

    rd = RunDir(folder)
    metrics, _ = read_rows(rd.metrics_path) if rd.metrics_path.exists() else ([], [])
    out = {}
    for col in plan.get("secondary", {}).get("metrics", []):
        vals = [r[col] for r in metrics if isinstance(r.get(col), (int, float)) and not math.isnan(r[col])]
        if vals:
            out[col] = float(np.mean(vals))
    rates = [r["dynamic_filtering_pass_rate"] for r in metrics if r.get("dynamic_filtering_pass_rate")]
    if rates:  # OpenRLHF logs samples kept per prompt drawn, x 100: 100 x samples_per_prompt when every group is kept
        per_prompt = int(rd.read_config()["rollout"]["samples_per_prompt"])
        out["resampling_factor"] = float(np.mean([100.0 * per_prompt / x for x in rates]))
    try:
        meter = premise_run(folder)
        out |= {k: meter[k] for k in ("pos_reach", "neg_reach") if k in meter}
        out["zone_per_token"] = meter["pos_zone_per_token"] + meter["neg_zone_per_token"]
    except PremiseError:  # no ratio_bins.jsonl (a run without the meter): the reading is left out
        pass
    return out


def decide(d: np.ndarray, alpha: float, sesoi: float) -> dict:
    """The registered rule on paired differences ``d`` (module doc)."""
    n = len(d)
    mean = float(np.mean(d))
    sd = float(np.std(d, ddof=1)) if n > 1 else math.nan
    _, lo, hi, _ = interval(d, 1 - alpha)  # NaN bounds with one pair: no verdict but inconclusive
    _, lo2, hi2, _ = interval(d, 1 - 2 * alpha)
    if lo > 0:
        verdict = "better"
    elif hi < 0:
        verdict = "worse"
    elif -sesoi < lo2 and hi2 < sesoi:
        verdict = "equivalent"
    else:
        verdict = "inconclusive"
    return {"n": n, "mean": mean, "sd": sd, "ci": (lo, hi), "ci_tost": (lo2, hi2), "verdict": verdict}


def readout(root: str | Path, regime_path: str | Path | None = None) -> dict:
    """Stage D over ``root`` (results/runs/<stage_d.sweep>): progress while a planned run is not done (nothing read
    from any run's evaluations), else the pairs, the decision and the secondary readings."""
    from experiments.rundir import RunDir, read_rows

    plan = load_plan(regime_path)
    root = Path(root)
    runs, other = _folders(root, plan)
    arms = (plan["control"], plan["treatment"])
    planned = [(arm, seed) for seed in plan["seeds"] for arm in arms]
    progress = []
    for arm, seed in planned:
        folder = runs.get((arm, seed))
        rd = RunDir(folder) if folder else None
        state = (rd.status() or {}).get("state") if rd else None
        logged = len(read_rows(rd.metrics_path)[0]) if rd and rd.metrics_path.exists() else 0
        progress.append({"arm": arm, "seed": seed, "run": folder.name if folder else None, "state": state,
                         "rows": logged})  # fmt: skip
    out = {"plan": plan, "progress": progress, "other": other}
    done = [p for p in progress if p["state"] == "done"]
    if len(done) < len(planned):
        out["outcome"] = "not run" if not done else "incomplete"
        return out
    prim = {(p["arm"], p["seed"]): primary_metric(runs[(p["arm"], p["seed"])], plan) for p in progress}
    pairs = [
        {"seed": s, "control": prim[(arms[0], s)]["value"], "treatment": prim[(arms[1], s)]["value"]}
        for s in plan["seeds"]
    ]
    d = np.array([p["treatment"] - p["control"] for p in pairs])
    out |= {"pairs": pairs, "steps": {f"{a}-s{s}": v["steps"] for (a, s), v in prim.items()}}
    out["decision"] = decide(d, float(plan["alpha"]), float(plan["sesoi"]))
    sec = {a: [secondary(runs[(a, s)], plan) for s in plan["seeds"]] for a in arms}
    out["secondary"] = {
        a: {k: float(np.mean([r[k] for r in rs if k in r])) for k in sorted({k for r in rs for k in r})}
        for a, rs in sec.items()
    }
    out["outcome"] = out["decision"]["verdict"]
    return out


def _g(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def markdown(out: dict) -> str:
    """The decision table, or the progress table while the stage is not complete."""
    plan = out["plan"]
    ctl, trt = plan["control"], plan["treatment"]
    lines = [
        f"Pre-registered in analysis/regime.yaml, section stage_d (sweep {plan['sweep']}, arms {ctl} and {trt}, seeds "
        f"{', '.join(map(str, plan['seeds']))}).",
        "",
    ]
    if out["outcome"] in ("not run", "incomplete"):
        lines += ["| arm | seed | run | state | steps logged |", "|---|---|---|---|---|"]
        lines += [
            f"| {p['arm']} | {p['seed']} | {p['run'] or '-'} | {p['state'] or 'no folder'} | {p['rows']} |"
            for p in out["progress"]
        ]
        n = sum(p["state"] == "done" for p in out["progress"])
        lines += [
            "",
            f"**{'Not run' if out['outcome'] == 'not run' else 'In progress'}: {n} of {len(out['progress'])} runs "
            "done.** Nothing is read from the runs' evaluations until every planned run is done.",
            "",
        ]
        return "\n".join(lines)
    prim = plan["primary"]
    lines += [
        f"Primary metric: {prim['decoding']} accuracy on the held-out problems, mean over the evaluations at steps in "
        f"[{prim['window'][0]}, {prim['window'][1]}] x train.steps.",
        "",
        f"| seed | {ctl} | {trt} | {trt} - {ctl} |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {p['seed']} | {p['control']:.4f} | {p['treatment']:.4f} | {p['treatment'] - p['control']:+.4f} |"
        for p in out["pairs"]
    ]
    dec, alpha = out["decision"], float(plan["alpha"])
    lines += [
        "",
        f"Mean difference {dec['mean']:+.4f} (SD {_g(dec['sd'])}, {dec['n']} pairs); {1 - alpha:.0%} interval "
        f"[{dec['ci'][0]:+.4f}, {dec['ci'][1]:+.4f}]; {1 - 2 * alpha:.0%} interval [{dec['ci_tost'][0]:+.4f}, "
        f"{dec['ci_tost'][1]:+.4f}] against the SESOI +-{plan['sesoi']}.",
        "",
        f"Decision: {dec['verdict']}",
        "",
        "Secondary readings (decide nothing), mean over each arm's runs:",
        "",
        f"| reading | {ctl} | {trt} |",
        "|---|---|---|",
    ]
    sec = out["secondary"]
    for k in sorted(set(sec[ctl]) | set(sec[trt])):
        lines.append(f"| {k} | {_g(sec[ctl].get(k))} | {_g(sec[trt].get(k))} |")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.stage_d", description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="the stage's run folders, results/runs/<stage_d.sweep>")
    p.add_argument("--regime", default=None, help="the plan (default analysis/regime.yaml)")
    a = p.parse_args(argv)
    try:
        print(markdown(readout(a.root, a.regime)), end="")
    except StageDError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
