"""Tables: per sweep, arms x metrics with seed-level 95% Student-t intervals (analysis.stats.interval, the one
interval rule of tables, figures and claims), paired differences vs the baseline arm, and for ``main`` the paper's
reported numbers side by side (results/paper/main.csv). Markdown and LaTeX.

    from analysis import load, summary, tables
    s = summary.summarize(load.load_runs())
    long = tables.arm_stats(s[s.sweep == "delta"])                   # label, metric, mean, lo, hi, n
    diffs = tables.paired_vs_baseline(s[s.sweep == "delta"])         # label, vs, metric, mean, lo, hi, n
    print(tables.sweep_markdown(s, "delta"))

Pairing: two labels are compared on the seeds both have (the same seed means the same warm start, eval set and
data order, so a paired difference removes that shared noise). The counterpart of a label in another arm is the
label of that arm whose grid point agrees on every key both points have (``nsr delta=0.2`` pairs with ``hard``;
``noisy_decision ratio_noise=0.1`` with ``clean_decision ratio_noise=0.1``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.stats import interval, paired_differences
from analysis.summary import metric_doc, pairs
from experiments.rundir import REPO_ROOT

PAPER_DIR = REPO_ROOT / "results" / "paper"
TABLE_METRICS = (
    "final_reward",
    "best_reward",
    "late_pass@1",
    "pass@1",
    "pass@K",
    "greedy",
    "final_entropy",
    "entropy_spike",
    "clip_frac_low",
    "clip_frac_high",
    "rescue_frac",
    "pushout_frac",
)
"""Columns of a sweep table; ``pass@K`` is the largest k every run of the sweep has."""


# ------------------------------------------------------------------------------------------- selection
def _point_key(point: dict) -> tuple:
    return tuple((k, (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))) for k, v in sorted(point.items()))


def label_order(s: pd.DataFrame) -> list[str]:
    """Labels with the baseline arm first, then arms in order of first appearance, points in numeric order."""
    if not len(s):
        return []
    base = baseline_arm(s)
    arm_rank = {a: i for i, a in enumerate(dict.fromkeys(s["arm"]))}
    firsts = s[["label", "arm", "point"]].drop_duplicates("label")
    keyed = sorted(
        firsts.itertuples(index=False),
        key=lambda r: (r.arm != base, arm_rank[r.arm], _point_key(r.point)),
    )
    return [r.label for r in keyed]


def baseline_arm(s: pd.DataFrame) -> str | None:
    """The sweep's baseline arm (config.yaml meta.baseline), if its runs say one."""
    b = s["baseline"].dropna().unique() if "baseline" in s.columns else []
    return str(b[0]) if len(b) else None


def label_points(s: pd.DataFrame) -> dict[str, tuple[str, dict]]:
    """{label: (arm, point)}."""
    first = s[["label", "arm", "point"]].drop_duplicates("label")
    return {lab: (arm, pt) for lab, arm, pt in zip(first["label"], first["arm"], first["point"])}


def _same(u, v) -> bool:
    if isinstance(u, (int, float)) and isinstance(v, (int, float)) and not isinstance(u, bool):
        return math.isclose(u, v, rel_tol=1e-9, abs_tol=1e-12)
    return u == v


def select_labels(s: pd.DataFrame, arm: str, point: dict | None = None) -> list[str]:
    """Labels of ``arm`` whose grid point contains ``point`` (key: value pairs), in :func:`label_order`."""
    pts = label_points(s)
    want = point or {}
    return [
        lab
        for lab in label_order(s)
        if pts[lab][0] == arm and all(k in pts[lab][1] and _same(pts[lab][1][k], v) for k, v in want.items())
    ]


def counterparts(s: pd.DataFrame, label: str, arm: str, point: dict | None = None, ignore=()) -> list[str]:
    """Labels of ``arm`` (containing ``point``) whose grid point agrees with ``label``'s on every shared key but
    those in ``ignore`` (the keys a comparison sets on purpose)."""
    pts = label_points(s)
    p = pts[label][1]
    return [
        lab
        for lab in select_labels(s, arm, point)
        if lab != label and all(_same(pts[lab][1][k], p[k]) for k in (pts[lab][1].keys() & p.keys()) - set(ignore))
    ]


