"""The paired per-update test's statistics (docs/mechanism.md): a file of ``python -m experiments.mechanism --out`` ->
per-rule intervals, and the stage-A2 gate.

    python -m analysis.mechanism results/mechanism/tiny-s0-2-steps4-200.jsonl            # the per-rule table
    python -m analysis.mechanism results/mechanism/a2/tl44.jsonl --gate soft              # one candidate's gate

Each line of the file is one state of a hard baseline run: exact pass@1 before the update, after each rule's update
(held-out split, ``after``; training split, ``train_after``) and the update's clip / rescue fractions. The difference
rule - hard at one state is a paired replicate. Intervals are Student-t (analysis.stats.interval): over states, and
over the per-run means (which does not assume the states of one run to be independent).

The gate (analysis/regime.yaml, stage_a2.gate): per baseline run, the mean over its states of (rule - hard) on the
training split; over the runs' means, the one-sided Student-t test of mean > 0 and its 95% lower bound; Holm across
the candidates (:func:`gate_family`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy import optimize
from scipy import stats as sps

from analysis.stats import holm, interval


def load_lines(path: str | Path) -> list[dict]:
    """Every JSON line of a mechanism file, header lines ({"header": {...}}: git commit, command) included; a
    truncated last line, from a test stopped while writing, is dropped."""
    lines = Path(path).read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return out


def load_states(path: str | Path) -> list[dict]:
    """The states of a mechanism file (one JSON object per line; header lines are skipped)."""
    return [r for r in load_lines(path) if "header" not in r]


def load_headers(path: str | Path) -> list[dict]:
    """The header lines of a mechanism file (one per walk or resume: git commit, command, started)."""
    return [r["header"] for r in load_lines(path) if "header" in r]


def _runs(states: list[dict]) -> list:
    """The baseline run of each state: its seed where recorded, else its index in the file."""
    return [s["seed"] if s.get("seed", -1) >= 0 else s["run"] for s in states]


def summarize(states: list[dict], labels: list[str], level: float = 0.95) -> list[dict]:
    """Per rule label: mean one-step change of exact held-out pass@1, and the paired difference to hard with its
    Student-t interval over states and over per-run means; the same on the training split; clip / rescue."""
    runs = _runs(states)
    rows = []
    for lab in labels:
        change = np.array([s["after"][lab] - s["before"] for s in states])
        diff = np.array([s["after"][lab] - s["after"]["hard"] for s in states])
        tdiff = np.array([s["train_after"][lab] - s["train_after"]["hard"] for s in states])
        per_run = [diff[[r == k for r in runs]].mean() for k in dict.fromkeys(runs)]
        mean, lo, hi, n = interval(diff, level)
        _, rlo, rhi, _ = interval(per_run, level)
        tmean, tlo, thi, _ = interval(tdiff, level)
        rows.append(
            {
                "rule": lab,
                "states": n,
                "change": float(change.mean()),
                "diff": mean,
                "diff_lo": lo,
                "diff_hi": hi,
                "diff_run_lo": rlo,
                "diff_run_hi": rhi,
                "share_positive": float((diff > 0).mean()),
                "train_diff": tmean,
                "train_diff_lo": tlo,
                "train_diff_hi": thi,
                "clip_frac": float(np.mean([s["metrics"][lab]["clip_frac"] for s in states])),
                "rescue_frac": float(np.mean([s["metrics"][lab]["rescue_frac"] for s in states])),
            }
        )
    return rows


LOGPROB = "the probe set's summed log-prob, nats"
"""The held-out score of experiments.mechanism.trl's files (stage R1): ``before`` / ``after`` are log-probs."""


