"""One number per run and metric: the unit every table, the delta figure and the claims compare across seeds.

    from analysis.load import load_runs
    from analysis.summary import summarize
    s = summarize(load_runs())      # one row per included run: run, sweep, label, arm, seed, point, + METRICS

Training metrics come from metrics.jsonl, each a function of one run's step frame registered in ``STEP_METRICS``
(the registry is the documentation: name -> definition). "Final" means the mean over the last ``FINAL_FRACTION``
of the run's steps (at least one step), which smooths the per-step sampling noise of a single rollout.

Eval metrics come from the per-sample labels of the run's last eval step: ``pass@k`` by the unbiased estimator
for k in 1, 2, 4, ... up to the samples per problem (mean over problems, then over benchmarks), and ``greedy``
(greedy-decoding accuracy); per-benchmark columns such as ``pass@1[aime24]`` come with them.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.load import RunSet
from analysis.stats import pass_at_k, pass_k_values
from nsr.registry import Registry

FINAL_FRACTION = 0.05
ID_COLUMNS = ["run", "sweep", "run_id", "label", "arm", "seed", "baseline", "point"]
"""One summary row per (sweep, run): ``run`` is the run's key (its folder's sweep/run_id), ``sweep`` and
``run_id`` the sweep it is counted in and its id there."""
WARM_START = "meta.warm_start.sha256"
"""The run folder field (config.yaml ``meta.warm_start.sha256``) that names the weights a run started from."""


def pairs(df: pd.DataFrame) -> list[tuple]:
    """THE pairing rule, one key per row of a summary (or runs) frame: two runs are a pair when they have the same RL
    seed and start from the same warm start (the sha256 of its weights, column ``warm_start``; "" for runs made
    before it was recorded, which pair only with each other). Arms of one seed that started from different weights
    (a warm start rebuilt on another CPU) are not a pair."""
    ws = df["warm_start"] if "warm_start" in df.columns else pd.Series([""] * len(df), index=df.index)
    return list(zip(df["seed"], ws.fillna("").astype(str)))


STEP_METRICS: Registry = Registry("metric")


def final_window(n: int) -> int:
    """Steps averaged for a "final" value: the last 5% of ``n`` steps, at least one."""
    return max(1, math.ceil(FINAL_FRACTION * n))


def _col(df: pd.DataFrame, name: str) -> np.ndarray:
    return df[name].to_numpy(dtype=np.float64) if name in df.columns else np.full(len(df), np.nan)


def _final(x: np.ndarray) -> float:
    return float(np.nanmean(x[-final_window(len(x)) :])) if np.isfinite(x).any() else float("nan")


def _smooth(x: np.ndarray) -> np.ndarray:
    """Trailing moving average over the final window's length (NaN-aware)."""
    w = final_window(len(x))
    ok = np.isfinite(x)
    cs = np.concatenate([[0.0], np.cumsum(np.where(ok, x, 0.0))])
    cn = np.concatenate([[0], np.cumsum(ok)])
    i = np.arange(len(x))
    lo = np.maximum(0, i + 1 - w)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (cs[i + 1] - cs[lo]) / (cn[i + 1] - cn[lo])


@STEP_METRICS.register("final_reward")
def final_reward(df: pd.DataFrame) -> float:
    """Training reward (reward_mean of the rollouts), mean over the final window."""
    return _final(_col(df, "reward_mean"))


@STEP_METRICS.register("best_reward")
def best_reward(df: pd.DataFrame) -> float:
    """Highest moving average of the training reward (window = final window)."""
    s = _smooth(_col(df, "reward_mean"))
    return float(np.nanmax(s)) if np.isfinite(s).any() else float("nan")


@STEP_METRICS.register("reward_drop")
def reward_drop(df: pd.DataFrame) -> float:
    """best_reward - final_reward: how far a run fell from its best (a collapse shows as a large drop)."""
    return best_reward(df) - final_reward(df)


@STEP_METRICS.register("reward_auc")
def reward_auc(df: pd.DataFrame) -> float:
    """Mean training reward over all steps: for runs of equal length, higher = converges faster."""
    x = _col(df, "reward_mean")
    return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


@STEP_METRICS.register("final_entropy")
def final_entropy(df: pd.DataFrame) -> float:
    """Mean token entropy of the policy, mean over the final window."""
    return _final(_col(df, "entropy"))


SPIKE_WINDOW = 0.1
"""Window of the spike metric, as a fraction of the run's steps (at least 5 steps)."""
SPIKE_RISE = math.log(1.5)
"""Smallest rise of log entropy inside the window that is a spike (entropy up by half)."""
SPIKE_REWARD_FALL = 0.05
"""Smallest fall of the training reward inside the window that goes with a spike."""


def _window_extreme(x: np.ndarray, w: int, fn) -> np.ndarray:
    """fn (np.fmin / np.fmax) over the trailing window [t - w, t] of every t (NaN-aware)."""
    out = x.copy()
    for lag in range(1, w + 1):
        out[lag:] = fn(out[lag:], x[:-lag])
    return out


