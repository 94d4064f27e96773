"""Sample size of a paired design: the power of a paired t-test, pairs for an effect, the smallest detectable effect.

A contrast of two arms is decided by the two-sided paired t-test over pairs (runs of one seed on one warm start).
With paired differences of standard deviation ``sd`` and a true mean difference ``effect``, the test at level alpha
over n pairs has power ``P(|T| > t_{1-alpha/2, n-1})`` with T noncentral t (df n - 1, noncentrality effect / sd *
sqrt(n)). With m planned contrasts under Holm, the contrast is sized at alpha / m, Holm's first step, which is the
level each contrast meets in the worst case (so the power is at least the target).

    python -m analysis.power                              # the planning table (SD 0.028 etc., m = 1 and 3)
    python -m analysis.power n --sd 0.028 --effect 0.01 --contrasts 3
    python -m analysis.power mde --sd 0.028 --pairs 128 --contrasts 3
    python -m analysis.power regime results/runs/regime_a2 --stage a2   # = python -m analysis.regime (the readouts)
"""

from __future__ import annotations

import argparse
import sys

from analysis.stats import mde, n_paired, power_paired

__all__ = ["mde", "n_paired", "plan_table", "power_paired"]


PLAN_SDS = {
    "late_pass1 (steps 200-400)": 0.028,
    "final pass@1": 0.05,
    "eval AUC": 0.0225,
    "training-reward AUC": 0.015,
}
"""Paired seed SDs of the tiny grid's metrics (issue 12); the table's rows."""


def plan_table(effects=(0.01, 0.02), contrasts=(1, 3), alpha: float = 0.05, power: float = 0.8) -> str:
    """Markdown table: pairs per arm for each metric SD, smallest effect and number of Holm contrasts."""
    cols = [(e, m) for e in effects for m in contrasts]
    head = "| metric (paired SD) | " + " | ".join(f"effect {e:g}, m={m}" for e, m in cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    for name, sd in PLAN_SDS.items():
        cells = [str(n_paired(sd, e, alpha, power, m)) for e, m in cols]
        lines.append(f"| {name} ({sd:g}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["regime"]:  # the evidence plan's readouts live in analysis.regime; this spelling stays valid
        from analysis import regime

        return regime.main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m analysis.power", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    t = sub.add_parser("table", help="the planning table (default)")
    t.add_argument("--alpha", type=float, default=0.05)
    t.add_argument("--power", type=float, default=0.8)
    n = sub.add_parser("n", help="pairs per arm for one design")
    m = sub.add_parser("mde", help="smallest detectable effect for a number of pairs")
    for q in (n, m):
        q.add_argument("--sd", type=float, required=True, help="SD of the paired differences")
        q.add_argument("--alpha", type=float, default=0.05)
        q.add_argument("--power", type=float, default=0.8)
        q.add_argument("--contrasts", type=int, default=1, help="Holm family size m (sized at alpha / m)")
    n.add_argument("--effect", type=float, required=True, help="smallest effect of interest")
    m.add_argument("--pairs", type=int, required=True)
    sub.add_parser("regime", help="the evidence plan's readout: python -m analysis.regime --help")
    a = p.parse_args(argv)
    try:
        if a.cmd in (None, "table"):
            alpha, power = (a.alpha, a.power) if a.cmd else (0.05, 0.8)
            print(
                f"Pairs per arm, paired two-sided t-test, power {power:g}, family alpha {alpha:g} "
                "(m contrasts: alpha / m, Holm's first step)\n"
            )
            print(plan_table(alpha=alpha, power=power))
        elif a.cmd == "n":
            print(n_paired(a.sd, a.effect, a.alpha, a.power, a.contrasts))
        else:
            print(f"{mde(a.pairs, a.sd, a.alpha, a.power, a.contrasts):.5f}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
