"""Numbers the README quotes about the committed grid that are not a claim: run counts, the distinct clipped tokens
behind the theory figure, the judge/executor collapse check, spikes, and the paired spread of final vs late pass@1.

    python -m analysis.readings [--runs results/runs]
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np

from analysis.load import RUNS_ROOT, RunWarning, load_runs
from analysis.summary import summarize


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.readings", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=str(RUNS_ROOT))
    a = p.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        rs = load_runs(a.runs)
        s = summarize(rs)
    inc = rs.included
    print(f"folders {len(rs.runs)}, distinct runs {inc['run'].nunique()}, (sweep, run) memberships {len(s)}")
    bins = rs.ratio_bins(set(inc.loc[inc["loss.rule"] == "nsr", "run"]))
    print(
        f"clipped tokens logged by distinct nsr runs: {int(bins['clipped'].sum()):,} "
        f"({bins['run'].nunique()} runs); rescued {int(bins['rescued'].sum()):,}"
    )
    je = s[(s["sweep"] == "judge_executor") & (s["arm"] == "noisy_decision")]
    print(
        f"judge_executor noisy_decision: min final_reward {je['final_reward'].min():.3f}, "
        f"max entropy_spike {je['entropy_spike'].max():.3f}"
    )
    print(
        f"runs with any entropy spike: {int((s.drop_duplicates('run')['entropy_spike'] > 0).sum())} of "
        f"{s['run'].nunique()}: {', '.join(s.loc[s['entropy_spike'] > 0, 'run'].unique())}"
    )
    for m in ("pass@1", "late_pass@1"):
        sds = []
        for sw in ("delta", "rescue_vs_decay"):
            g = s[s["sweep"] == sw]
            hard = g[g["arm"] == "hard"].set_index("seed")[m]
            for _, gg in g[g["arm"] != "hard"].groupby("label"):
                d = (gg.set_index("seed")[m] - hard).dropna()
                if len(d) >= 3:
                    sds.append(d.std(ddof=1))
        print(
            f"{m}: median paired SD vs hard over {len(sds)} labels of delta and rescue_vs_decay: {np.median(sds):.4f}"
        )
    h = s[(s["sweep"] == "delta") & (s["arm"] == "hard")].set_index("seed")["pass@1"]
    print("hard pass@1 by seed (delta):", ", ".join(f"s{k}: {v:.3f}" for k, v in h.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