def resolve_k(s: pd.DataFrame) -> str | None:
    """``pass@K``: the largest pass@k column with a value for every run that has pass@1."""
    has = s["pass@1"].notna() if "pass@1" in s.columns else pd.Series(False, index=s.index)
    if not has.any():
        return None
    ks = sorted(int(m.group(1)) for c in s.columns if (m := re.fullmatch(r"pass@(\d+)", c)))
    full = [k for k in ks if k > 1 and s.loc[has, f"pass@{k}"].notna().all()]
    return f"pass@{full[-1]}" if full else None


def table_metrics(s: pd.DataFrame, metrics=TABLE_METRICS) -> list[str]:
    """Metric columns to show: ``pass@K`` resolved; columns with no value, or one value in every run, dropped."""
    out = []
    for m in metrics:
        if m == "pass@K":
            m = resolve_k(s)
        if m is None or m not in s.columns or s[m].isna().all():
            continue
        if s[m].dropna().nunique() < 2 and len(s) > 1:  # constant across the sweep: says nothing
            continue
        out.append(m)
    return out


# ------------------------------------------------------------------------------------------- statistics
def arm_stats(s: pd.DataFrame, metrics=None) -> pd.DataFrame:
    """Mean and 95% t-interval over seeds, per label and metric. Columns: label, arm, metric, mean, lo, hi, n."""
    metrics = table_metrics(s) if metrics is None else list(metrics)
    rows = []
    for label in label_order(s):
        g = s[s["label"] == label]
        for m in metrics:
            mean, lo, hi, n = interval(g[m].to_numpy(dtype=float))
            rows.append(
                {"label": label, "arm": g["arm"].iloc[0], "metric": m, "mean": mean, "lo": lo, "hi": hi, "n": n}
            )
    return pd.DataFrame(rows, columns=["label", "arm", "metric", "mean", "lo", "hi", "n"])


def compare(s: pd.DataFrame, a: str, b: str, metric: str) -> dict:
    """Paired difference a - b of ``metric`` between labels ``a`` and ``b`` over their common seeds.

    Returns:
        {a, b, metric, mean, lo, hi, n, mixed, a_mean, b_mean, seeds}; lo/hi NaN with fewer than 2 pairs; ``mixed``:
        pairs of a legacy and a current run (:func:`mixed_pairs`).
    """
    return compare_many(s, a, b, [metric])[0]


def compare_many(s: pd.DataFrame, a: str, b: str, metrics) -> list[dict]:
    """:func:`compare` for each of ``metrics``, the two labels' rows and pairing keys taken once."""
    sa, sb = s[s["label"] == a], s[s["label"] == b]
    ka, kb = pairs(sa), pairs(sb)
    legacy = "legacy" in s.columns
    la = dict(zip(ka, sa["legacy"])) if legacy else {}
    lb = dict(zip(kb, sb["legacy"])) if legacy else {}
    out = []
    for metric in metrics:
        va = dict(zip(ka, sa[metric], strict=True))
        vb = dict(zip(kb, sb[metric], strict=True))
        diffs, seeds = paired_differences(va, vb)
        mean, lo, hi, n = interval(diffs)
        out.append({
            "mixed": _mixed(la, lb, seeds),
            "a": a,
            "b": b,
            "metric": metric,
            "mean": mean,
            "lo": lo,
            "hi": hi,
            "n": n,
            "a_mean": float(np.mean([va[k] for k in seeds])) if seeds else math.nan,
            "b_mean": float(np.mean([vb[k] for k in seeds])) if seeds else math.nan,
            "seeds": seeds,
        })  # fmt: skip
    return out