def table(rows: list[dict], scale: float = 1e4, score: str = "held-out pass@1") -> str:
    """Markdown table, changes in units of 1/scale (1e4: basis points of pass@1); ``score`` names the held-out score
    (the trl backend's files: the probe set's log-prob, :data:`LOGPROB`)."""
    u = f"x1e-{round(math.log10(scale))}" if scale != 1 else ""
    lines = [
        f"| rule | one-step change of {score} ({u}) | rule - hard ({u}) [95% CI over states] | "
        f"[95% CI over runs] | states with rule > hard | train split: rule - hard ({u}) [95% CI] | "
        "clip frac | rescue frac |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "nan" if not math.isfinite(x) else f"{x * scale:+.3f}"

    for r in rows:
        lines.append(
            f"| {r['rule']} | {f(r['change'])} | {f(r['diff'])} [{f(r['diff_lo'])}, {f(r['diff_hi'])}] | "
            f"[{f(r['diff_run_lo'])}, {f(r['diff_run_hi'])}] | {r['share_positive']:.2f} | "
            f"{f(r['train_diff'])} [{f(r['train_diff_lo'])}, {f(r['train_diff_hi'])}] | "
            f"{r['clip_frac']:.4f} | {r['rescue_frac']:.4f} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the gate
SPLITS = {"train": ("train_after", "train_before"), "held-out": ("after", "before")}
"""The gate's score: --split train (the toy's stages A2 / A3: exact pass@1 on the training split) or held-out (the
toy's held-out pass@1; stage R1's teacher-forced log-prob of the probe set, experiments.mechanism.probe_set)."""


def gate(states: list[dict], rule: str = "soft", level: float = 0.95, split: str = "train") -> dict:
    """The stage-A2 gate statistic of one candidate (``split``: training split by default, or held-out: SPLITS).

    Returns {runs, states, mean, lower (one-sided ``level`` lower bound of the mean over run means), upper (the
    one-sided ``level`` upper bound), p (one-sided, H1: mean > 0), run_means, hard_change (mean one-step change of
    hard's own update), dose (the gradient weight the rule's update gave clipped tokens, per valid token), clip_frac
    (hard's)}. Stage A3 reads the same statistic (analysis.regime.a3_readout).
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not valid; allowed: {', '.join(SPLITS)}")
    after, before = SPLITS[split]
    runs = _runs(states)
    diff = np.array([s[after][rule] - s[after]["hard"] for s in states], dtype=np.float64)
    means = np.array([diff[[r == k for r in runs]].mean() for k in dict.fromkeys(runs)], dtype=np.float64)
    n = len(means)
    mean = float(means.mean()) if n else math.nan
    if n >= 2:
        se = float(means.std(ddof=1)) / math.sqrt(n)
        lower = mean - float(sps.t.ppf(level, n - 1)) * se
        p = float(sps.t.sf(mean / se, n - 1)) if se > 0 else (0.0 if mean > 0 else 1.0)
    else:
        lower, p = math.nan, math.nan
    upper = 2 * mean - lower if math.isfinite(lower) else math.nan  # the one-sided bound the other way
    return {
        "runs": n,
        "states": len(states),
        "mean": mean,
        "lower": lower,
        "upper": upper,
        "p": p,
        "run_means": [float(x) for x in means],
        "hard_change": float(np.mean([s[after]["hard"] - s[before] for s in states])) if states else math.nan,
        "dose": float(np.mean([s["metrics"][rule].get("dose", math.nan) for s in states])) if states else math.nan,
        "clip_frac": float(np.mean([s["metrics"]["hard"]["clip_frac"] for s in states])) if states else math.nan,
    }


def power_one_sided(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of the one-sided one-sample t-test (H1: mean > 0) at level ``alpha`` over ``n`` values of standard
    deviation ``sd`` when the true mean is ``effect`` (noncentral t). NaN below 2 values or sd not > 0."""
    if n < 2 or not math.isfinite(sd) or sd <= 0 or not math.isfinite(effect):
        return math.nan
    crit = float(sps.t.ppf(1 - alpha, n - 1))
    return float(sps.nct.sf(crit, n - 1, effect / (sd / math.sqrt(n))))


def mde_one_sided(n: int, sd: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest true mean the one-sided t-test over ``n`` values of SD ``sd`` detects with ``power``."""
    if n < 2 or not math.isfinite(sd) or sd <= 0:
        return math.nan
    hi = sd
    while power_one_sided(hi, sd, n, alpha) < power:
        hi *= 2
    return float(optimize.brentq(lambda e: power_one_sided(e, sd, n, alpha) - power, 1e-12 * sd, hi))


def n_one_sided(effect: float, sd: float, alpha: float = 0.05, power: float = 0.8, n_max: int = 100_000) -> float:
    """Smallest n whose one-sided t-test detects ``effect`` with ``power`` (NaN for effect <= 0 or no sd)."""
    if not (math.isfinite(effect) and effect > 0 and math.isfinite(sd) and sd > 0):
        return math.nan
    n = 2
    while power_one_sided(effect, sd, n, alpha) < power:
        n += 1
        if n > n_max:
            return math.inf
    return n


def gate_family(results: dict[str, dict | None], alpha: float = 0.05) -> dict[str, dict]:
    """Holm across the candidates: ``results`` maps every candidate of the family to its :func:`gate` result, or
    None when its gate was not run (ruled out on its hard runs: p = 1, it still counts in the family). Adds
    ``p_holm`` and ``passes`` (Holm rejects mean <= 0 at family ``alpha``) to each."""
    names = list(results)
    p = [results[k]["p"] if results[k] is not None and math.isfinite(results[k]["p"]) else 1.0 for k in names]
    adjusted = holm(p)
    out = {}
    for k, pa in zip(names, adjusted):
        base = dict(results[k]) if results[k] is not None else {"runs": 0, "states": 0}
        out[k] = {**base, "p_holm": float(pa), "passes": bool(pa < alpha and results[k] is not None)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.mechanism", description=__doc__.split("\n\n")[0])
    p.add_argument("file", nargs="+", help="JSON-lines files of python -m experiments.mechanism --out (read as one)")
    p.add_argument("--gate", metavar="RULE", help="print the gate statistic of RULE - hard (training split)")
    p.add_argument("--split", choices=list(SPLITS), default="train", help="the gate's score (default train)")
    a = p.parse_args(argv)
    try:
        states = [s for f in a.file for s in load_states(f)]
        if not states:
            raise ValueError(f"{', '.join(a.file)}: no states")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    labels = list(states[0]["after"])
    runs = len(set(_runs(states)))
    if a.gate:
        if a.gate not in labels:
            print(f"error: --gate {a.gate!r}: allowed: {', '.join(x for x in labels if x != 'hard')}", file=sys.stderr)
            return 2
        print(json.dumps(gate(states, a.gate, split=a.split), indent=1))
        return 0
    print(f"Paired mechanism test: {len(states)} states of {runs} hard baseline run(s) ({', '.join(a.file)})\n")
    logprob = any("probe_set" in h for f in a.file for h in load_headers(f))  # experiments.mechanism.trl's files
    print(table(summarize(states, labels), *((1e3, LOGPROB) if logprob else ())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
