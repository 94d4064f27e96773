"""Does a run have near-boundary signal for NSR? The premise meter (nsr.premise) read from a run's logs.

    python -m analysis.premise RUN [RUN ...] [--eps-low X --eps-high Y --delta D] [--json]

NSR can only act on clipped tokens whose ratio lies within its rescue zone (docs/method.md): for A > 0 the ratios
c < r < c / (1 - delta), c = 1 + eps_high; for A < 0 b / (1 + delta) < r < b, b = 1 - eps_low. For each input this
prints, per advantage side, at 3 significant figures:

* **clipped**: the tokens the trust region clipped; **in zone**: those of them within the rescue zone (counts);
* **reach**: in zone / clipped (the premise meter's depth bins 0-9 over all 11);
* **in-zone clipped per token**, of all valid tokens and of the tokens with a nonzero advantage (those an update
  moves): exact where the log holds the token counts; otherwise an estimate, said on the line (below);
* the **zone's edges** as ratios at the run's eps and delta;

then the in-zone clipped mass of both sides per token (what stage R0's zone-mass criterion reads), and one line saying
what the numbers mean against stage R0's pre-registered thresholds (analysis/regime.yaml ``stage_r0``; the stage and
its result: docs/evidence.md). ``--json`` prints the readings as a JSON list instead.

Inputs (detected from the path):

* a run folder of the kit (tiny, trl or openrlhf backend, token level; its config.yaml gives eps and delta):
  ratio_bins.jsonl(.gz), summed over all steps. Rows with ``tokens`` / ``tokens_adv`` (written since the meter counts
  them) give exact rates. Older rows have none: the rate per token is then the side's mean clip fraction (metrics.jsonl
  ``clip_frac_high`` for A > 0, ``clip_frac_low`` for A < 0) times its reach, as stage R0 registered it, and the rate
  per token with a nonzero advantage that rate over the run's mean ``mixed_group_frac`` (the tokens of groups whose
  rewards all tie have A = 0), both labelled as such;
* an OpenRLHF TensorBoard folder (``--logger.tensorboard_dir``, or the event folder): the launcher's
  ``train/nsr_premise_*`` scalars (counts and token totals; experiments/openrlhf/tensorboard.py);
* a TRL ``trainer_state.json`` (or the checkpoint folder holding it): NSRGRPOTrainer's ``premise/<rate>`` logs with
  ``premise/tokens`` and ``premise/tokens_adv`` (counts = rate x tokens, per logging window);
* a verl metrics log (verl's file logger, ``trainer.logger=[console,file]``: one ``{"step", "data"}`` JSON object a
  line; ``--verl LOG`` also names one): the ``nsr:<rule>`` loss modes' ``actor/premise/*``. verl averages each metric
  over a step's micro-batches, so the rates come from the mean counts ``actor/premise/n_*`` (the mean count over the
  mean token count is the step's pooled rate) and the counts shown are those means summed over the steps (per
  micro-batch, said on the line); a log of the rates only reads as the mean of the steps' rates, with no counts.

Framework logs hold no trust region: give the run's ``--eps-low``, ``--eps-high`` and ``--delta`` with them.

Exit status 2 (nothing printed) when an input is missing, has no premise meter, or lacks what it needs.
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
"""The verl plug-in's metric names: ``actor/premise/<key>`` (nsr.premise.RATE_KEYS) and ``actor/premise/n_<key>``."""
TRL_PREFIX = "premise/"
"""NSRGRPOTrainer's log names: ``premise/<key>`` (nsr.premise.RATE_KEYS), ``premise/tokens``, ``premise/tokens_adv``."""
CLIP_FRAC = {"pos": "clip_frac_high", "neg": "clip_frac_low"}
"""metrics.jsonl clip fraction of each side."""
SIDE_NAME = {"pos": "A>0", "neg": "A<0"}
REACH_FLOOR = 100
"""stage_r0.criteria.reach: a side with fewer clipped tokens in all is too few to measure (analysis/regime.py)."""
THRESHOLDS_SOURCE = "stage R0's pre-registered thresholds (analysis/regime.yaml stage_r0; docs/evidence.md)"


class PremiseError(ValueError):
    """An input the reading cannot use (missing, not a run folder, no premise meter, no trust region)."""