def mixed_pairs(s: pd.DataFrame, a: str, b: str, seeds) -> int:
    """Same-seed pairs of labels ``a`` and ``b`` in which one run is legacy (older code) and the other current. Both
    run the same config: the pair is a valid paired sample, but the two runs do not share the common random numbers
    that same-seed pairing relies on (the draws changed with the code), so such pairs are counted and shown."""
    if "legacy" not in s.columns:
        return 0
    la = dict(zip(pairs(s[s["label"] == a]), s.loc[s["label"] == a, "legacy"]))
    lb = dict(zip(pairs(s[s["label"] == b]), s.loc[s["label"] == b, "legacy"]))
    return _mixed(la, lb, seeds)


def _mixed(la: dict, lb: dict, seeds) -> int:
    """Of the pairs ``seeds``, those whose runs differ in legacy-ness ({pair key: legacy} of each label; {}: none)."""
    return sum(bool(la[k]) != bool(lb[k]) for k in seeds) if la and lb else 0


def paired_vs_baseline(s: pd.DataFrame, metrics=None) -> pd.DataFrame:
    """Paired differences of every non-baseline label vs its baseline counterpart (pairs by seed).

    Columns: label, vs, metric, mean, lo, hi, n, mixed. Empty when the sweep names no baseline arm; a label with
    no (or several) baseline counterparts gets rows with n = 0 and ``vs`` saying why.
    """
    base = baseline_arm(s)
    metrics = table_metrics(s) if metrics is None else list(metrics)
    rows = []
    if base is not None:
        for label in label_order(s):
            if label_points(s)[label][0] == base:
                continue
            cps = counterparts(s, label, base)
            if len(cps) != 1:  # shown as a row without numbers, never dropped silently
                vs = f"{base} (no run)" if not cps else f"{base} ({len(cps)} candidates)"
                rows += [{"label": label, "vs": vs, "metric": m, "mean": math.nan, "lo": math.nan, "hi": math.nan,
                          "n": 0, "mixed": 0} for m in metrics]  # fmt: skip
                continue
            for r in compare_many(s, label, cps[0], metrics):
                rows.append(
                    {"label": label, "vs": cps[0], **{k: r[k] for k in ("metric", "mean", "lo", "hi", "n", "mixed")}}
                )
    return pd.DataFrame(rows, columns=["label", "vs", "metric", "mean", "lo", "hi", "n", "mixed"])


# ------------------------------------------------------------------------------------------- formatting
def fmt(x: float) -> str:
    """3 decimals, or 3 significant digits below 0.1 in magnitude (fractions like rescue_frac ~ 0.003)."""
    if x is None or not np.isfinite(x):
        return "–"
    if abs(x) < 1e-12:  # float noise of a difference of equal numbers
        x = 0.0
    if x != 0 and abs(x) < 0.1:
        return f"{x:.3g}"
    return f"{x:.3f}"


def cell(mean, lo, hi, latex: bool = False, signif: bool = False) -> str:
    """``mean [lo, hi]``; with ``signif`` a ``*`` marks a CI that excludes 0."""
    if not np.isfinite(mean):
        return "–"
    star = "*" if signif and np.isfinite(lo) and (lo > 0 or hi < 0) else ""
    if not np.isfinite(lo):
        return fmt(mean) + star
    if latex:
        return f"{fmt(mean)}{star} {{\\scriptsize [{fmt(lo)}, {fmt(hi)}]}}"
    return f"{fmt(mean)}{star} [{fmt(lo)}, {fmt(hi)}]"


def _wide(long: pd.DataFrame, row: str, latex: bool, signif: bool) -> tuple[list[str], list[list[str]]]:
    metrics = list(dict.fromkeys(long["metric"]))
    rows = []
    for key, g in long.groupby(row, sort=False):
        by = {r.metric: r for r in g.itertuples(index=False)}
        n = int(g["n"].max()) if len(g) else 0
        cells = [cell(by[m].mean, by[m].lo, by[m].hi, latex, signif) for m in metrics]
        if latex:
            rows.append([latex_escape(str(key)), str(n), *[c.replace("–", "--") for c in cells]])
        else:
            rows.append([str(key), str(n), *cells])
    return metrics, rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def latex_escape(text: str) -> str:
    pairs = [("\\", r"\textbackslash{}"), ("_", r"\_"), ("%", r"\%"), ("&", r"\&"), ("#", r"\#"), ("$", r"\$")]
    pairs += [("Δ", r"$\Delta$"), ("−", "--"), ("–", "--"), ("δ", r"$\delta$")]
    for a, b in pairs:
        text = text.replace(a, b)
    return text


