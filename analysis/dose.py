"""The dose-matched widening of sweeps/delta.yaml: how far to widen the hard clip's region so that it unclips as
many tokens as NSR at delta 0.2 rescues, measured on the clipped tokens NSR runs logged (ratio_bins.jsonl).

    python -m analysis.dose [--runs results/runs] [--delta 0.2]

NSR's runs log, per step and side, the clipped tokens by depth into the rescue zone and how many were rescued.
Widening both bounds by w unclips the clipped tokens within w of the boundary (depth w / zone width; linear within
a depth bin). The dose-matched w is where that count equals NSR's rescued count. Each run is counted once.
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np

import nsr
from analysis.load import RUNS_ROOT, RunWarning, load_runs
from nsr.theory import rescue_zone


def unclipped(g, w: float, cfg: nsr.LossConfig) -> float:
    """Clipped tokens (``g``: clipped per (side, bin)) that widening both bounds by ``w`` unclips."""
    out = 0.0
    for side, sign in (("pos", 1), ("neg", -1)):
        h = g.loc[side]
        n = int(h.index.max())  # bins 0..n-1 over depth [0, 1); bin n holds the deeper tokens
        b, e = rescue_zone(sign, cfg)
        depth = min(w / abs(e - b), 1.0)
        full = int(np.floor(depth * n))
        out += float(h.loc[: full - 1, "clipped"].sum()) if full else 0.0
        if full < n:
            out += (depth * n - full) * float(h.loc[full, "clipped"])
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
    ws = np.linspace(0, 1.0, 10001)
    u = np.array([unclipped(g, w, cfg) for w in ws])
    steps = rs.steps[rs.steps["run"].isin(runs)]
    return {
        "runs": len(runs),
        "clipped": clipped,
        "rescued": rescued,
        "rescue_frac": float(steps["rescue_frac"].mean()),
        "w": float(np.interp(rescued, u, ws)),
        "ratio_at_delta": unclipped(g, delta, cfg) / rescued,
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