def thresholds() -> dict:
    """Stage R0's thresholds, as registered: reach (min share per side), zone mass (min in-zone clipped per token,
    both sides), and the floor of clipped tokens below which a side's reach is not read."""
    import yaml  # analysis.regime reads this file too (and this module): read it here, not through it

    crit = yaml.safe_load((Path(__file__).parent / "regime.yaml").read_text())["stage_r0"]["criteria"]
    return {"reach": float(crit["reach"]["min_share"]), "zone_mass": float(crit["zone_mass"]["min"]),
            "floor": REACH_FLOOR}  # fmt: skip


def _edges(eps_low: float, eps_high: float, delta: float) -> dict:
    """The rescue zone of each side as ratios: {side: [from, to]} (A > 0: c .. c / (1 - delta); A < 0: b / (1 + delta)
    .. b), nsr.theory.rescue_zone at the run's trust region and delta."""
    from nsr import LossConfig
    from nsr.theory import rescue_zone

    cfg = LossConfig(eps_low=eps_low, eps_high=eps_high, delta=delta)
    pos, neg = rescue_zone(1, cfg), rescue_zone(-1, cfg)
    return {"pos": [pos[0], pos[1]], "neg": [neg[1], neg[0]]}


def _finish(out: dict, eps: tuple | None, delta: float | None) -> dict:
    """Add the zone's edges, reach per side and the combined in-zone mass to a reading with counts / rates."""
    out["eps_low"], out["eps_high"] = (eps or (None, None))[:2]
    out["delta"] = delta
    edges = _edges(eps[0], eps[1], delta) if eps and delta is not None else {"pos": None, "neg": None}
    for side in SIDES:
        out[f"{side}_zone_edges"] = edges[side]
    out["zone_per_token"] = out["pos_zone_per_token"] + out["neg_zone_per_token"]
    out["zone_per_adv_token"] = (
        None
        if out["pos_zone_per_adv_token"] is None or out["neg_zone_per_adv_token"] is None
        else out["pos_zone_per_adv_token"] + out["neg_zone_per_adv_token"]
    )
    return out


def _from_bins(out: dict, bins: list[dict], metrics: list[dict]) -> dict:
    """Counts and rates of ratio_bins rows (kit run folders, OpenRLHF's event files)."""
    exact = all(r.get("tokens") for r in bins)
    exact_adv = exact and all(r.get("tokens_adv") is not None for r in bins)
    tokens = float(sum(r["tokens"] for r in bins)) if exact else None
    tokens_adv = float(sum(r["tokens_adv"] for r in bins)) if exact_adv else None
    mixed = [r["mixed_group_frac"] for r in metrics if r.get("mixed_group_frac") is not None]
    out["tokens"], out["tokens_adv"] = tokens, tokens_adv
    out["per_token"] = "exact" if exact else "estimate: mean clip fraction x reach (metrics.jsonl; rows without tokens)"
    if exact_adv:
        out["per_adv_token"] = "exact"
    elif mixed:
        out["per_adv_token"] = f"approximation: per token / mean mixed_group_frac {np.mean(mixed):.3g}"
    else:
        out["per_adv_token"] = "not logged (no tokens_adv, no mixed_group_frac)"
    for side in SIDES:
        clipped = np.sum([r[f"{side}_clipped"] for r in bins], axis=0, dtype=np.float64)
        zone, deep = float(clipped[:N_BINS].sum()), float(clipped[N_BINS])
        share = reach(zone, deep)
        frac = [r[CLIP_FRAC[side]] for r in metrics if r.get(CLIP_FRAC[side]) is not None]
        out[f"{side}_clipped"] = int(clipped.sum())
        out[f"{side}_zone"] = int(zone)
        out[f"{side}_reach"] = share
        if exact:
            out[f"{side}_clipped_per_token"] = (zone + deep) / tokens
            out[f"{side}_zone_per_token"] = zone / tokens
        else:  # stage R0's registered estimate (analysis/regime.py reads this key)
            per_token = float(np.mean(frac)) if frac else math.nan
            out[f"{side}_clipped_per_token"] = per_token
            out[f"{side}_zone_per_token"] = 0.0 if clipped.sum() == 0 and per_token == 0 else per_token * share
        if exact_adv:
            out[f"{side}_zone_per_adv_token"] = zone / tokens_adv if tokens_adv else math.nan
        elif mixed:
            out[f"{side}_zone_per_adv_token"] = out[f"{side}_zone_per_token"] / float(np.mean(mixed))
        else:
            out[f"{side}_zone_per_adv_token"] = None
    return out


