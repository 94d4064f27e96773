"""Does a run have near-boundary signal for NSR? The premise meter (nsr.premise) read from run folders and verl logs.

    python -m analysis.premise RUN_DIR [RUN_DIR ...] [--verl METRICS_LOG ...]

NSR can only act on clipped tokens whose ratio lies within its rescue zone (docs/method.md). For each input this
prints, per advantage side (A > 0: the ratio above 1 + eps_high; A < 0: below 1 - eps_low):

* **reach**: the share of the clipped tokens that lie within the rescue zone at the run's delta (the premise meter's
  depth bins 0-9 over all 11; analysis/regime.py's reach criterion);
* **in-zone clipped per token**: clipped tokens within the zone per valid token, the mass NSR can act on;
* **clipped per token**, for context.

Inputs:

* a run folder of the tiny, trl or openrlhf backend (token level): ratio_bins.jsonl(.gz) gives the depth histogram,
  summed over all steps; metrics.jsonl gives the clip fraction per side (``clip_frac_high`` for A > 0,
  ``clip_frac_low`` for A < 0: the mean over the run's updates of each update's share of valid tokens), and the
  in-zone clipped mass per token is that clip fraction times the side's reach (as analysis/regime.py's dose per
  token). For a rule whose clip fractions are the hard clip's (hard, nsr, soft, pushout, ...) this is the count
  of in-zone clipped tokens over the valid tokens, each update weighted equally.
* ``--verl LOG``: the JSON lines verl's file logger writes (``trainer.logger=[...,file]``; one
  ``{"step": n, "data": {...}}`` per training step) of a run with an ``nsr:<rule>`` loss mode at token level: its
  ``actor/premise/*`` per-token rates (nsr/verl/plugin.py), averaged over the logged steps; reach is the mean
  in-zone rate over the mean in-zone plus deeper rate.

Exit status 2 (nothing printed) when an input is missing or has no premise meter.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from experiments.rundir import RunDir, read_rows
from nsr.premise import N_BINS, RATE_KEYS, SIDES, reach

VERL_PREFIX = "actor/premise/"
"""The verl plug-in's metric names: ``actor/premise/<key>``, key in nsr.premise.RATE_KEYS."""
CLIP_FRAC = {"pos": "clip_frac_high", "neg": "clip_frac_low"}
"""metrics.jsonl clip fraction of each side."""


class PremiseError(ValueError):
    """An input the reading cannot use (missing, not a run folder, no premise meter)."""


def read_run(path: str | Path) -> dict:
    """The premise reading of one run folder: {source, backend, rule, delta, steps, and per side (pos, neg):
    clipped (count), reach, clipped_per_token, zone_per_token}."""
    rd = RunDir(path)
    if not rd.path.is_dir():
        raise PremiseError(f"{rd.path}: no such run folder")
    cfg = rd.read_config()
    if cfg is None:
        raise PremiseError(f"{rd.path}: not a run folder (no config.yaml)")
    bins_path = rd.log_path("ratio_bins.jsonl")
    if not bins_path.exists():
        raise PremiseError(
            f"{rd.path}: no ratio_bins.jsonl; the premise meter is written at token level by the tiny, trl and "
            "openrlhf backends (a sequence-level run, or one written before the meter, has none)"
        )
    bins, _ = read_rows(bins_path)
    metrics, _ = read_rows(rd.metrics_path) if rd.metrics_path.exists() else ([], [])
    if not bins:
        raise PremiseError(f"{bins_path}: no rows")
    deltas = sorted({r["delta"] for r in bins})
    if len(deltas) != 1:
        raise PremiseError(f"{bins_path}: rows of several deltas {deltas}; allowed: one run's rows")
    loss = cfg.get("loss", {})
    out = {
        "source": str(rd.path),
        "backend": cfg.get("backend"),
        "rule": loss.get("rule"),
        "delta": deltas[0],
        "steps": len(bins),
    }
    for side in SIDES:
        clipped = np.sum([r[f"{side}_clipped"] for r in bins], axis=0, dtype=np.float64)
        frac = [r[CLIP_FRAC[side]] for r in metrics if r.get(CLIP_FRAC[side]) is not None]
        share = reach(float(clipped[:N_BINS].sum()), float(clipped[N_BINS]))
        per_token = float(np.mean(frac)) if frac else math.nan
        out[f"{side}_clipped"] = int(clipped.sum())
        out[f"{side}_reach"] = share
        out[f"{side}_clipped_per_token"] = per_token
        out[f"{side}_zone_per_token"] = 0.0 if clipped.sum() == 0 and per_token == 0 else per_token * share
    return out


