"""Print the verl hydra overrides of a RunConfig's loss (a preset or a sweep's grid points), to append to a verl recipe.

    python -m experiments.verl_overrides sweeps/presets/qwen2.5-math-7b-dapo.yaml loss.rule=nsr loss.delta=0.1
    python -m experiments.verl_overrides --sweep sweeps/delta.yaml   # one line per grid point: run_id, then overrides

Only the loss section travels (rule, trust region, dual clip, the rule's parameters) and the seed of its draws; the
recipe keeps its own model, data, batch sizes and schedule. This is the repo's harness around the plug-in (it reads
RunConfigs and sweep files); a verl user needs only ``nsr.verl`` itself.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from experiments.config import ConfigError, load_config
from experiments.sweep import expand


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.verl_overrides", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("config", nargs="?", help="a RunConfig YAML (e.g. sweeps/presets/qwen2.5-math-7b-dapo.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. loss.rule=nsr")
    p.add_argument("--sweep", help="a sweep file: one line per run")
    p.add_argument("--preset", help="with --sweep: replace the sweep's preset")
    args = p.parse_intermixed_args(argv)  # key=value overrides before or after the options

    from nsr.verl import recipe_overrides  # imports verl: only when run

    try:
        if args.sweep:
            runs = [(s.run_id, s.config) for s in expand(args.sweep, preset=args.preset)]
        elif args.config:
            runs = [(None, load_config(args.config, args.overrides))]
        else:
            p.error("give a config file or --sweep SWEEP")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for run_id, cfg in runs:
        line = " ".join(shlex.quote(o) for o in recipe_overrides(cfg.loss, seed=cfg.seed))
        print(f"{run_id}\t{line}" if run_id else line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