def read_run(path: str | Path) -> dict:
    """The premise reading of one kit run folder: {source, backend, rule, eps_low, eps_high, delta, steps, tokens,
    and per side (pos, neg): clipped, zone (counts), reach, clipped_per_token, zone_per_token, zone_per_adv_token,
    zone_edges; per_token / per_adv_token say how the rates were obtained}."""
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
    from nsr import LossConfig

    full = LossConfig(**{k: loss[k] for k in ("rule", "level", "eps_low", "eps_high") if k in loss})
    out = {"source": str(rd.path), "kind": "run folder", "backend": cfg.get("backend"), "rule": loss.get("rule"),
           "steps": len(bins)}  # fmt: skip
    return _finish(_from_bins(out, bins, metrics), (full.eps_low, full.eps_high), deltas[0])


def read_tensorboard(path: str | Path, eps: tuple, delta: float) -> dict:
    """The premise reading of an OpenRLHF TensorBoard folder (the launcher's ``train/nsr_premise_*`` scalars)."""
    from experiments.openrlhf.tensorboard import ratio_bins_from_tensorboard
    from nsr import LossConfig

    loss = LossConfig(rule="hard", eps_low=eps[0], eps_high=eps[1], delta=delta)
    bins = ratio_bins_from_tensorboard(path, loss)
    if not bins:
        raise PremiseError(
            f"{path}: no step logged train/nsr_premise_*; they come from python -m nsr.openrlhf.launch at token level"
        )
    out = {"source": str(path), "kind": "OpenRLHF TensorBoard", "backend": "openrlhf", "rule": None, "steps": len(bins)}
    return _finish(_from_bins(out, bins, []), eps, delta)


def _from_rate_logs(out: dict, logs: list[dict], rate: str, count: str | None, tokens: str, tokens_adv: str) -> dict:
    """Counts and rates of per-window logs holding rates (``rate % key``) and either token totals (TRL: counts =
    rate x tokens) or mean counts (verl: ``count % key``)."""
    if count is not None and all(count % k in d for d in logs for k in ("tokens", "pos_clipped_zone")):
        n = {k: [float(d[count % k]) for d in logs] for k in ("tokens", "tokens_adv", *_COUNTED)}
        scope = "per micro-batch (verl logs each step's mean over its micro-batches), summed over steps"
        how = (
            "pooled: summed mean counts over summed mean tokens (exact when the steps hold equally many micro-batches)"
        )
    elif count is None and all(tokens in d for d in logs):
        n = {"tokens": [float(d[tokens]) for d in logs]}
        n["tokens_adv"] = [float(d.get(tokens_adv, math.nan)) for d in logs]
        for k in _COUNTED:
            n[k] = [float(d[rate % k]) * t for d, t in zip(logs, n["tokens"])]
        scope = "summed over the logging windows (rate x tokens)"
        how = "exact"
    else:
        n = None
    if n is not None:
        t, ta = sum(n["tokens"]), sum(n["tokens_adv"])
        out.update(tokens=t, tokens_adv=None if math.isnan(ta) else ta, per_token=how, counts=scope)
        out["per_adv_token"] = how if not math.isnan(ta) else "not logged"
        for side in SIDES:
            zone, deep = sum(n[f"{side}_clipped_zone"]), sum(n[f"{side}_clipped_deep"])
            out[f"{side}_clipped"], out[f"{side}_zone"] = round(zone + deep), round(zone)
            out[f"{side}_reach"] = reach(zone, deep)
            out[f"{side}_clipped_per_token"], out[f"{side}_zone_per_token"] = (zone + deep) / t, zone / t
            out[f"{side}_zone_per_adv_token"] = zone / ta if not math.isnan(ta) and ta else None
        return out
    mean = {k: float(np.mean([float(d[rate % k]) for d in logs])) for k in RATE_KEYS}
    out.update(tokens=None, tokens_adv=None, per_token="mean of the logged rates (no counts logged)")
    out["per_adv_token"] = "not logged"
    for side in SIDES:
        zone, deep = mean[f"{side}_clipped_zone"], mean[f"{side}_clipped_deep"]
        out[f"{side}_clipped"] = out[f"{side}_zone"] = None
        out[f"{side}_reach"] = reach(zone, deep)
        out[f"{side}_clipped_per_token"], out[f"{side}_zone_per_token"] = zone + deep, zone
        out[f"{side}_zone_per_adv_token"] = None
    return out