def read_verl(path: str | Path) -> dict:
    """The premise reading of one verl file-logger log (one JSON object per line, ``{"step", "data"}``): the
    ``actor/premise/*`` rates averaged over the steps that logged them."""
    path = Path(path)
    if not path.is_file():
        raise PremiseError(f"{path}: no such verl metrics log")
    steps = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise PremiseError(f"{path}:{n}: not a JSON line (verl's file logger writes one per step)") from None
        data = rec.get("data") if isinstance(rec, dict) else None
        if isinstance(data, dict) and all(VERL_PREFIX + k in data for k in RATE_KEYS):
            steps.append({k: float(data[VERL_PREFIX + k]) for k in RATE_KEYS})
    if not steps:
        raise PremiseError(
            f"{path}: no step logged the {VERL_PREFIX}* metrics; they come from an nsr:<rule> loss mode at token level "
            "with policy_loss.premise (default on), logged by verl's file logger (trainer.logger=[console,file])"
        )
    mean = {k: float(np.mean([s[k] for s in steps])) for k in RATE_KEYS}
    out = {"source": str(path), "backend": "verl", "rule": None, "delta": None, "steps": len(steps)}
    for side in SIDES:
        zone, deep = mean[f"{side}_clipped_zone"], mean[f"{side}_clipped_deep"]
        out[f"{side}_clipped"] = None
        out[f"{side}_reach"] = reach(zone, deep)
        out[f"{side}_clipped_per_token"] = zone + deep
        out[f"{side}_zone_per_token"] = zone
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4f}"
    return str(v)


def table(readings: list[dict]) -> str:
    """The readings as a markdown table, one row per input."""
    cols = [
        ("source", "source"), ("backend", "backend"), ("rule", "rule"), ("delta", "delta"), ("steps", "steps"),
        ("reach A>0", "pos_reach"), ("reach A<0", "neg_reach"),
        ("in-zone clipped/token A>0", "pos_zone_per_token"), ("in-zone clipped/token A<0", "neg_zone_per_token"),
        ("clipped/token A>0", "pos_clipped_per_token"), ("clipped/token A<0", "neg_clipped_per_token"),
    ]  # fmt: skip
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in readings:
        lines.append("| " + " | ".join(_fmt(r[k]) for _, k in cols) + " |")
    return "\n".join(lines)


LEGEND = (
    "reach: share of the clipped tokens within NSR's rescue zone at delta (depth bins 0-9 of 11). in-zone "
    "clipped/token: those tokens per valid token (run folders: the side's clip fraction from metrics.jsonl x reach; "
    "verl: the mean actor/premise/<side>_clipped_zone rate). NSR acts only on in-zone clipped tokens: where both are "
    "small, the run has little near-boundary signal for it."
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.premise", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run folders (tiny, trl, openrlhf backends)")
    p.add_argument("--verl", action="append", default=[], metavar="METRICS_LOG", help="a verl file-logger log")
    a = p.parse_args(argv)
    if not a.runs and not a.verl:
        p.error("give at least one RUN_DIR or --verl METRICS_LOG")
    try:
        readings = [read_run(r) for r in a.runs] + [read_verl(v) for v in a.verl]
    except PremiseError as e:
        print(f"python -m analysis.premise: {e}", file=sys.stderr)
        return 2
    print(table(readings))
    print()
    print(LEGEND)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