def spike_trace(entropy: np.ndarray, reward: np.ndarray) -> np.ndarray:
    """Per step: the rise of log entropy above its minimum in the trailing window where that rise is a spike
    (>= SPIKE_RISE, with the reward down >= SPIKE_REWARD_FALL from its maximum in the same window), else 0.
    Both series are first smoothed over the final window (5% of the run)."""
    h, r = _smooth(np.asarray(entropy, dtype=np.float64)), _smooth(np.asarray(reward, dtype=np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        logh = np.log(np.where(h > 0, h, np.nan))
    w = max(5, math.ceil(SPIKE_WINDOW * len(h)))
    rise = logh - _window_extreme(logh, w, np.fmin)
    fall = _window_extreme(r, w, np.fmax) - r
    spike = (rise >= SPIKE_RISE) & (fall >= SPIKE_REWARD_FALL)
    return np.where(spike, rise, 0.0)


@STEP_METRICS.register("entropy_spike")
def entropy_spike(df: pd.DataFrame) -> float:
    """Largest entropy spike, in log units (0.69 = entropy doubled): a rise of log entropy by >= log 1.5 above its
    minimum within a trailing window of 10% of the run, while the training reward fell by >= 0.05 in that window;
    0 when there is none. A steady drift, noise at low entropy, or a rise while the reward holds is not a spike."""
    h, r = _col(df, "entropy"), _col(df, "reward_mean")
    if not (np.isfinite(h) & (h > 0)).any() or not np.isfinite(r).any():
        return float("nan")
    return float(spike_trace(h, r).max())


@STEP_METRICS.register("spike_steps")
def spike_steps(df: pd.DataFrame) -> float:
    """Steps inside an entropy spike (see entropy_spike), as a fraction of the run."""
    h, r = _col(df, "entropy"), _col(df, "reward_mean")
    if not (np.isfinite(h) & (h > 0)).any() or not np.isfinite(r).any():
        return float("nan")
    return float((spike_trace(h, r) > 0).mean())


@STEP_METRICS.register("entropy_rise")
def entropy_rise(df: pd.DataFrame) -> float:
    """log(final entropy) - log(minimum of the smoothed entropy): a rise late in training, whatever the reward did."""
    h = _smooth(_col(df, "entropy"))
    fin = final_entropy(df)
    ok = np.isfinite(h) & (h > 0)
    if not ok.any() or not np.isfinite(fin) or fin <= 0:
        return float("nan")
    return float(np.log(fin) - np.log(h[ok].min()))


def _mean_metric(name: str):
    def fn(df: pd.DataFrame) -> float:
        x = _col(df, name)
        return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")

    fn.__doc__ = f"Mean of {name} over all steps."
    return fn


for _name in ("clip_frac", "clip_frac_low", "clip_frac_high", "rescue_frac", "pushout_frac", "response_len"):
    STEP_METRICS.register(_name)(_mean_metric(_name))


@STEP_METRICS.register("final_response_len")
def final_response_len(df: pd.DataFrame) -> float:
    """Response length in tokens, mean over the final window."""
    return _final(_col(df, "response_len"))


# ------------------------------------------------------------------------------------------------ eval
def eval_curves(counts: pd.DataFrame) -> pd.DataFrame:
    """Per (run, step, benchmark): pass@k for every k the sample count allows (sampled decoding) and greedy
    accuracy. Columns: run, step, benchmark, pass@1, pass@2, ..., greedy."""
    if not len(counts):
        return pd.DataFrame(columns=["run", "step", "benchmark"])
    keys = ["run", "step", "benchmark"]
    parts = []
    sampled = counts[counts["decoding"] == "sampled"]
    if len(sampled):
        n_max = int(sampled["n"].max())
        n, c = sampled["n"].to_numpy(), sampled["c"].to_numpy()
        cols = {f"pass@{k}": pass_at_k(n, c, k) for k in pass_k_values(n_max)}
        per_problem = pd.concat([sampled[keys].reset_index(drop=True), pd.DataFrame(cols)], axis=1)
        parts.append(per_problem.groupby(keys, sort=True).mean())  # NaN (n < k) problems are skipped
    greedy = counts[counts["decoding"] == "greedy"]
    if len(greedy):
        acc = (greedy["c"] / greedy["n"]).rename("greedy")
        parts.append(pd.concat([greedy[keys], acc], axis=1).groupby(keys, sort=True).mean())
    return pd.concat(parts, axis=1).reset_index()


LATE_WINDOW = (0.5, 1.0)
"""THE late window (analysis/regime.yaml, ``primary_metric.window``, pre-registered): the evaluations at steps s with
lo x steps <= s <= hi x steps. ``late_pass@1`` here and the evidence plan's ``late_pass1`` (analysis.regime) are the
mean held-out sampled accuracy over it."""


def in_late_window(step, steps, window=LATE_WINDOW):
    """Whether eval step(s) ``step`` fall in the late window of a run of ``steps`` RL steps (scalars or arrays)."""
    return (window[0] * steps <= step) & (step <= window[1] * steps)


def final_eval(curves: pd.DataFrame) -> pd.DataFrame:
    """Per run: eval metrics at its last eval step, averaged over benchmarks, plus ``metric[benchmark]`` columns
    per benchmark; ``eval_step`` is that step; ``late_pass@1`` (and ``late_greedy``) is the mean over the evals in
    the last half of training, which jumps less from checkpoint to checkpoint than the final value."""
    if not len(curves):
        return pd.DataFrame(columns=["run", "eval_step"])
    last = curves.groupby("run")["step"].transform("max")
    fin = curves[curves["step"] == last]
    metrics = [c for c in fin.columns if c not in ("run", "step", "benchmark")]
    out = fin.groupby("run")[metrics].mean()
    out.insert(0, "eval_step", fin.groupby("run")["step"].max())
    late = curves[in_late_window(curves["step"], last)]  # a run's last eval is at its last step
    late_cols = [m for m in ("pass@1", "greedy") if m in late.columns]
    if late_cols:
        per_step = late.groupby(["run", "step"])[late_cols].mean()
        agg = per_step.groupby("run").mean()
        agg.columns = [f"late_{m}" for m in late_cols]
        out = out.join(agg)
        out["late_evals"] = per_step.groupby("run").size()
    wide = fin.pivot_table(index="run", columns="benchmark", values=metrics, aggfunc="mean", dropna=False)
    wide.columns = [f"{m}[{b}]" for m, b in wide.columns]
    out = out.join(wide)
    return out.reset_index()


def summarize(rs: RunSet, with_eval: bool = True, curves: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (sweep, included run) of ``rs.members``: ID_COLUMNS, ``legacy`` (made by older code than today's:
    its recorded hash differs), every STEP_METRICS entry, n_steps, and the final eval metrics. A run shared by several
    sweeps is computed once and appears once in each sweep. ``curves``: ``eval_curves(rs.eval_counts())`` when the
    caller has it already (computed here otherwise)."""
    runs = list(dict.fromkeys(rs.members["run"])) if len(rs.members) else []
    groups = dict(tuple(rs.steps.groupby("run", sort=False))) if len(rs.steps) else {}
    rows = []
    for run in runs:
        df = groups.get(run, pd.DataFrame())
        row = {"run": run, "n_steps": len(df)}
        for name, fn in STEP_METRICS.items():
            row[name] = fn(df) if len(df) else float("nan")
        rows.append(row)
    per_run = pd.DataFrame(rows, columns=["run", "n_steps", *STEP_METRICS])
    if with_eval and len(per_run):
        fe = final_eval(eval_curves(rs.eval_counts()) if curves is None else curves)
        per_run = per_run.merge(fe, on="run", how="left")
    members = rs.members if len(rs.members) else pd.DataFrame(columns=ID_COLUMNS)
    out = members[[c for c in ID_COLUMNS if c in members.columns]].merge(per_run, on="run", how="left")
    runs = rs.runs
    legacy = dict(zip(runs["run"], runs["legacy"])) if len(runs) and "legacy" in runs.columns else {}
    out.insert(
        len([c for c in ID_COLUMNS if c in out.columns]), "legacy", [bool(legacy.get(r, False)) for r in out["run"]]
    )
    ws = dict(zip(runs["run"], runs[WARM_START])) if len(runs) and WARM_START in runs.columns else {}
    out.insert(out.columns.get_loc("legacy") + 1, "warm_start", [ws.get(r) if isinstance(ws.get(r), str) else ""
                                                                 for r in out["run"]])  # fmt: skip
    # one run per (sweep, label, seed): two configs can land on one label (an old folder whose arm's values changed
    # since, counted in its own sweep); keep the one today's sweep file holds, then current code before legacy
    in_file = members["in_file"].to_numpy(dtype=bool) if "in_file" in members.columns else np.ones(len(out), bool)
    key = out.assign(_f=~in_file, _l=out["legacy"])
    dup = key.sort_values(["_f", "_l"], kind="stable").duplicated(["sweep", "label", "seed"], keep="first")
    for rec in out.loc[dup[dup].index].itertuples(index=False):
        rs.notes.append(f"{rec.sweep}: {rec.run} is a second run of label {rec.label!r} seed {rec.seed}; not counted")
    out = out.drop(index=dup[dup].index)
    return out.reset_index(drop=True)


def metric_doc(name: str) -> str:
    """One-line definition of a summary column, for table footnotes."""
    if name in set(STEP_METRICS):  # Registry's `in` raises on unknown names (nsr.registry), so test the names
        return (STEP_METRICS[name].__doc__ or name).split("\n")[0].strip()
    if name.startswith("pass@"):
        return f"unbiased {name.split('[')[0]} at the last eval step (sampled decoding), mean over problems"
    if name.startswith("late_"):
        return f"{name[5:]} averaged over the evals in the last half of training (less checkpoint-to-checkpoint noise)"
    if name.startswith("greedy"):
        return "greedy-decoding accuracy at the last eval step"
    return name