_COUNTED = ("pos_clipped_zone", "pos_clipped_deep", "neg_clipped_zone", "neg_clipped_deep")


def read_trl(path: str | Path, eps: tuple, delta: float) -> dict:
    """The premise reading of a TRL ``trainer_state.json`` (or a checkpoint folder holding one): NSRGRPOTrainer's
    ``premise/*`` logs in its ``log_history``."""
    path = Path(path)
    file = path / "trainer_state.json" if path.is_dir() else path
    if not file.is_file():
        raise PremiseError(f"{path}: no such TRL trainer_state.json")
    try:
        history = json.loads(file.read_text()).get("log_history", [])
    except (json.JSONDecodeError, AttributeError):
        raise PremiseError(f"{file}: not a TRL trainer_state.json (JSON with log_history)") from None
    logs = [h for h in history if all(TRL_PREFIX + k in h for k in RATE_KEYS)]
    if not logs:
        raise PremiseError(
            f"{file}: no log holds the premise/* rates; they come from nsr.trl.NSRGRPOTrainer at token level "
            "(premise=True, the default)"
        )
    out = {"source": str(file), "kind": "TRL trainer_state.json", "backend": "trl", "rule": None, "steps": len(logs)}
    out = _from_rate_logs(out, logs, TRL_PREFIX + "%s", None, TRL_PREFIX + "tokens", TRL_PREFIX + "tokens_adv")
    return _finish(out, eps, delta)


def read_verl(path: str | Path, eps: tuple | None = None, delta: float | None = None) -> dict:
    """The premise reading of one verl file-logger log (one JSON object per line, ``{"step", "data"}``)."""
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
            steps.append(data)
    if not steps:
        raise PremiseError(
            f"{path}: no step logged the {VERL_PREFIX}* metrics; they come from an nsr:<rule> loss mode at token level "
            "with policy_loss.premise (default on), logged by verl's file logger (trainer.logger=[console,file])"
        )
    out = {"source": str(path), "kind": "verl metrics log", "backend": "verl", "rule": None, "steps": len(steps)}
    out = _from_rate_logs(out, steps, VERL_PREFIX + "%s", VERL_PREFIX + "n_%s", "", "")
    return _finish(out, eps, delta)


def read(path: str | Path, eps: tuple | None = None, delta: float | None = None) -> dict:
    """The reading of ``path``, whichever kind it is (module docstring); ``eps`` (eps_low, eps_high) and ``delta``
    are needed for the framework logs, which hold no trust region."""
    p = Path(path)
    if p.is_dir() and (p / "config.yaml").exists():
        return read_run(p)
    framework = (
        "TRL" if p.name == "trainer_state.json" or (p / "trainer_state.json").is_file()
        else "OpenRLHF" if p.is_dir() and any(p.rglob("events.out.tfevents.*"))
        else "verl" if p.is_file() else None
    )  # fmt: skip
    if framework is None:
        return read_run(p)  # its error: no such run folder / not a run folder
    if eps is None or delta is None:
        raise PremiseError(
            f"{p}: a {framework} log holds no trust region; give the run's --eps-low, --eps-high and --delta"
        )
    return {"TRL": read_trl, "OpenRLHF": read_tensorboard, "verl": read_verl}[framework](p, eps, delta)


def _g(v) -> str:
    """3 significant figures; '-' for a missing value."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3g}"
    return str(v)


def verdict(r: dict, t: dict | None = None) -> str:
    """One line: what the reading means against stage R0's thresholds, each with its value."""
    t = t or thresholds()
    parts = []
    for side in SIDES:
        n = "" if r[f"{side}_clipped"] is None else f", {r[f'{side}_clipped']} clipped"
        parts.append(f"reach {_g(r[f'{side}_reach'])} ({SIDE_NAME[side]}{n})")
    line = f"{' and '.join(parts)} against {_g(t['reach'])}; in-zone clipped {_g(r['zone_per_token'])} per token "
    line += f"against {_g(t['zone_mass'])}"
    few = [SIDE_NAME[s] for s in SIDES if r[f"{s}_clipped"] is not None and r[f"{s}_clipped"] < t["floor"]]
    if few:
        return f"{line}: too few clipped tokens to read reach on {', '.join(few)} (< {t['floor']})"
    short = [f"reach {SIDE_NAME[s]}" for s in SIDES if not r[f"{s}_reach"] >= t["reach"]]
    if not r["zone_per_token"] >= t["zone_mass"]:
        short.append("in-zone mass")
    if short:
        return f"{line}: little near-boundary signal for NSR to act on (below on {', '.join(short)})"
    return f"{line}: enough near-boundary signal for NSR by these thresholds"