def latex(header: list[str], rows: list[list[str]], caption: str = "") -> str:
    """A booktabs tabular; ``rows`` are LaTeX already (escape text cells with :func:`latex_escape`)."""
    head = " & ".join(latex_escape(h) for h in header)
    body = "\n".join(" & ".join(r) + r" \\" for r in rows)
    cap = f"% {caption}\n" if caption else ""
    return (
        f"{cap}\\begin{{tabular}}{{l{'r' * (len(header) - 1)}}}\n\\toprule\n{head} \\\\\n\\midrule\n{body}\n"
        "\\bottomrule\n\\end{tabular}\n"
    )


def sweep_tables(s: pd.DataFrame, sweep: str) -> dict[str, str]:
    """{"md": markdown, "tex": LaTeX} for one sweep: the arm table, then the paired differences vs baseline."""
    g = s[s["sweep"] == sweep]
    metrics = table_metrics(g)
    stats = arm_stats(g, metrics)
    diffs = paired_vs_baseline(g, metrics)
    base = baseline_arm(g)
    out = {}
    for kind in ("md", "tex"):
        is_tex = kind == "tex"
        cols, rows = _wide(stats, "label", is_tex, signif=False)
        parts = []
        title = f"{sweep}: mean over seeds [95% t-interval]"
        if is_tex:
            parts.append(latex(["arm", "seeds", *cols], rows, caption=title))
        else:
            parts += [f"### {title}\n", markdown(["arm", "seeds", *cols], rows)]
        if len(diffs):
            diffs = diffs.assign(pair=diffs["label"] + " − " + diffs["vs"])
            dcols, drows = _wide(diffs, "pair", is_tex, signif=True)
            dtitle = (
                f"{sweep}: paired difference vs baseline arm '{base}' (same seed) [95% t-interval], "
                "* = interval excludes 0 (unadjusted; the claims table applies Holm)"
            )
            if is_tex:
                parts.append(latex(["difference", "pairs", *[f"Δ {c}" for c in dcols]], drows, caption=dtitle))
            else:
                parts += [f"\n### {dtitle}\n", markdown(["difference", "pairs", *[f"Δ {c}" for c in dcols]], drows)]
        notes = [f"{m}: {metric_doc(m)}" for m in metrics]
        mixed = diffs.groupby("pair", sort=False)["mixed"].max() if len(diffs) else pd.Series(dtype=int)
        mixed = mixed[mixed > 0]
        if len(mixed):
            notes.insert(0, "pairs of a legacy and a current run (same config, older code: a valid pair, but without "
                         "the shared random draws of same-seed pairs): "
                         + ", ".join(f"{pair} {int(k)}" for pair, k in mixed.items()))  # fmt: skip
        legacy = int(g["legacy"].sum()) if "legacy" in g.columns else 0
        if legacy:
            notes.insert(0, f"legacy runs (older code) counted in this sweep: {legacy} of {len(g)}")
        if is_tex:
            parts.append("".join(f"% {n}\n" for n in notes))
        else:
            parts.append("\n" + "".join(f"- {n}\n" for n in notes))
        out[kind] = "\n".join(parts)
    return out


# ------------------------------------------------------------------------------------------- main vs paper
def load_paper(path: str | Path = PAPER_DIR / "main.csv") -> pd.DataFrame:
    """The paper's reported numbers: model, base, benchmark, metric, baseline, nsr, delta (percent), note."""
    df = pd.read_csv(path, dtype={"model": str, "base": str, "benchmark": str, "metric": str, "note": str})
    need = ["model", "base", "benchmark", "metric", "baseline", "nsr", "delta"]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; expected {', '.join(need)}")
    return df.fillna({"base": "", "note": ""})


BASES = {"token": "DAPO", "sequence": "GSPO"}
"""loss.level -> the base the paper names (docs/method.md intervention 6)."""


