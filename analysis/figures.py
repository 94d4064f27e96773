"""Figures (matplotlib, Agg backend, deterministic bytes for the same inputs). ``make_all`` is the only caller
that writes results/figures; each function takes loaded data and a path and returns the files it wrote.

* :func:`dynamics`  per sweep: reward, entropy, clipped / rescued fraction, response length and eval pass@1 vs step;
  one line per label (mean over seeds) with a 95% bootstrap band across seeds.
* :func:`delta_sweep`  final metric vs delta for the delta-using arms, with the baseline and any single-point arm
  (the widened region) as reference lines; the widened region is placed at x = its extra width over the baseline.
* :func:`theory`  the expected gradient weight w(r) of NSR (nsr.expected_weight) for both executors and several
  delta, the hard-clip step, and Monte-Carlo points measured from nsr.policy_loss's own gradients.
* :func:`judge_executor`  entropy, reward and eval pass@1 vs step, noisy decision dashed, clean decision solid,
  one colour per ratio-noise sigma.

Training curves are averaged within at most ``MAX_POINTS`` equal step bins per run before the mean and band across
seeds are taken, which both smooths single-rollout noise and keeps the figures fast for 1,000-step runs.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

import nsr  # noqa: E402
from analysis.stats import bootstrap_band, bootstrap_ci  # noqa: E402
from analysis.tables import baseline_arm, label_order, resolve_k  # noqa: E402

MAX_POINTS = 200
DPI = 110
PANELS = (
    ("reward_mean", "training reward"),
    ("entropy", "entropy (nats / token)"),
    ("clip_frac", "clipped fraction"),
    ("rescue_frac", "rescued fraction"),
    ("response_len", "response length (tokens)"),
    ("pass@1", "eval pass@1 (sampled)"),
)
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


def legend_below(fig, ax, per_row: int = 4) -> None:
    """One figure legend under the panels: the figure grows by the legend's height (no bbox_inches="tight",
    which costs a second full draw per figure)."""
    handles, names = ax.get_legend_handles_labels()
    rows = -(-len(names) // per_row) if names else 0
    w, h = fig.get_size_inches()
    extra = 0.22 * rows + 0.1
    fig.set_size_inches(w, h + extra)
    if names:
        fig.legend(handles, names, loc="lower center", ncol=min(per_row, len(names)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, extra / (h + extra), 1, 1))


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
    if Y.size == 0 or not np.isfinite(Y).any():
        return
    mean, lo, hi = bootstrap_band(Y)
    ax.plot(x, mean, color=colour, lw=1.4, ls=linestyle, label=label)
    if Y.shape[0] > 1:
        ax.fill_between(x, lo, hi, color=colour, alpha=0.18, lw=0)


def _curves_figure(rs, summary, curves, sweep, panels, style, title) -> plt.Figure | None:
    s = summary[summary["sweep"] == sweep]
    if not len(s):
        return None
    labels = label_order(s)
    runs_of = {lab: list(s.loc[s["label"] == lab, "run"]) for lab in labels}
    steps = rs.steps[rs.steps["run"].isin(s["run"])] if len(rs.steps) else rs.steps
    mine = curves[curves["run"].isin(s["run"])] if len(curves) else curves
    panels = [
        (m, t)
        for m, t in panels
        if (m in steps.columns and steps[m].notna().any()) or (m in mine.columns and mine[m].notna().any())
    ]
    if not panels:
        return None
    by_run = dict(tuple(steps.groupby("run", sort=False))) if len(steps) else {}
    edges = step_bins(steps) if len(steps) else None
    ncol = min(3, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.0 * nrow), squeeze=False)
    for ax, (metric, ylabel) in zip(axes.flat, panels):
        for lab in labels:
            colour, ls = style(lab)
            if metric in steps.columns:
                x, Y = binned(by_run, runs_of[lab], metric, edges)
            else:
                x, Y = eval_matrix(mine, runs_of[lab], metric)
            n = len(runs_of[lab])
            _band(ax, x, Y, colour, f"{lab} (n={n})", ls)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    legend_below(fig, axes.flat[0])
    return fig


def dynamics_figure(rs, summary, curves, sweep: str) -> plt.Figure | None:
    """The training-dynamics figure of one sweep (None without runs); ``curves`` = summary.eval_curves(...)."""
    s = summary[summary["sweep"] == sweep]
    cols = colours(label_order(s))
    title = f"{sweep}: mean over seeds, band = 95% bootstrap CI"
    return _curves_figure(rs, summary, curves, sweep, PANELS, lambda lab: (cols[lab], "-"), title)


def dynamics(rs, summary, curves, sweep: str, path: Path, formats=("png",)) -> list[Path]:
    """Save :func:`dynamics_figure` at ``path``; returns the files written."""
    fig = dynamics_figure(rs, summary, curves, sweep)
    return save(fig, path, formats) if fig is not None else []


def judge_executor(rs, summary, curves, path: Path, sweep: str = "judge_executor", formats=("png",)) -> list[Path]:
    """Noisy vs clean decision: entropy, reward and pass@1 vs step (dashed = noisy judge, solid = clean judge)."""
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
        "judge / executor: noisy decision (dashed) vs clean decision (solid), colour = ratio-noise sigma",
    )
    return save(fig, path, formats) if fig is not None else []


# ------------------------------------------------------------------------------------------- delta sweep
def delta_x(s: pd.DataFrame, runs: pd.DataFrame) -> pd.Series:
    """x position of each run in the delta figure: loss.delta for delta-using rules; for a hard-clip run whose
    region is wider than the baseline arm's, the extra width eps_high - eps_high(baseline); else NaN."""
    cfg = runs.set_index("run").loc[s["run"], ["loss.rule", "loss.delta", "loss.eps_high"]].set_index(s.index)
    base = baseline_arm(s)
    base_eps = cfg.loc[s["arm"] == base, "loss.eps_high"]
    b = float(base_eps.iloc[0]) if len(base_eps) else np.nan
    widened = (cfg["loss.rule"] == "hard") & (cfg["loss.eps_high"].astype(float) > b + 1e-12)
    x = pd.Series(np.nan, index=s.index)
    x[cfg["loss.rule"].isin(DELTA_RULES)] = cfg["loss.delta"].astype(float)
    x[widened] = cfg.loc[widened, "loss.eps_high"].astype(float) - b
    return x