def report(readings: list[dict]) -> str:
    """The readings as text: per input a header, a table of the two sides, the combined mass and the reading."""
    t = thresholds()
    blocks = []
    for r in readings:
        eps = f"eps {_g(r['eps_low'])} / {_g(r['eps_high'])}, delta {_g(r['delta'])}"
        head = f"{r['source']} ({r['kind']}: backend {r['backend']}, rule {r['rule'] or '-'}, {eps}, {r['steps']} steps"
        head += f", {_g(r['tokens'])} tokens)" if r.get("tokens") is not None else ")"
        lines = [head, "| side | clipped | in zone | reach | zone edges (ratio) | in-zone clipped/token | "
                       "in-zone clipped/token with A != 0 |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for side in SIDES:
            e = r[f"{side}_zone_edges"]
            edges = "-" if e is None else f"{_g(e[0])} .. {_g(e[1])}"
            cells = [_g(r[f"{side}_{k}"]) for k in ("clipped", "zone", "reach")]
            cells += [edges, _g(r[f"{side}_zone_per_token"]), _g(r[f"{side}_zone_per_adv_token"])]
            lines.append(f"| {SIDE_NAME[side]} | " + " | ".join(cells) + " |")
        lines.append(f"per token: {r['per_token']}; with A != 0: {r['per_adv_token']}")
        if r.get("counts"):
            lines.append(f"counts: {r['counts']}")
        lines.append(
            f"in-zone clipped per token, both sides: {_g(r['zone_per_token'])} (with A != 0: "
            f"{_g(r['zone_per_adv_token'])}); stage R0's zone-mass criterion reads the first"
        )
        lines.append(f"reading: {verdict(r, t)}")
        blocks.append("\n".join(lines))
    legend = (
        f"Thresholds: {THRESHOLDS_SOURCE}: reach >= {_g(t['reach'])} on each side (a side with fewer than {t['floor']} "
        f"clipped tokens is too few to read) and in-zone clipped mass >= {_g(t['zone_mass'])} per token (about one "
        "in-zone clipped token per update of ~500 tokens). NSR changes nothing about a clipped token beyond its zone: "
        "below them, a run has little near-boundary signal for it to act on."
    )
    return "\n\n".join([*blocks, legend])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.premise", description=__doc__.split("\n\n")[0])
    what = "kit run folders, OpenRLHF TensorBoard folders, TRL trainer_state.json files, verl logs"
    p.add_argument("runs", nargs="*", metavar="RUN", help=what)
    p.add_argument("--verl", action="append", default=[], metavar="METRICS_LOG", help="a verl file-logger log")
    p.add_argument("--eps-low", type=float, help="the run's eps_low (framework logs hold none)")
    p.add_argument("--eps-high", type=float, help="the run's eps_high")
    p.add_argument("--delta", type=float, help="the run's delta (the one the premise meter binned at)")
    p.add_argument("--json", action="store_true", help="print the readings as a JSON list")
    a = p.parse_args(argv)
    if not a.runs and not a.verl:
        p.error("give at least one RUN or --verl METRICS_LOG")
    eps = (a.eps_low, a.eps_high) if a.eps_low is not None and a.eps_high is not None else None
    try:
        readings = [read(r, eps, a.delta) for r in a.runs]
        for v in a.verl:
            if eps is None or a.delta is None:
                raise PremiseError(f"{v}: a verl log holds no trust region; give the run's --eps-low, --eps-high and "
                                   "--delta")  # fmt: skip
            readings.append(read_verl(v, eps, a.delta))
    except PremiseError as e:
        print(f"python -m analysis.premise: {e}", file=sys.stderr)
        return 2
    if a.json:
        t = thresholds()
        print(json.dumps([{**r, "reading": verdict(r, t)} for r in readings], indent=1))
    else:
        print(report(readings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