def _ours_main(s: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Our main-sweep numbers per (model, base, benchmark, metric): baseline, nsr, paired delta (percent)."""
    g = s[s["sweep"] == "main"]
    if not len(g):
        return pd.DataFrame(columns=["model", "base", "benchmark", "metric"])
    cfg = runs.set_index("run")[["model.name", "loss.level", "loss.rule"]]
    g = g.join(cfg, on="run")
    base_arm = baseline_arm(g)
    rows = []
    for (model, level), gg in g.groupby(["model.name", "loss.level"], sort=True):
        base_labels = sorted(gg.loc[gg["arm"] == base_arm, "label"].unique())
        nsr_labels = sorted(gg.loc[(gg["loss.rule"] == "nsr") & (gg["arm"] != base_arm), "label"].unique())
        if len(base_labels) != 1 or not nsr_labels:
            continue
        for col in gg.columns:
            match = re.fullmatch(r"(pass@\d+)\[(.+)\]", col)
            if match is None or gg[col].isna().all():  # a benchmark only other sweeps' runs evaluate on
                continue
            metric, bench = match.groups()
            r = compare(gg, nsr_labels[0], base_labels[0], col)
            rows.append(
                {
                    "model": str(model).rsplit("/", 1)[-1],
                    "base": BASES.get(level, level),
                    "benchmark": bench,
                    "metric": metric,
                    "ours_baseline": 100 * r["b_mean"],
                    "ours_nsr": 100 * r["a_mean"],
                    "ours_delta": cell(100 * r["mean"], 100 * r["lo"], 100 * r["hi"], signif=True),
                    "ours_seeds": r["n"],
                }
            )
    return pd.DataFrame(rows)


def main_table(s: pd.DataFrame, runs: pd.DataFrame, paper: pd.DataFrame) -> dict[str, str]:
    """The paper's numbers next to ours (percent), matched on model, benchmark and metric (case-insensitive) and
    on the base (DAPO/GSPO) where the paper's row names one."""
    rows: list[dict] = [
        {"model": r.model, "base": r.base, "benchmark": r.benchmark, "metric": r.metric, "paper": r}
        for r in paper.itertuples(index=False)
    ]
    for o in _ours_main(s, runs).itertuples(index=False):
        want = (o.model.lower(), o.benchmark.lower(), o.metric.lower())
        match = next(
            (
                d
                for d in rows
                if "ours" not in d
                and (d["model"].lower(), d["benchmark"].lower(), d["metric"].lower()) == want
                and d["base"] in ("", o.base)
            ),
            None,
        )
        if match is None:
            match = {"model": o.model, "base": o.base, "benchmark": o.benchmark, "metric": o.metric}
            rows.append(match)
        match["base"] = match["base"] or o.base
        match["ours"] = o

    def num(v) -> str:
        return f"{float(v):.2f}" if v is not None and np.isfinite(float(v)) else "–"

    header = ["model", "base", "benchmark", "metric", "paper base", "paper NSR", "paper Δ", "ours base", "ours NSR"]
    header += ["ours Δ [CI]", "seeds"]
    table = []
    for d in rows:
        p, o = d.get("paper"), d.get("ours")
        table.append(
            [d["model"], d["base"] or "–", d["benchmark"], d["metric"]]
            + ([num(p.baseline), num(p.nsr), num(p.delta)] if p is not None else ["–"] * 3)
            + ([num(o.ours_baseline), num(o.ours_nsr), o.ours_delta, str(o.ours_seeds)] if o is not None else ["–"] * 4)
        )
    title = "main: the paper's reported numbers (percent) next to this repo's runs of the main sweep"
    note = "paper: results/paper/main.csv (from docs/method.md, 'What the paper reports'); – = not reported / not run\n"
    tex_rows = [[latex_escape(c) if i < 4 else c.replace("–", "--") for i, c in enumerate(r)] for r in table]
    return {"md": f"### {title}\n\n" + markdown(header, table) + "\n" + note, "tex": latex(header, tex_rows, title)}
