"""NSR's dose and the widening that matches it: the one definition of both (the evidence plan's readout and the
delta sweep's measurement use these functions).

* :func:`nsr_dose`: NSR's expected gradient weight summed over one side's clipped tokens (a depth histogram of
  ratio_bins.jsonl, each token at its bin's middle ratio, deeper violations weigh 0): the pre-registered dose of
  analysis/regime.yaml.
* :func:`unclipped`: the clipped tokens a widening of one side's bound by a width keeps (linear within a bin).
* :func:`dose_matched_width`: the width whose kept tokens equal the dose (per side; stage B's widen_dose).

The command measures the delta sweep's dose-matched widening: how far to widen the hard clip's region so that it
unclips as many tokens as NSR at delta 0.2 rescues, on the clipped tokens NSR runs logged.

    python -m analysis.dose [--runs results/runs] [--delta 0.2]

NSR's runs log, per step and side, the clipped tokens by depth into the rescue zone and how many were rescued.
Widening both bounds by w unclips the clipped tokens within w of the boundary (depth w / zone width; linear within
a depth bin). The dose-matched w is where that count equals NSR's rescued count. Each run is counted once.
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np
import torch

import nsr
from analysis.load import RUNS_ROOT, RunWarning, load_runs
from nsr.theory import depth_to_ratio, rescue_zone

SIDES = (("pos", 1), ("neg", -1))


def nsr_dose(counts: np.ndarray, sign: int, loss_cfg) -> float:
    """Expected NSR gradient weight summed over the clipped tokens of one side's depth histogram.

    Each token sits at the middle ratio of its bin; deeper violations (the last bin) weigh 0.
    """
    k = len(counts) - 1
    mids = torch.tensor([depth_to_ratio((b + 0.5) / k, sign, loss_cfg) for b in range(k)], dtype=torch.float64)
    w = nsr.expected_weight(mids, sign, loss_cfg.replace(rule="nsr")).numpy()
    return float((counts[:-1] * w).sum())


def dose_matched_width(counts: np.ndarray, sign: int, loss_cfg) -> tuple[float, float]:
    """(dose D, width w) of one side: widening that side by w keeps as many of the histogram's clipped tokens as
    NSR's expected weight D (counts uniform within a bin; depth d* where the cumulative count reaches D)."""
    dose = nsr_dose(counts, sign, loss_cfg)
    k = len(counts) - 1
    cum = np.concatenate([[0.0], np.cumsum(counts[:-1])])
    b = int(np.searchsorted(cum, dose, side="right")) - 1  # the bin in which the cumulative count reaches D
    b = min(max(b, 0), k - 1)
    frac = (dose - cum[b]) / counts[b] if counts[b] else 0.0
    d_star = (b + frac) / k
    r_star = depth_to_ratio(d_star, sign, loss_cfg)
    width = r_star - loss_cfg.high if sign > 0 else loss_cfg.low - r_star
    return dose, round(float(width), 3)


def unclipped(counts: np.ndarray, width: float, sign: int, cfg: nsr.LossConfig) -> float:
    """Clipped tokens of one side's depth histogram (``counts``: bins 0..n-1 over depth [0, 1), bin n deeper) that
    widening that side's bound by ``width`` (ratio units) keeps: depth <= width / (zone width), linear within a bin.
    :func:`dose_matched_width` is its inverse at the NSR dose."""
    n = len(counts) - 1
    b, e = rescue_zone(sign, cfg)
    depth = min(width / abs(e - b), 1.0)
    full = int(np.floor(depth * n))
    out = float(np.sum(counts[:full]))
    if full < n:
        out += (depth * n - full) * float(counts[full])
    return out


def measure(runs_root=RUNS_ROOT, delta: float = 0.2) -> dict:
    """{runs, clipped, rescued, rescue_frac, w, ratio_at_delta}: the measurement the sweep file states."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        rs = load_runs(runs_root)
    inc = rs.included
    cfg = nsr.LossConfig(rule="nsr", delta=delta)
    pick = (
        (inc["loss.rule"] == "nsr")
        & np.isclose(inc["loss.delta"].astype(float), delta)
        & (inc["loss.executor"] == cfg.executor)
        & np.isclose(inc["loss.eps_low"].astype(float), cfg.eps_low)
        & np.isclose(inc["loss.eps_high"].astype(float), cfg.eps_high)
        & (inc["loss.level"] == "token")
    )
    runs = set(inc.loc[pick, "run"])
    bins = rs.ratio_bins(runs)
    if not len(bins):
        raise SystemExit(f"no ratio_bins.jsonl of nsr delta={delta} runs under {runs_root}")
    g = bins.groupby(["side", "bin"])[["clipped", "rescued"]].sum()
    rescued, clipped = float(g["rescued"].sum()), float(g["clipped"].sum())
    hist = {sign: g.loc[side, "clipped"].sort_index().to_numpy(dtype=np.float64) for side, sign in SIDES}

    def both(w: float) -> float:  # one width for both sides, as the delta sweep's widened arms
        return sum(unclipped(hist[sign], w, sign, cfg) for sign in hist)

    ws = np.linspace(0, 1.0, 10001)
    u = np.array([both(w) for w in ws])
    steps = rs.steps[rs.steps["run"].isin(runs)]
    return {
        "runs": len(runs),
        "clipped": clipped,
        "rescued": rescued,
        "rescue_frac": float(steps["rescue_frac"].mean()),
        "w": float(np.interp(rescued, u, ws)),
        "ratio_at_delta": both(delta) / rescued,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.dose", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=str(RUNS_ROOT))
    p.add_argument("--delta", type=float, default=0.2)
    a = p.parse_args(argv)
    m = measure(a.runs, a.delta)
    print(
        f"{m['runs']} distinct nsr delta={a.delta:g} runs: {m['clipped']:,.0f} clipped tokens, {m['rescued']:,.0f} "
        f"rescued ({m['rescued'] / m['clipped']:.1%} of clipped; rescue_frac {m['rescue_frac']:.2%} of all tokens)"
    )
    print(
        f"widening by {a.delta:g} unclips {m['ratio_at_delta']:.1f}x as many (a lower bound: depths beyond NSR's "
        "zone are not resolved)"
    )
    print(f"dose-matched widening: w = {m['w']:.3f} (eps_low + w, eps_high + w) unclips as many as NSR rescues")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