def delta_sweep(rs, summary, path: Path, sweep: str = "delta", formats=("png",)) -> list[Path]:
    """Final metrics vs delta (mean and 95% bootstrap CI over seeds)."""
    s = summary[summary["sweep"] == sweep].copy()
    if not len(s):
        return []
    s["x"] = delta_x(s, rs.runs)
    # one series per delta-using rule (arms that differ only by delta join it), one per other arm
    rule = rs.runs.set_index("run").loc[s["run"], "loss.rule"].to_numpy()
    s["series"] = np.where(np.isin(rule, DELTA_RULES), rule, s["arm"].to_numpy())
    metrics = [
        m for m in ("pass@1", resolve_k(s), "final_reward", "final_entropy") if m and m in s and s[m].notna().any()
    ]
    base = baseline_arm(s)
    names = sorted(s["series"].unique(), key=lambda a: (a != base, a))
    cols = colours(names)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.3), squeeze=False)
    for ax, m in zip(axes.flat, metrics):
        for arm in names:
            g = s[s["series"] == arm]
            xs = sorted(g["x"].dropna().unique())
            if len(xs) >= 2:  # a series over delta
                pts = [bootstrap_ci(g.loc[g["x"] == x, m].to_numpy(dtype=float)) for x in xs]
                mean = np.array([p[0] for p in pts])
                err = np.array([[p[0] - p[1], p[2] - p[0]] for p in pts]).T
                ax.errorbar(xs, mean, yerr=np.nan_to_num(err), color=cols[arm], marker="o", ms=4, capsize=3, label=arm)
            else:  # a reference: the baseline, or a single widened region
                mean, lo, hi, n = bootstrap_ci(g[m].to_numpy(dtype=float))
                ax.axhline(mean, color=cols[arm], ls="--", lw=1.2, label=f"{arm} (reference)")
                if np.isfinite(lo):
                    ax.axhspan(lo, hi, color=cols[arm], alpha=0.12, lw=0)
                if xs:
                    ax.plot(xs, [mean], marker="s", color=cols[arm], ls="none")
        ax.set_xlabel("delta (widened region: extra eps)")
        ax.set_ylabel(m)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{sweep}: final metrics vs delta (mean over seeds, 95% bootstrap CI)", fontsize=11)
    legend_below(fig, axes.flat[0])
    return save(fig, path, formats)


# ------------------------------------------------------------------------------------------- theory
def monte_carlo_weight(ratios, sign: int, cfg: nsr.LossConfig, n: int = 4000, seed: int = 0) -> np.ndarray:
    """Empirical E[gradient weight] of ``cfg`` at each ratio, from nsr.policy_loss's own gradients.

    For each ratio r, ``n`` tokens with log pi_old = 0, log pi = log r and advantage ``sign``; the weight is the mean
    of d loss / d log pi divided by the unclipped gradient -A r (method.md, "Expected behaviour").
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
    """Expected weight w(r) vs ratio, A > 0 and A < 0 panels (method.md, "Expected behaviour").

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
