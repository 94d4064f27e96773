"""Figures (matplotlib, Agg backend, deterministic bytes for the same inputs). ``make_all`` is the only caller
that writes results/figures; each function takes loaded data and a path and returns the files it wrote.

* :func:`dynamics`  per sweep: each arm minus its baseline counterpart (same seed) vs step, for the training
  reward, log entropy, clipped fraction per side, rescued fraction and eval pass@1; mean over the seed pairs with
  a 95% t-band (analysis.stats.interval, the interval of the tables and claims). Constant panels are dropped.
* :func:`delta_sweep`  one column per parameter (NSR's delta, the widened region's extra width), one row per metric.
* :func:`forest`  every planned comparison of the claims with its interval, coloured by verdict.
* :func:`screening`  every arm of the screening sweeps (related, dgg) minus hard, one panel per metric.
* :func:`pass_at_k_figure`  pass@k against k per arm and sweep.
* :func:`clip_depth`  clipped tokens by depth into NSR's rescue zone, per side and delta (NSR's dose).
* :func:`theory`  the expected gradient weight w(r) of NSR (nsr.expected_weight) for both executors and several
  delta, the hard-clip step, and Monte-Carlo points measured from nsr.policy_loss's own gradients.
* :func:`judge_executor`  log entropy, reward and eval pass@1 vs step, noisy decision dashed, clean decision
  solid, one colour per ratio-noise sigma.

Every figure says how many distinct seeds it shows (``n=`` per line, and in the title).

Training curves are averaged within at most ``MAX_POINTS`` equal step bins per run before the mean and band across
seeds are taken, which both smooths single-rollout noise and keeps the figures fast for 1,000-step runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

import nsr  # noqa: E402
from analysis.stats import interval  # noqa: E402
from analysis.summary import pairs as pair_keys  # noqa: E402
from analysis.tables import baseline_arm, counterparts, label_order  # noqa: E402

MAX_POINTS = 40
DPI = 110
PANELS = (
    ("reward_mean", "training reward", False),
    ("entropy", "log entropy (nats / token)", True),
    ("clip_frac_low", "clipped, low side (A < 0)", False),
    ("clip_frac_high", "clipped, high side (A > 0)", False),
    ("rescue_frac", "rescued fraction", False),
    ("pass@1", "eval pass@1 (sampled)", False),
)
"""(metric, y label, log scale): the panels of the dynamics figures; a panel constant in every run is dropped."""
DELTA_RULES = ("nsr", "soft", "pushout", "nsr_pushout")
"""Rules whose behaviour depends on loss.delta (x = delta in the delta figure)."""


def save(fig, path: Path, formats=("png",), tight: bool = False) -> list[Path]:
    """Save ``fig`` as path.<fmt> for each format, without timestamps or version strings (stable bytes);
    ``tight`` crops to the drawn artists (for a legend placed outside the axes)."""
    out = []
    path.parent.mkdir(parents=True, exist_ok=True)
    for f in formats:
        p = path.with_suffix(f".{f}")
        meta = {"png": {"Software": None}, "pdf": {"CreationDate": None, "Producer": None, "Creator": None}}
        meta["svg"] = {"Date": None, "Creator": None}
        fig.savefig(p, dpi=DPI, metadata=meta.get(f, {}), bbox_inches="tight" if tight else None)
        out.append(p)
    plt.close(fig)
    return out


GRID_MARGINS = {"left": 0.95, "right": 0.15, "top": 0.45, "bottom": 0.5, "wgap": 1.0, "hgap": 0.6}
"""Margins and gaps (inches) of the panel grids of the curve figures: room for a suptitle, tick labels and axis
labels; fixed, so a figure is drawn once (tight_layout draws it a second time to measure: ~40% of a figure's time)."""


def legend_below(fig, ax, per_row: int = 4) -> None:
    """One figure legend under the panels: the figure grows by the legend's height (no bbox_inches="tight",
    which costs a second full draw per figure); the panels are placed by :data:`GRID_MARGINS`."""
    handles, names = ax.get_legend_handles_labels()
    rows = -(-len(names) // per_row) if names else 0
    w, h = fig.get_size_inches()
    extra = 0.22 * rows + 0.1
    fig.set_size_inches(w, h + extra)
    if names:
        fig.legend(handles, names, loc="lower center", ncol=min(per_row, len(names)), fontsize=8, frameon=False)
    place_grid(fig, ax, bottom=extra)


def place_grid(fig, ax, bottom: float = 0.0, titled: bool = False) -> None:
    """Place the panel grid of ``ax`` with the fixed :data:`GRID_MARGINS` (inches); ``bottom``: extra room under the
    panels (a figure legend); ``titled``: room for each panel's title above it."""
    nrow, ncol = ax.get_subplotspec().get_gridspec().get_geometry()
    m = GRID_MARGINS | ({"top": GRID_MARGINS["top"] + 0.25, "hgap": GRID_MARGINS["hgap"] + 0.25} if titled else {})
    w, h = fig.get_size_inches()
    aw = (w - m["left"] - m["right"] - (ncol - 1) * m["wgap"]) / ncol
    ah = (h - bottom - m["top"] - m["bottom"] - (nrow - 1) * m["hgap"]) / nrow
    fig.subplots_adjust(left=m["left"] / w, right=1 - m["right"] / w, top=1 - m["top"] / h,
                        bottom=(m["bottom"] + bottom) / h, wspace=m["wgap"] / aw, hspace=m["hgap"] / ah)  # fmt: skip


def colours(labels: list[str]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    return {lab: cmap(i % cmap.N) for i, lab in enumerate(labels)}


# ------------------------------------------------------------------------------------------- curves
def step_bins(steps: pd.DataFrame, max_points: int = MAX_POINTS) -> np.ndarray:
    """Edges of at most ``max_points`` equal bins over the steps in ``steps``."""
    s = steps["step"].to_numpy(dtype=np.float64)
    nb = int(min(max_points, steps["step"].nunique()))
    return np.linspace(s.min(), s.max() + 1e-9, nb + 1)


def binned(by_run: dict[str, pd.DataFrame], runs: list[str], metric: str, edges: np.ndarray):
    """(x (T,), Y (S, T)): per run (its step frame in ``by_run``), the mean of ``metric`` in each step bin."""
    nb = len(edges) - 1
    x = (edges[:-1] + edges[1:]) / 2
    Y = np.full((len(runs), nb), np.nan)
    for i, run in enumerate(runs):
        g = by_run.get(run)
        if g is None or metric not in g.columns:
            continue
        v = g[metric].to_numpy(dtype=np.float64)
        ok = np.isfinite(v)
        b = np.clip(np.searchsorted(edges, g["step"].to_numpy(dtype=np.float64), side="right") - 1, 0, nb - 1)[ok]
        with np.errstate(invalid="ignore", divide="ignore"):
            Y[i] = np.bincount(b, weights=v[ok], minlength=nb) / np.bincount(b, minlength=nb)
    return x, Y


def eval_matrix(curves: pd.DataFrame, runs: list[str], metric: str):
    """(x (T,), Y (S, T)) of an eval metric (mean over benchmarks) at the union of eval steps."""
    df = curves[curves["run"].isin(runs)] if len(curves) else curves
    if not len(df) or metric not in df.columns:
        return np.array([]), np.empty((len(runs), 0))
    wide = df.groupby(["run", "step"])[metric].mean().unstack("step")
    wide = wide.reindex(runs)
    return wide.columns.to_numpy(dtype=np.float64), wide.to_numpy(dtype=np.float64)


def _band(ax, x, Y, colour, label, linestyle="-"):
    """Mean over seeds (rows of Y) and its 95% t-band (analysis.stats.interval, the rule of tables and claims)."""
    if Y.size == 0 or not np.isfinite(Y).any():
        return
    mean, lo, hi, _ = interval(Y, axis=0)
    ax.plot(x, mean, color=colour, lw=1.4, ls=linestyle, label=label)
    if Y.shape[0] > 1:
        ax.fill_between(x, lo, hi, color=colour, alpha=0.18, lw=0)


def _log(Y: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.log(np.where(Y > 0, Y, np.nan))


def _seeds(s: pd.DataFrame) -> int:
    return int(s["seed"].nunique()) if len(s) else 0


def _varies(Ys: list[np.ndarray]) -> bool:
    """False when every value of every curve is the same (a constant panel says nothing)."""
    vals = np.concatenate([Y[np.isfinite(Y)] for Y in Ys if Y.size]) if Ys else np.array([])
    return len(vals) > 0 and float(vals.max() - vals.min()) > 1e-12


def _matrix(by_run, mine, runs, metric, edges, log=False):
    """(x, Y): binned training metric (metrics.jsonl) or eval metric (at eval steps) per run; log on request."""
    if edges is not None and any(metric in g.columns for g in by_run.values()):
        x, Y = binned(by_run, runs, metric, edges)
    else:
        x, Y = eval_matrix(mine, runs, metric)
    return x, (_log(Y) if log else Y)


def _paired(Ya: np.ndarray, Yb: np.ndarray, seeds_a: list, seeds_b: list) -> np.ndarray:
    """Rows of Ya - Yb for the pairs both have (analysis.summary.pairs: same seed, same warm start), on a shared x
    grid."""
    common = sorted(set(seeds_a) & set(seeds_b))
    ia = [seeds_a.index(k) for k in common]
    ib = [seeds_b.index(k) for k in common]
    if not common or Ya.shape[1] != Yb.shape[1]:
        return np.empty((0, Ya.shape[1] if Ya.ndim == 2 else 0))
    return Ya[ia] - Yb[ib]


def _curves_figure(rs, summary, curves, sweep, panels, style, title, paired: bool) -> plt.Figure | None:
    """One panel per (metric, y label, log) in ``panels``; each label's mean over seeds with its t-band. With
    ``paired``, each non-baseline label's same-seed difference to its baseline counterpart instead."""
    s = summary[summary["sweep"] == sweep]
    if not len(s):
        return None
    labels = label_order(s)
    base = baseline_arm(s)
    runs_of = {lab: list(s.loc[s["label"] == lab, "run"]) for lab in labels}
    seeds_of = {lab: pair_keys(s[s["label"] == lab]) for lab in labels}  # (seed, warm start)
    steps = rs.steps[rs.steps["run"].isin(s["run"])] if len(rs.steps) else rs.steps
    mine = curves[curves["run"].isin(s["run"])] if len(curves) else curves
    by_run = dict(tuple(steps.groupby("run", sort=False))) if len(steps) else {}
    edges = step_bins(steps) if len(steps) else None
    pairs = []
    if paired and base is not None:
        for lab in labels:
            if s.loc[s["label"] == lab, "arm"].iloc[0] == base:
                continue
            cps = counterparts(s, lab, base)
            if len(cps) == 1:
                pairs.append((lab, cps[0]))
    if paired and not pairs:
        return None
    drawn = []
    for metric, ylabel, log in panels:
        data = []
        for lab in [a for a, _ in pairs] if paired else labels:
            x, Y = _matrix(by_run, mine, runs_of[lab], metric, edges, log)
            if paired:
                b = dict(pairs)[lab]
                xb, Yb = _matrix(by_run, mine, runs_of[b], metric, edges, log)
                if len(xb) != len(x) or not np.allclose(xb, x):
                    continue
                Y = _paired(Y, Yb, seeds_of[lab], seeds_of[b])
            data.append((lab, x, Y))
        if data and _varies([Y for _, _, Y in data]):
            drawn.append((metric, ylabel, data))
    if not drawn:
        return None
    ncol = min(3, len(drawn))
    nrow = -(-len(drawn) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.0 * nrow), squeeze=False)
    for ax, (_, ylabel, data) in zip(axes.flat, drawn):
        for lab, x, Y in data:
            colour, ls = style(lab)
            n = int((np.isfinite(Y).any(1)).sum()) if Y.size else 0
            _band(ax, x, Y, colour, f"{lab} (n={n})", ls)
        if paired:
            ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel("RL step")
        ax.set_ylabel(("Δ " if paired else "") + ylabel)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(drawn) :]:
        ax.axis("off")
    fig.suptitle(title + f"; {_seeds(s)} distinct seeds", fontsize=10)
    legend_below(fig, axes.flat[0])
    return fig


def dynamics_figure(rs, summary, curves, sweep: str) -> plt.Figure | None:
    """Per sweep: each arm minus its baseline counterpart (same seed), mean and 95% t-band over the seed pairs, for
    the training reward, log entropy, clipped fraction per side, rescued fraction and eval pass@1. Without a
    baseline arm, the arms' own curves. Constant panels are dropped."""
    s = summary[summary["sweep"] == sweep]
    cols = colours(label_order(s))
    base = baseline_arm(s)
    paired = base is not None and (s["arm"] != base).any()
    what = f"minus baseline '{base}' (same seed)" if paired else "mean over seeds"
    title = f"{sweep}: {what}, band = 95% t-interval"
    fig = _curves_figure(rs, summary, curves, sweep, PANELS, lambda lab: (cols[lab], "-"), title, paired)
    if fig is None and paired:
        fig = _curves_figure(rs, summary, curves, sweep, PANELS, lambda lab: (cols[lab], "-"), title, False)
    return fig


def dynamics(rs, summary, curves, sweep: str, path: Path, formats=("png",)) -> list[Path]:
    """Save :func:`dynamics_figure` at ``path``; returns the files written."""
    fig = dynamics_figure(rs, summary, curves, sweep)
    return save(fig, path, formats) if fig is not None else []


def judge_executor(rs, summary, curves, path: Path, sweep: str = "judge_executor", formats=("png",)) -> list[Path]:
    """Noisy vs clean decision: log entropy, reward and pass@1 vs step (dashed = noisy judge, solid = clean judge)."""
    s = summary[summary["sweep"] == sweep]
    if not len(s):
        return []
    runs = rs.runs.set_index("run")
    first = s.drop_duplicates("label").set_index("label")
    sigmas = sorted({float(runs.at[r, "loss.ratio_noise"]) for r in first["run"]})
    cmap = plt.get_cmap("viridis")
    col = {sg: cmap(0.15 + 0.7 * i / max(1, len(sigmas) - 1)) for i, sg in enumerate(sigmas)}

    def style(lab):
        row = runs.loc[first.at[lab, "run"]]
        rule = row["loss.rule"]
        if rule not in ("noisy_decision", "clean_decision"):
            return "black", ":"
        return col[float(row["loss.ratio_noise"])], "--" if rule == "noisy_decision" else "-"

    panels = [p for p in PANELS if p[0] in ("entropy", "reward_mean", "pass@1")]
    fig = _curves_figure(
        rs,
        summary,
        curves,
        sweep,
        panels,
        style,
        "judge / executor: noisy decision (dashed) vs clean decision (solid), colour = ratio-noise sigma; "
        "mean, band = 95% t-interval",
        paired=False,
    )
    return save(fig, path, formats) if fig is not None else []


# ------------------------------------------------------------------------------------------- delta sweep
def delta_x(s: pd.DataFrame, runs: pd.DataFrame) -> pd.Series:
    """x position of each run in the delta figure: loss.delta for delta-using rules; for a hard-clip run whose
    region is wider than the baseline arm's, the extra width eps_high - eps_high(baseline); else NaN."""
    cfg = runs.drop_duplicates("run").set_index("run").reindex(s["run"])[["loss.rule", "loss.delta", "loss.eps_high"]]
    cfg = cfg.set_index(s.index)
    base = baseline_arm(s)
    base_eps = cfg.loc[s["arm"] == base, "loss.eps_high"]
    b = float(base_eps.iloc[0]) if len(base_eps) else np.nan
    widened = (cfg["loss.rule"] == "hard") & (pd.to_numeric(cfg["loss.eps_high"], errors="coerce") > b + 1e-12)
    x = pd.Series(np.nan, index=s.index)
    uses = cfg["loss.rule"].isin(DELTA_RULES)
    x[uses] = pd.to_numeric(cfg.loc[uses, "loss.delta"], errors="coerce")
    x[widened] = pd.to_numeric(cfg.loc[widened, "loss.eps_high"], errors="coerce") - b
    return x


def delta_sweep(rs, summary, path: Path, sweep: str = "delta", formats=("png",)) -> list[Path]:
    """One column per parameter (NSR's delta; the widened region's extra width), one row per metric: mean and 95%
    t-interval over seeds, with the baseline as a reference band in every panel."""
    s = summary[summary["sweep"] == sweep].copy()
    if not len(s):
        return []
    s["x"] = delta_x(s, rs.runs)
    rule = rs.runs.drop_duplicates("run").set_index("run").reindex(s["run"])["loss.rule"].to_numpy()
    s["series"] = np.where(np.isin(rule, DELTA_RULES), rule, s["arm"].to_numpy())
    base = baseline_arm(s)
    params = [a for a in dict.fromkeys(s["series"]) if a != base and s.loc[s["series"] == a, "x"].nunique() >= 2]
    metrics = [m for m in ("late_pass@1", "pass@1", "reward_auc", "final_entropy") if m in s and s[m].notna().any()]
    if not params or not metrics:
        return []
    cols = colours([base or "", *params])
    fig, axes = plt.subplots(len(metrics), len(params), figsize=(4.0 * len(params), 2.6 * len(metrics)),
                             squeeze=False, sharey="row")  # fmt: skip
    for i, m in enumerate(metrics):
        bmean, blo, bhi, _ = interval(s.loc[s["arm"] == base, m].to_numpy(dtype=float)) if base else (np.nan,) * 4
        for j, arm in enumerate(params):
            ax = axes[i, j]
            g = s[s["series"] == arm]
            xs = sorted(g["x"].dropna().unique())
            pts = [interval(g.loc[g["x"] == x, m].to_numpy(dtype=float)) for x in xs]
            mean = np.array([p[0] for p in pts])
            err = np.array([[p[0] - p[1], p[2] - p[0]] for p in pts]).T
            ns = [int(g.loc[g["x"] == x, "seed"].nunique()) for x in xs]
            n = str(ns[0]) if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"
            ax.errorbar(xs, mean, yerr=np.nan_to_num(err), color=cols[arm], marker="o", ms=4, capsize=3,
                        label=f"{arm} (n={n} seeds per point)")  # fmt: skip
            if np.isfinite(bmean):
                ax.axhline(bmean, color="black", ls="--", lw=1.0, label=f"{base} (reference)")
                if np.isfinite(blo):
                    ax.axhspan(blo, bhi, color="black", alpha=0.08, lw=0)
            ax.set_xlabel("loss.delta" if arm in DELTA_RULES else f"{arm}: extra eps over {base}")
            if j == 0:
                ax.set_ylabel(m)
            if i == 0:
                ax.set_title(arm, fontsize=10)
            ax.grid(alpha=0.3)
    fig.suptitle(f"{sweep}: mean and 95% t-interval per point; {_seeds(s)} distinct seeds", fontsize=10)
    handles = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return save(fig, path, formats)


# ------------------------------------------------------------------------------------------- forest plot
VERDICT_COLOURS = {
    "supports": "tab:green",
    "contradicts": "tab:red",
    "not reproduced at this scale": "tab:purple",
    "untestable here": "tab:brown",
    "inconclusive": "tab:gray",
    "no data": "lightgray",
}


def forest(results: list[dict], path: Path, formats=("png",), title: str = "planned comparisons") -> list[Path]:
    """Every comparison of the claims: a - b with its 95% t-interval, coloured by verdict, one panel per metric;
    the dotted line is the smallest effect of interest (or the margin) on the predicted side."""
    rows = [(res["claim"].id, r) for res in results for r in res["rows"] if r["n"] > 0]
    if not rows:
        return []
    metrics = list(dict.fromkeys(r["test"].metric for _, r in rows))
    per = {m: [(cid, r) for cid, r in rows if r["test"].metric == m] for m in metrics}
    heights = [max(1, len(v)) for v in per.values()]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(14, 0.3 * sum(heights) + 1.1 * len(metrics) + 0.6),
                             squeeze=False, gridspec_kw={"height_ratios": heights})  # fmt: skip
    for ax, m in zip(axes[:, 0], metrics):
        items = per[m]
        ys = np.arange(len(items))[::-1]
        for y, (_, r) in zip(ys, items):
            c = VERDICT_COLOURS.get(r["verdict"], "black")
            if np.isfinite(r["lo"]):
                ax.plot([r["lo"], r["hi"]], [y, y], color=c, lw=2)
            ax.plot([r["mean"]], [y], "o", color=c, ms=5)
            t = r["test"]
            ref = t.sesoi if t.expect == "greater" else -t.sesoi if t.expect == "less" else None
            ref = -t.margin if t.expect == "not_less" else t.margin if t.expect == "not_greater" else ref
            if ref is not None and np.isfinite(ref):
                ax.plot([ref, ref], [y - 0.4, y + 0.4], color=c, ls=":", lw=1)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(ys, [f"{cid}: {r['a']} − {r['b']} (n={r['n']})" for cid, r in items], fontsize=7)
        ax.set_xlabel(f"Δ {m} (a − b), 95% t-interval", fontsize=8)
        ax.grid(alpha=0.3, axis="x")
    handles = [plt.Line2D([], [], color=c, lw=2, label=v) for v, c in VERDICT_COLOURS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=7, frameon=False)
    fig.suptitle(f"{title}: verdict per comparison (Holm within a claim); dotted = smallest effect of interest",
                 fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return save(fig, path, formats, tight=True)


# ------------------------------------------------------------------------------------------- screening forest
SCREENING_SWEEPS = ("related", "dgg")
SCREENING_METRICS = ("late_pass@1", "reward_auc")


def screening_rows(summary: pd.DataFrame, sweeps=SCREENING_SWEEPS, metrics=SCREENING_METRICS) -> list[tuple]:
    """[(sweep, label, rows of tables.paired_vs_baseline for that label)]: every arm of the screening sweeps minus
    the sweep's baseline, paired by seed (one interval rule). An arm whose runs (the same configs) already appear
    under an earlier sweep is listed once."""
    from analysis.tables import paired_vs_baseline

    items, seen = [], set()
    for sw in sweeps:
        s = summary[summary["sweep"] == sw]
        have = [m for m in metrics if m in s.columns]
        if not len(s) or not have:
            continue
        d = paired_vs_baseline(s, have)
        for label in dict.fromkeys(d["label"]):
            runs = frozenset(s.loc[s["label"] == label, "run"])
            if runs in seen:
                continue
            seen.add(runs)
            rows = d[(d["label"] == label) & (d["n"] > 0)]
            if len(rows):
                items.append((sw, label, rows))
    return items


def screening(summary: pd.DataFrame, path: Path, sweeps=SCREENING_SWEEPS, metrics=SCREENING_METRICS,
              formats=("png",)) -> list[Path]:  # fmt: skip
    """:func:`screening_rows` as a forest plot, one panel per metric, each arm minus hard with its 95% t-interval.
    Screening, not confirmatory: no verdicts, no multiplicity correction."""
    items = screening_rows(summary, sweeps, metrics)
    if not items:
        return []
    present = [m for m in metrics if any((d["metric"] == m).any() for _, _, d in items)]
    fig, axes = plt.subplots(1, len(present), figsize=(5.2 * len(present), 0.32 * len(items) + 1.6), squeeze=False)
    ys = np.arange(len(items))[::-1]
    for ax, m in zip(axes[0], present):
        for y, (_, _, d) in zip(ys, items):
            r = d[d["metric"] == m]
            if not len(r):
                continue
            r = r.iloc[0]
            hit = np.isfinite(r["lo"]) and (r["lo"] > 0 or r["hi"] < 0)
            c = "tab:blue" if hit else "tab:gray"
            if np.isfinite(r["lo"]):
                ax.plot([r["lo"], r["hi"]], [y, y], color=c, lw=2)
            ax.plot([r["mean"]], [y], "o", color=c, ms=5)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(ys, [f"{lab} − {d['vs'].iloc[0]} ({sw}, n={int(d['n'].max())})" for sw, lab, d in items],
                      fontsize=7)  # fmt: skip
        ax.set_xlabel(f"Δ {m} vs hard, 95% t-interval", fontsize=8)
        ax.grid(alpha=0.3, axis="x")
    n = int(max(d["n"].max() for _, _, d in items))
    fig.suptitle(f"screening (not confirmatory): every rule − hard, paired by seed, up to {n} seeds; blue = "
                 "interval excludes 0 (unadjusted)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    return save(fig, path, formats, tight=True)


# ------------------------------------------------------------------------------------------- pass@k vs k
def pass_at_k_figure(summary: pd.DataFrame, path: Path, formats=("png",)) -> list[Path]:
    """Final-checkpoint pass@k against k, one panel per sweep, one line per label (mean and 95% t-interval)."""
    ks = sorted(int(c.split("@")[1]) for c in summary.columns if re.fullmatch(r"pass@\d+", c))
    sweeps = [
        sw for sw in sorted(summary["sweep"].unique()) if summary.loc[summary["sweep"] == sw, "pass@1"].notna().any()
    ]
    if len(ks) < 2 or not sweeps:
        return []
    ncol = min(3, len(sweeps))
    nrow = -(-len(sweeps) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.4 * ncol, 3.2 * nrow), squeeze=False)
    for ax, sw in zip(axes.flat, sweeps):
        s = summary[summary["sweep"] == sw]
        labels = label_order(s)
        cols = colours(labels)
        for lab in labels:
            g = s[s["label"] == lab]
            have = [k for k in ks if g[f"pass@{k}"].notna().any()]
            pts = [interval(g[f"pass@{k}"].to_numpy(dtype=float)) for k in have]
            mean = np.array([p[0] for p in pts])
            ax.plot(have, mean, marker="o", ms=3, lw=1.1, color=cols[lab], label=f"{lab} (n={len(g)})")
            lo, hi = np.array([p[1] for p in pts]), np.array([p[2] for p in pts])
            if len(g) > 1:
                ax.fill_between(have, lo, hi, color=cols[lab], alpha=0.12, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (samples per problem)")
        ax.set_ylabel("pass@k (final checkpoint)")
        ax.set_title(f"{sw} ({_seeds(s)} distinct seeds)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5.5, frameon=False, loc="lower right")
    for ax in list(axes.flat)[len(sweeps) :]:
        ax.axis("off")
    fig.suptitle("pass@k vs k (unbiased estimator), mean and 95% t-interval over seeds", fontsize=10)
    place_grid(fig, axes.flat[0], titled=True)
    return save(fig, path, formats)


# ------------------------------------------------------------------------------------------- clipped-token depth
def clip_depth(bins: pd.DataFrame, path: Path, formats=("png",)) -> list[Path]:
    """Clipped tokens by depth into NSR's rescue zone, per side and per delta (each run counted once): the fraction
    of clipped tokens in each depth bin (bars) and the fraction of them rescued (points). A deeper zone (larger
    delta) takes in more clipped tokens, but each is rescued with a probability that falls with depth: NSR's dose."""
    if bins is None or not len(bins):
        return []
    g = bins.groupby(["delta", "executor", "side", "bin"], as_index=False)[["clipped", "rescued"]].sum()
    keys = sorted({(d, e) for d, e in zip(g["delta"], g["executor"])})
    runs = bins.groupby(["delta", "executor"])["run"].nunique()
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), squeeze=False)
    width = 0.8 / max(1, len(keys))
    for ax, side, name in (
        (axes[0, 0], "pos", "A > 0 (r above 1 + eps_high)"),
        (axes[0, 1], "neg", "A < 0 (r below 1 - eps_low)"),
    ):  # noqa: E501
        for i, (d, ex) in enumerate(keys):
            h = g[(g["delta"] == d) & (g["executor"] == ex) & (g["side"] == side)].sort_values("bin")
            total = h["clipped"].sum()
            if not total:
                continue
            col = cmap(0.1 + 0.8 * i / max(1, len(keys) - 1))
            x = h["bin"].to_numpy() + (i - (len(keys) - 1) / 2) * width
            ax.bar(x, h["clipped"] / total, width=width, color=col, alpha=0.7,
                   label=f"delta={d:g} {ex}: {int(total):,} clipped tokens, {runs[(d, ex)]} runs")  # fmt: skip
            with np.errstate(invalid="ignore", divide="ignore"):
                ax.plot(x, h["rescued"] / h["clipped"], "o", ms=3, color=col)
        n = int(g["bin"].max()) if len(g) else 0
        ax.set_xticks(range(n + 1), [f"{b / n:.1f}" for b in range(n)] + ["deeper"], fontsize=7)
        ax.set_xlabel("depth into the rescue zone (0 = clip boundary, 1 = its far edge)")
        ax.set_ylabel("share: clipped (bars), rescued (points)", fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=6, frameon=False)
    fig.suptitle("Clipped tokens by depth into the rescue zone, NSR runs (each config counted once)", fontsize=10)
    fig.tight_layout()
    return save(fig, path, formats)


# ------------------------------------------------------------------------------------------- theory
def monte_carlo_weight(ratios, sign: int, cfg: nsr.LossConfig, n: int = 4000, seed: int = 0) -> np.ndarray:
    """Empirical E[gradient weight] of ``cfg`` at each ratio, from nsr.policy_loss's own gradients.

    For each ratio r, ``n`` tokens with log pi_old = 0, log pi = log r and advantage ``sign``; the weight is the mean
    of d loss / d log pi divided by the unclipped gradient -A r (docs/method.md, "Expected behaviour").
    """
    r = torch.as_tensor(np.asarray(ratios, dtype=np.float64))
    logp = r.log()[:, None].expand(-1, n).clone().requires_grad_()
    old = torch.zeros_like(logp)
    adv = torch.full_like(old, float(sign))
    mask = torch.ones_like(old, dtype=torch.bool)
    loss, _ = nsr.policy_loss(logp, old, adv, mask, cfg, generator=torch.Generator().manual_seed(seed))
    loss.sum().backward()
    return (logp.grad.mean(1) / (-sign * r)).numpy()


def theory(
    path: Path,
    deltas=(0.1, 0.2, 0.3, 0.5),
    mc_deltas=(0.2, 0.5),
    formats=("png",),
    bins: pd.DataFrame | None = None,
) -> list[Path]:
    """Expected weight w(r) vs ratio, A > 0 and A < 0 panels (docs/method.md, "Expected behaviour").

    ``bins`` (RunSet.ratio_bins() of nsr runs) adds a second row: the mean gradient weight of clipped tokens
    logged during training, by depth into the rescue zone, against nsr.expected_weight at the bin centres.
    """
    base = nsr.LossConfig(rule="nsr")
    c, b = base.high, base.low
    empirical = bins is not None and len(bins) > 0
    fig, axes = plt.subplots(2 if empirical else 1, 2, figsize=(10, 7.4 if empirical else 3.8), squeeze=False)
    if empirical:
        _empirical_weights(axes[1], bins)
    axes = axes[0]
    cmap = plt.get_cmap("plasma")
    cols = {d: cmap(0.1 + 0.75 * i / max(1, len(deltas) - 1)) for i, d in enumerate(deltas)}
    top = c / (1 - max(deltas)) * 1.05  # past the widest rescue zone
    sides = (
        (1, np.linspace(0.95, top, 800), axes[0]),
        (-1, np.linspace(b / (1 + max(deltas)) * 0.9, 1.05, 800), axes[1]),
    )
    for sign, r, ax in sides:
        hard = nsr.expected_weight(torch.as_tensor(r), sign, nsr.LossConfig(rule="hard")).numpy()
        ax.plot(r, hard, color="black", lw=1.6, label="hard clip", zorder=5)
        for d in deltas:
            for ex, ls in (("noisy", "-"), ("clean", "--")):
                cfg = nsr.LossConfig(rule="nsr", delta=d, executor=ex)
                w = nsr.expected_weight(torch.as_tensor(r), sign, cfg).numpy()
                ax.plot(r, w, color=cols[d], ls=ls, lw=1.1, label=f"delta={d:g} {ex}")
        for d in mc_deltas:
            lo_r, hi_r = (c, c / (1 - d)) if sign > 0 else (b / (1 + d), b)
            rr = np.linspace(lo_r, hi_r, 9)[1:-1]
            for ex, mk in (("noisy", "o"), ("clean", "x")):
                cfg = nsr.LossConfig(rule="nsr", delta=d, executor=ex)
                ax.plot(
                    rr,
                    monte_carlo_weight(rr, sign, cfg),
                    ls="none",
                    marker=mk,
                    ms=4,
                    color=cols.get(d, "grey"),
                    label=f"Monte Carlo delta={d:g} {ex}",
                )
        edge = c if sign > 0 else b
        ax.axvline(edge, color="grey", lw=0.8, ls=":")
        ax.set_title(f"A {'> 0' if sign > 0 else '< 0'}: boundary r = {edge:g}")
        ax.set_xlabel("importance ratio r")
        ax.set_ylabel("expected gradient weight w(r)")
        ax.set_ylim(-0.03, 1.05)
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="center left", bbox_to_anchor=(1.0, 0.7 if empirical else 0.5), fontsize=7,
               frameon=False)  # fmt: skip
    fig.suptitle(
        "NSR in expectation: a boundary-local soft clip (lines: nsr.expected_weight; points: nsr.policy_loss)",
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, path, formats, tight=True)


def _empirical_weights(axes, bins: pd.DataFrame) -> None:
    """Row 2 of the theory figure: logged mean gradient weight of clipped tokens by depth into the rescue zone."""
    groups = bins.groupby(["delta", "executor", "side", "bin"], as_index=False)[["clipped", "rescued", "weight"]].sum()
    keys = sorted({(d, e) for d, e in zip(groups["delta"], groups["executor"])})
    cmap = plt.get_cmap("viridis")
    depth_line = np.linspace(1e-6, 1.0, 200)  # depth 0 is r on the boundary itself, which is not clipped
    for sign, side, ax in ((1, "pos", axes[0]), (-1, "neg", axes[1])):
        for i, (d, ex) in enumerate(keys):
            g = groups[(groups["delta"] == d) & (groups["executor"] == ex) & (groups["side"] == side)]
            g = g.sort_values("bin")
            if not len(g) or g["clipped"].sum() == 0:
                continue
            n = int(g["bin"].max())  # the last bin holds the deeper violations
            col = cmap(0.1 + 0.8 * i / max(1, len(keys) - 1))
            cfg = nsr.LossConfig(rule="nsr", delta=float(d), executor=ex)
            r_line = nsr.theory.depth_to_ratio(depth_line, sign, cfg)
            w_line = nsr.expected_weight(torch.as_tensor(r_line), sign, cfg).numpy()
            ax.plot(depth_line, w_line, color=col, lw=1.0)
            x = np.where(g["bin"] < n, (g["bin"] + 0.5) / n, 1.1)
            w = g["weight"] / g["clipped"].clip(lower=1)
            ax.plot(x, w, ls="none", marker="o", ms=4, color=col,
                    label=f"delta={d:g} {ex}: {int(g['clipped'].sum()):,} clipped tokens")  # fmt: skip
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0, 1.1], ["0", "0.25", "0.5", "0.75", "1", "deeper"])
        ax.set_title(f"CPU runs, A {'> 0' if sign > 0 else '< 0'}: logged weight (points) vs theory (lines)",
                     fontsize=9)  # fmt: skip
        ax.set_xlabel("depth into the rescue zone (0 = clip boundary, 1 = r at its far edge)")
        ax.set_ylabel("mean gradient weight of clipped tokens")
        ax.set_ylim(-0.03, 0.75)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper right", frameon=False)
