"""The evidence plan's readouts (docs/evidence.md): stage A and stage A2 of analysis/regime.yaml, from run folders.

    python -m analysis.regime results/runs/regime_search               # stage A: criteria, spread, n, dose widening
    python -m analysis.regime results/runs/regime_a2 --stage a2        # stage A2: the same and the gate
    (python -m analysis.power regime ... is the same command)

The criteria, the planning constants, the selection rule and the dose-matched widening are those of
analysis/regime.yaml, read at run time; this module only computes them. make_all builds the same readout from the
runs it has already loaded (:func:`stats_from_runset`), so each run folder is read once. (analysis/regime.yaml,
written when this readout was part of analysis/power.py, names that module; the dose functions are analysis.dose.)
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from analysis.dose import dose_matched_width
from analysis.stats import mde, n_paired
from analysis.summary import WARM_START, in_late_window, pairs

REGIME_FILE = Path(__file__).resolve().parent / "regime.yaml"


HARD_ONLY_CRITERIA = ("reach", "clip", "not_saturated", "grad_clip_rare")
"""The stage-A criteria that read the hard runs only; only these may rule a candidate out early."""


STAGES = ("a", "a2", "a3", "r0", "d")
"""Stages of the evidence plan in analysis/regime.yaml: stage A (the top level), stage A2 (section ``stage_a2``),
stage A3 (section ``stage_a3``: the gate alone, :func:`a3_readout`), stage R0 (section ``stage_r0``: the premise meter
on SmolLM2, :func:`r0_readout`), stage D (section ``stage_d``: whole runs, paired, analysis/stage_d.py)."""


def load_regime(path: str | Path = REGIME_FILE, stage: str = "a") -> dict:
    """The pre-registered plan of ``stage``: stage A's keys at the top level of the file, A2's in ``stage_a2``
    (the same keys, with ``sweep`` for stage A's ``stage_a_sweep`` and a ``gate``)."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not valid; allowed: {', '.join(STAGES)}")
    regime = yaml.safe_load(Path(path).read_text())
    if stage in ("a3", "r0"):
        return {**regime[f"stage_{stage}"], "stage": stage}
    if stage == "a2":
        regime = {**regime["stage_a2"], "stage": "a2"}
        regime["stage_a_sweep"] = regime["sweep"]
    bad = [c for c in (regime.get("rule_out_on_hard") or {}).get("criteria", []) if c not in HARD_ONLY_CRITERIA]
    if bad:
        raise ValueError(
            f"{path}: rule_out_on_hard.criteria has {bad}; allowed: {list(HARD_ONLY_CRITERIA)} (the criteria that"
            " read hard runs only)"
        )
    return regime


@dataclass
class RunStats:
    """What the stage-A criteria need from one run folder."""

    path: Path
    arm: str
    regime: str
    seed: int
    done: bool
    late_pass1: float = math.nan
    pass1_step0: float = math.nan
    reward_auc: float = math.nan
    clip_frac: float = math.nan
    grad_clip_steps: float = 0.0  # updates grad-clipped, in steps (sum over steps of the share of updates)
    steps: int = 0
    delta: float = math.nan
    bins: dict[str, np.ndarray] = field(default_factory=dict)
    """side ('pos', 'neg') -> (11,) clipped-token counts summed over steps."""
    warm_start: str = ""
    """sha256 of the weights the run started from ("" if not recorded); pairs need equal ones (summary.pairs)."""


def read_run(path: str | Path, window=(0.5, 1.0)) -> RunStats:
    """The stage-A numbers of one run folder (metrics.jsonl, eval.jsonl[.gz], ratio_bins.jsonl[.gz])."""
    from experiments.rundir import RunDir, read_rows

    rd = RunDir(path)
    cfg = rd.read_config()
    if cfg is None:
        raise ValueError(f"{path}: no config.yaml; not a run folder")
    meta = cfg.get("meta", {})
    st = RunStats(
        Path(path),
        meta.get("arm", ""),
        str(meta.get("point", {}).get("regime", "")),
        int(cfg["seed"]),
        rd.state() == "done",
        delta=float(cfg["loss"]["delta"]),
        warm_start=str((meta.get("warm_start") or {}).get("sha256", "")),
    )
    metrics, _ = read_rows(rd.metrics_path) if rd.metrics_path.exists() else ([], [])
    if metrics:
        st.steps = len(metrics)
        st.reward_auc = float(np.mean([r["reward_mean"] for r in metrics]))
        st.clip_frac = float(np.mean([r["clip_frac_low"] + r["clip_frac_high"] for r in metrics]))  # every backend
        # per-update share where logged (grad_clipped_frac); older runs: the step-mean norm against the bound
        st.grad_clip_steps = float(
            sum(
                r["grad_clipped_frac"] if "grad_clipped_frac" in r else r["grad_norm"] > cfg["train"]["grad_clip"]
                for r in metrics
            )
        )
    eval_path = rd.log_path("eval.jsonl")
    if eval_path.exists():
        rows, _ = read_rows(eval_path)
        acc: dict[int, list[int]] = {}
        for r in rows:
            if r["decoding"] == "sampled":
                acc.setdefault(r["step"], []).append(r["correct"])
        total = cfg["train"]["steps"]
        late = [np.mean(v) for s, v in acc.items() if in_late_window(s, total, window)]
        st.late_pass1 = float(np.mean(late)) if late else math.nan
        st.pass1_step0 = float(np.mean(acc[0])) if 0 in acc else math.nan
    bins_path = rd.log_path("ratio_bins.jsonl")
    if bins_path.exists():
        rows, _ = read_rows(bins_path)
        for side in ("pos", "neg"):
            st.bins[side] = np.sum([r[f"{side}_clipped"] for r in rows], axis=0).astype(np.float64)
    return st


def stats_from_runset(rs, window=(0.5, 1.0), hashes: set[str] | None = None) -> list[tuple[str, RunStats]]:
    """(identity hash, :func:`read_run`) of the run folders of a loaded :class:`analysis.load.RunSet` (of ``hashes``
    only, if given), from the metrics, evals and ratio bins the RunSet read, so make_all reads a folder once. Numbers
    come from included (done) runs; the others enter with their state only, as the readout reads done runs alone."""
    runs = rs.runs
    if hashes is not None and len(runs):
        runs = runs[runs["hash"].isin(hashes)]
    if not len(runs):
        return []
    steps = dict(tuple(rs.steps.groupby("run", sort=False))) if len(rs.steps) else {}
    counts = rs.eval_counts()
    counts = counts[counts["run"].isin(set(runs["run"]))] if len(counts) else counts
    sampled = counts[counts["decoding"] == "sampled"] if len(counts) else counts
    per_step = sampled.groupby(["run", "step"])[["c", "n"]].sum() if len(sampled) else None
    bins = rs.ratio_bins(set(runs["run"]))
    bins = dict(tuple(bins.groupby("run", sort=False))) if len(bins) else {}
    out = []
    for rec in runs.to_dict("records"):
        ws = rec.get(WARM_START)
        point = rec.get("point") if isinstance(rec.get("point"), dict) else {}
        st = RunStats(
            Path(rec["path"]),
            str(rec.get("arm") or ""),
            str(point.get("regime", "")),
            int(rec["seed"]),
            rec["state"] == "done",
            delta=float(rec["loss.delta"]),
            warm_start=ws if isinstance(ws, str) else "",
        )
        m = steps.get(rec["run"])
        if rec["included"] and m is not None and len(m):
            st.steps = len(m)
            st.reward_auc = float(np.mean(m["reward_mean"].to_list()))
            st.clip_frac = float(np.mean((m["clip_frac_low"] + m["clip_frac_high"]).to_list()))
            if "grad_clipped_frac" in m.columns and m["grad_clipped_frac"].notna().all():
                st.grad_clip_steps = float(sum(m["grad_clipped_frac"].to_list()))
            else:
                st.grad_clip_steps = float(sum((m["grad_norm"] > float(rec["train.grad_clip"])).to_list()))
        if rec["included"] and per_step is not None and rec["run"] in per_step.index.get_level_values(0):
            acc = per_step.loc[rec["run"]]
            total = int(rec["train.steps"])
            late = [c / n for s, c, n in zip(acc.index, acc["c"], acc["n"]) if in_late_window(s, total, window)]
            st.late_pass1 = float(np.mean(late)) if late else math.nan
            st.pass1_step0 = float(acc.at[0, "c"] / acc.at[0, "n"]) if 0 in acc.index else math.nan
        b = bins.get(rec["run"])
        if rec["included"] and b is not None:
            for side in ("pos", "neg"):
                st.bins[side] = b[b["side"] == side].sort_values("bin")["clipped"].to_numpy(dtype=np.float64)
        out.append((rec["hash"], st))
    return out


def reach_share(counts: np.ndarray) -> float:
    """Share of clipped tokens inside the rescue zone: bins 0-9 of the 11 depth bins over all 11."""
    total = counts.sum()
    return float(counts[:-1].sum() / total) if total else math.nan


def _mean(xs) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def _keys(runs: list[RunStats]) -> list[tuple]:
    """Each run's pairing key by THE rule, :func:`analysis.summary.pairs` (same seed, same warm start)."""
    return pairs(pd.DataFrame({"seed": [r.seed for r in runs], "warm_start": [r.warm_start for r in runs]}))


def _paired(a: list[RunStats], b: list[RunStats], attr: str) -> np.ndarray:
    """a - b over the pairs both have (:func:`_keys`), in the order of ``a``."""
    bb = {k: getattr(r, attr) for k, r in zip(_keys(b), b)}
    return np.array([getattr(r, attr) - bb[k] for k, r in zip(_keys(a), a) if k in bb], dtype=np.float64)


def candidate_readout(
    runs: list[RunStats],
    regime: dict,
    name: str,
    expected: int | None = None,
    expected_hard: int | None = None,
    gate: dict | None = None,
) -> dict:
    """Every stage-A criterion, the spread, the dose and the dose-matched widening of one candidate.

    ``runs``: the candidate's run folders (arms hard, nsr, widen_small); ``expected`` / ``expected_hard``: how many
    runs, and hard runs, the sweep has. Every measure is computed from the done runs; ``runs`` / ``done`` count all
    of them and the done ones. ``ruled_out`` lists the hard-only criteria (regime.yaml ``rule_out_on_hard``,
    amendment 1) that fail once every hard run is done: the candidate's other runs cannot change them.
    """
    from nsr import LossConfig

    crit = regime["criteria"]
    by_arm: dict[str, list[RunStats]] = {}
    for r in runs:  # measures read done runs only: a running run's first steps would pass for a whole run
        if r.done:
            by_arm.setdefault(r.arm, []).append(r)
    hard, nsr_runs, widen = (by_arm.get(a, []) for a in ("hard", "nsr", "widen_small"))
    out: dict = {"candidate": name, "runs": len(runs), "done": sum(r.done for r in runs)}
    checks: dict[str, bool] = {}

    pos = np.sum([r.bins["pos"] for r in hard if "pos" in r.bins], axis=0) if hard else np.zeros(11)
    neg = np.sum([r.bins["neg"] for r in hard if "neg" in r.bins], axis=0) if hard else np.zeros(11)
    out["reach_pos"], out["reach_neg"] = reach_share(np.atleast_1d(pos)), reach_share(np.atleast_1d(neg))
    checks["reach"] = min(out["reach_pos"], out["reach_neg"]) >= crit["reach"]["min_share"]

    out["clip_frac"] = _mean([r.clip_frac for r in hard])
    checks["clip"] = out["clip_frac"] >= crit["clip"]["min"]

    c = crit["widening_not_protective"]
    out["widen_minus_hard_primary"] = _mean(_paired(widen, hard, "late_pass1"))
    out["widen_minus_hard_reward_auc"] = _mean(_paired(widen, hard, "reward_auc"))
    checks["widening_not_protective"] = (
        out["widen_minus_hard_primary"] >= c["min_primary_diff"]
        and out["widen_minus_hard_reward_auc"] >= c["min_reward_auc_diff"]
    )

    c = crit["not_saturated"]
    out["hard_late_pass1"] = _mean([r.late_pass1 for r in hard])
    out["hard_gain"] = _mean([r.late_pass1 - r.pass1_step0 for r in hard])
    lo, hi = c["late_pass1_range"]
    checks["not_saturated"] = lo <= out["hard_late_pass1"] <= hi and out["hard_gain"] >= c["min_gain"]

    steps = sum(r.steps for r in hard)
    out["grad_clip_share"] = sum(r.grad_clip_steps for r in hard) / steps if steps else math.nan
    checks["grad_clip_rare"] = out["grad_clip_share"] <= crit["grad_clip_rare"]["max_share"]

    n_expected = expected if expected is not None else len(runs)
    checks["complete"] = out["done"] == n_expected and n_expected > 0
    if "gate" in regime.get("criteria", {}):  # stage A2: the direct gate (analysis.mechanism), see gate_readout
        gate = gate or {"state": "not run"}
        out["gate"] = gate
        for k in ("mean", "lower", "p", "p_holm", "dose", "hard_change"):
            out[f"gate_{k}"] = gate.get(k, math.nan)
        checks["gate"] = gate.get("passes") is True
        checks["complete"] = checks["complete"] and gate["state"] == "complete"

    # NaN compares False, so a criterion without data fails
    out["checks"] = checks
    out["qualifies"] = all(checks.values())
    # without a sweep to count them, a candidate has one hard run per pre-registered seed (never "the folders that
    # exist": two done seeds of five must not rule a candidate out)
    n_hard = expected_hard if expected_hard is not None else len(regime.get("seeds", []))
    failed = [c for c in (regime.get("rule_out_on_hard") or {}).get("criteria", []) if not checks[c]]
    out["ruled_out"] = failed if n_hard > 0 and len(hard) == n_hard else []
    if gate is not None and gate.get("state") == "complete" and gate.get("passes") is False:  # a gate run that failed
        out["ruled_out"] = [*out["ruled_out"], "gate"]

    # dose and dose-matched widening (hard runs only), and the spread of paired differences (means not used)
    cand = regime["candidates"].get(name, {})
    ov = cand.get("overrides", {})
    loss = LossConfig(
        rule="nsr",
        delta=float(cand.get("delta", hard[0].delta if hard else 0.2)),
        eps_low=float(ov.get("loss.eps_low", 0.2)),
        eps_high=float(ov.get("loss.eps_high", 0.28)),
    )
    if pos.sum() + neg.sum() > 0:
        d_pos, w_pos = dose_matched_width(pos, 1, loss)
        d_neg, w_neg = dose_matched_width(neg, -1, loss)
        out["dose_per_token"] = out["clip_frac"] * (d_pos + d_neg) / (pos.sum() + neg.sum())
        out["widen_dose"] = {
            "w_pos": w_pos,
            "w_neg": w_neg,
            "eps_high": round(loss.eps_high + w_pos, 3),
            "eps_low": round(loss.eps_low + w_neg, 3),
        }
    diffs = [_paired(nsr_runs, hard, "late_pass1"), _paired(widen, hard, "late_pass1")]
    var = [np.var(d[np.isfinite(d)], ddof=1) for d in diffs if np.isfinite(d).sum() >= 2]
    out["spread"] = float(math.sqrt(np.mean(var))) if var else math.nan
    return out


def gate_readout(regime: dict, hard_ruled_out: dict[str, bool], gates_dir: Path) -> dict[str, dict]:
    """Stage A2's gate for every candidate, from ``gates_dir/<candidate>.jsonl`` (experiments.mechanism --out).

    Each gets ``state`` (not run / running / complete) and, once complete, analysis.mechanism.gate's numbers.
    ``passes`` is True / False once decided, else None: Holm across every candidate (a candidate ruled out on its
    hard runs enters with p = 1) is decided when every gate is complete or its candidate ruled out; before that a
    complete gate with p < alpha / m passes whatever the others show (Holm's first step), one with p >= alpha fails.
    """
    from analysis.mechanism import gate, gate_family, load_states

    g = regime["gate"]
    expected = int(re.search(r"--states (\d+)", g["command"]).group(1))
    alpha = regime["planning"]["alpha"]
    out: dict[str, dict] = {}
    for name in regime["candidates"]:
        path = gates_dir / f"{name}.jsonl"
        states = load_states(path) if path.is_file() else []
        if len(states) >= expected:
            out[name] = {"state": "complete", **gate(states, g["rule"])}
        else:
            out[name] = {"state": "running" if states else "not run", "states": len(states)}
    m = len(out)
    decided = all(v["state"] == "complete" or hard_ruled_out.get(k) for k, v in out.items())
    if decided:
        fam = gate_family({k: v if v["state"] == "complete" else None for k, v in out.items()}, alpha)
        for k, v in out.items():
            v.update(p_holm=fam[k]["p_holm"], passes=fam[k]["passes"])
    else:
        for v in out.values():
            p = v.get("p", math.nan)
            v["passes"] = (True if p < alpha / m else False if p >= alpha else None) if math.isfinite(p) else None
    return out


def regime_readout(
    root: str | Path | None,
    regime_path: str | Path = REGIME_FILE,
    sweep: str | None = None,
    stage: str = "a",
    gates_dir: str | Path | None = None,
    rs=None,
) -> dict:
    """Stage A (or A2) over a folder of run folders: per-candidate readouts, the chosen regime and stage B's size.

    ``rs``: a loaded :class:`analysis.load.RunSet` to read the runs from instead of ``root`` (make_all: each folder
    read once). ``gates_dir`` (stage A2): where the gate files are (default results/mechanism/a2 of the repo)."""
    from experiments.rundir import REPO_ROOT, RunDir, runs_by_hash

    regime = load_regime(regime_path, stage)
    expected: dict[str, int] = {}
    expected_hard: dict[str, int] = {}
    hashes: set[str] | None = None
    if sweep or regime.get("stage_a_sweep"):
        from experiments.sweep import expand

        hashes = set()
        for spec in expand(sweep or regime["stage_a_sweep"]):
            k = str(spec.meta["point"].get("regime", ""))
            expected[k] = expected.get(k, 0) + 1
            expected_hard[k] = expected_hard.get(k, 0) + (spec.meta["arm"] == "hard")
            hashes.add(spec.config.run_hash())
    # one folder per config: a config of the sweep as today's code hashes it (no legacy folder, no other config),
    # a done folder before an unfinished one, then by path (a copy never counts twice or stands in for a missing run)
    window = tuple(regime["primary_metric"]["window"])
    if rs is not None:
        by_hash: dict[str, list[RunStats]] = {}
        for h, st in stats_from_runset(rs, window, hashes):
            by_hash.setdefault(h, []).append(st)
        runs = sorted(
            (next((s for s in sorted(group, key=lambda s: s.path) if s.done), min(group, key=lambda s: s.path))
             for h, group in by_hash.items() if hashes is None or h in hashes),
            key=lambda s: s.path,
        )  # fmt: skip
    else:
        chosen = [
            next((p for p in folders if RunDir(p).state() == "done"), folders[0])
            for h, folders in runs_by_hash(Path(root)).items()
            if hashes is None or h in hashes
        ]
        runs = [read_run(path, window) for path in sorted(chosen)]
    cands = {}
    for name in regime["candidates"]:
        mine = [r for r in runs if r.regime == name]
        cands[name] = candidate_readout(mine, regime, name, expected.get(name, len(mine)), expected_hard.get(name))
    if "gate" in regime:  # stage A2: the gate's Holm family spans every candidate, so it is read after all of them
        gates_dir = Path(gates_dir) if gates_dir is not None else REPO_ROOT / "results" / "mechanism" / "a2"
        hard_out = {k: bool(v["ruled_out"]) for k, v in cands.items()}
        gates = gate_readout(regime, hard_out, gates_dir)
        for name in regime["candidates"]:
            mine = [r for r in runs if r.regime == name]
            cands[name] = candidate_readout(
                mine, regime, name, expected.get(name, len(mine)), expected_hard.get(name), gates[name]
            )
    # the selection compares candidates, so it waits for every one of them: a candidate that is not complete yet
    # is pending, not failed, and no regime is chosen while any is pending. A candidate ruled out on its done hard
    # runs (amendment 1) is not pending: its missing runs cannot make it qualify
    pending = [k for k, v in cands.items() if not v["checks"]["complete"] and not v.get("ruled_out")]
    ok = {k: v for k, v in cands.items() if v["qualifies"]}
    chosen = None
    if ok and not pending:
        best = max(v["dose_per_token"] for v in ok.values())
        tie = regime["selection"]["tie"]
        close = [k for k, v in ok.items() if v["dose_per_token"] >= (1 - tie) * best]
        chosen = min(close, key=lambda k: regime["candidates"][k]["cost"])
    plan = regime["planning"]
    ruled_out = {k: v["ruled_out"] for k, v in cands.items() if v.get("ruled_out")}
    out = {"candidates": cands, "chosen": chosen, "pending": pending, "ruled_out": ruled_out, "stage": stage}
    if chosen and stage == "a2":  # one warm start per pair: n pairs = n RL seeds (1001 ...)
        spread = cands[chosen]["spread"]
        sd = max(spread, plan["prior_sd"]) if math.isfinite(spread) else plan["prior_sd"]
        n = n_paired(sd, plan["sesoi"], plan["alpha"], plan["power"], plan["contrasts"])
        pairs = min(n, plan["cap_pairs"])
        out["plan"] = {
            "planning_sd": sd,
            "pairs_needed": n,
            "pairs": pairs,
            "seeds": f"1001-{1000 + pairs}",
            "mde_at_pairs": mde(pairs, sd, plan["alpha"], plan["power"], plan["contrasts"]),
        }
    elif chosen:
        spread = cands[chosen]["spread"]
        sd = max(spread, plan["prior_sd"]) if math.isfinite(spread) else plan["prior_sd"]
        n = n_paired(sd, plan["sesoi"], plan["alpha"], plan["power"], plan["contrasts"])
        warm = len(regime["stage_b"]["warm_starts"])
        capped = min(n, plan["cap_pairs"])
        seeds = math.ceil(capped / warm)
        out["plan"] = {
            "planning_sd": sd,
            "pairs_needed": n,
            "seeds_per_warm_start": seeds,
            "pairs": seeds * warm,
            "mde_at_pairs": mde(seeds * warm, sd, plan["alpha"], plan["power"], plan["contrasts"]),
        }
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if not math.isfinite(v) else f"{v:.4f}"
    return str(v)


def verdict(out: dict) -> str:
    """Stage A in one line: pending, the chosen regime, or that none qualifies."""
    if out.get("pending"):
        return f"incomplete ({', '.join(out['pending'])} pending)"
    return f"chosen regime: {out['chosen']}" if out["chosen"] else "no candidate qualifies (stage B is not run)"


MEASURES = {
    "reach": ("reach_pos", "reach_neg"),
    "clip": ("clip_frac",),
    "widening_not_protective": ("widen_minus_hard_primary", "widen_minus_hard_reward_auc"),
    "not_saturated": ("hard_late_pass1", "hard_gain"),
    "grad_clip_rare": ("grad_clip_share",),
}
"""The measures each criterion reads; a criterion whose measures have no done run reads n/a, not FAIL."""


def _cell(cand: dict, crit: str) -> str:
    if cand["checks"][crit]:
        return "pass"
    if crit == "gate" and cand["gate"]["state"] != "complete":
        return cand["gate"]["state"]
    if crit == "gate" and cand["gate"].get("passes") is None:
        return "pending (Holm)"
    measured = [cand.get(k, math.nan) for k in MEASURES.get(crit, ())]
    return "n/a" if measured and not any(math.isfinite(v) for v in measured) else "FAIL"


def readout_markdown(out: dict) -> str:
    """The readout as `python -m analysis.power regime` prints it: the criteria table, then the decision."""
    keys = [
        "runs",
        "done",
        "reach_pos",
        "reach_neg",
        "clip_frac",
        "widen_minus_hard_primary",
        "widen_minus_hard_reward_auc",
        "hard_late_pass1",
        "hard_gain",
        "grad_clip_share",
        "dose_per_token",
        "spread",
    ]
    if any("gate" in c for c in out["candidates"].values()):
        keys += ["gate_mean", "gate_lower", "gate_p", "gate_p_holm", "gate_dose", "gate_hard_change"]
    names = list(out["candidates"])
    lines = ["| measure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(_fmt(out["candidates"][n].get(k, math.nan)) for n in names) + " |")
    for crit in next(iter(out["candidates"].values()))["checks"] if names else []:
        cells = [_cell(out["candidates"][n], crit) for n in names]
        lines.append(f"| criterion {crit} | " + " | ".join(cells) + " |")
    if out.get("ruled_out"):
        lines.append(
            (RULED_OUT_A if out.get("stage", "a") == "a" else RULED_OUT_A2)
            + "; ".join(f"{k} ({', '.join(v)})" for k, v in out["ruled_out"].items())
        )
    if out.get("pending"):
        done = [n for n in names if n not in out["pending"]]
        lines.append(
            f"\nstage A incomplete: {', '.join(out['pending'])} not done; no regime is chosen until every candidate"
            f" is complete or ruled out (decided: {', '.join(done) or 'none'})"
        )
        return "\n".join(lines) + "\n"
    lines.append(f"\nchosen regime: {out['chosen'] or 'none qualifies (stage B is not run)'}")
    if out["chosen"]:
        lines.append(f"widen_dose: {out['candidates'][out['chosen']].get('widen_dose')}")
        lines.append(f"plan: {out['plan']}")
    return "\n".join(lines) + "\n"


RULED_OUT_A = "\nruled out on their done hard runs (amendment 1; the other runs cannot change a hard-only criterion): "
RULED_OUT_A2 = "\nruled out (the plan: on their done hard runs, or by a failed gate; their other runs need not run): "


def print_readout(out: dict) -> None:
    print(readout_markdown(out), end="")


# ------------------------------------------------------------------------------------------------ stage A3
A3_GATES = Path("results") / "mechanism" / "a3"
"""Where stage A3's gate files are, relative to the repo: tl44-s<seed>.jsonl (analysis/regime.yaml, stage_a3)."""


def a3_readout(
    root: str | Path | None = None, regime_path: str | Path = REGIME_FILE, gates_dir: str | Path | None = None, rs=None
) -> dict:
    """Stage A3 (analysis/regime.yaml, ``stage_a3``): the pre-registered gate, soft - hard over the baseline runs'
    means, from the run folders (``root``, or a loaded RunSet ``rs``) and the gate files (``gates_dir``, default
    results/mechanism/a3). A seed counts once its folder is done and its file holds every pre-registered state;
    the decision is made only when all of them count (``complete``). nsr - hard is computed beside it."""
    from analysis.mechanism import gate, load_states, mde_one_sided, n_one_sided, power_one_sided
    from experiments.rundir import REPO_ROOT, RunDir
    from experiments.sweep import expand

    plan = load_regime(regime_path, "a3")
    g = plan["gate"]
    per_run = int(re.search(r"(\d+) per run", g["states"]).group(1))
    alpha = float(g["alpha"])
    frac = float(plan["sesoi"]["fraction_of_hard_change"])
    gates = Path(gates_dir) if gates_dir is not None else REPO_ROOT / A3_GATES
    specs = [s for s in expand(plan["sweep"]) if s.config.seed in plan["seeds"]]
    states_of_run: dict[str, str] = {}
    if rs is not None and len(rs.runs):
        for rec in rs.runs.to_dict("records"):  # a done folder wins over an unfinished copy
            if states_of_run.get(rec["hash"]) != "done":
                states_of_run[rec["hash"]] = rec["state"]
    elif root is not None and Path(root).is_dir():
        from experiments.rundir import runs_by_hash

        for h, folders in runs_by_hash(Path(root)).items():
            done = any(RunDir(p).state() == "done" for p in folders)
            states_of_run[h] = "done" if done else RunDir(folders[0]).state()
    seeds, counted = [], []
    for s in specs:
        path = gates / f"tl44-s{s.config.seed}.jsonl"
        got = load_states(path) if path.is_file() else []
        steps = {x["step"] for x in got}
        row = {
            "seed": s.config.seed,
            "run_id": s.run_id,
            "run": states_of_run.get(s.config.run_hash()) or "not run",
            "states": len(steps),
        }
        row["counts"] = row["run"] == "done" and len(steps) >= per_run
        seeds.append(row)
        if row["counts"]:
            counted += got
    out = {"plan": plan, "seeds": seeds, "expected": len(specs), "counted": sum(r["counts"] for r in seeds)}
    out["complete"] = out["counted"] == out["expected"] and out["expected"] > 0
    if not counted:
        out.update(gate=None, beside=None, outcome="pending")
        return out
    res = gate(counted, g["rule"])
    beside = gate(counted, plan["beside"]["rule"]) if plan["beside"]["rule"] in counted[0]["train_after"] else None
    n = res["runs"]
    sd = float(np.std(res["run_means"], ddof=1)) if n >= 2 else math.nan
    h = res["hard_change"]
    sesoi = frac * abs(h)
    mde_n = mde_one_sided(len(specs), sd, alpha) if math.isfinite(sd) else math.nan
    out["gate"] = {
        **res,
        "sd_run_means": sd,
        "sesoi": sesoi,
        "hard_gain_negative": h <= 0,
        "mde": mde_n,
        "mde_over_hard_change": mde_n / abs(h) if h else math.nan,
        "power_at_sesoi": power_one_sided(sesoi, sd, len(specs), alpha),
        "n_for_sesoi": n_one_sided(sesoi, sd, alpha),
        "passes": bool(res["p"] < alpha) if out["complete"] else None,
    }
    out["beside"] = beside
    if not out["complete"]:
        out["outcome"] = "pending"
    elif res["upper"] < 0:
        out["outcome"] = "harmful"
    elif out["gate"]["passes"]:
        out["outcome"] = "passes"
    else:
        out["outcome"] = "fails_underpowered" if mde_n > sesoi else "fails_powered"
    return out


def _e(x) -> str:
    """A pass@1 difference in units of 1e-4 (basis points of pass@1)."""
    return "n/a" if x is None or not math.isfinite(x) else f"{x * 1e4:+.3f}"


A3_COMMAND = (
    "python -m analysis.regime results/runs/regime_a3 --stage a3   # this table; the gate alone:\n"
    "python -m analysis.mechanism results/mechanism/a3/tl44-s*.jsonl --gate soft"
)


def a3_markdown(out: dict) -> str:
    """Stage A3's table: every seed's state, the gate's decision with its bound, SESOI and MDE, nsr - hard beside."""
    plan = out["plan"]
    lines = [
        f"Pre-registered in analysis/regime.yaml, section stage_a3 (regime {plan['regime']}, seeds "
        f"{plan['seeds'][0]}-{plan['seeds'][-1]}, one warm start per seed). Differences of exact training-split "
        "pass@1 after one update, in units of 1e-4.",
        "",
        "| seed | run folder | gate states |",
        "|---|---|---|",
    ]
    lines += [f"| {r['seed']} | {r['run']} | {r['states']} |" for r in out["seeds"]]
    lines.append("")
    g, b = out["gate"], out["beside"]
    if g is None:
        lines.append(f"Decision: none yet ({out['counted']} of {out['expected']} baseline runs complete).")
        return "\n".join(lines + ["", "```", A3_COMMAND, "```", ""])
    if not out["complete"]:
        lines.append(
            f"Decision: none yet: {out['counted']} of {out['expected']} baseline runs complete; the numbers below are"
            " from those runs and decide nothing."
        )
    else:
        words = {
            "passes": "passes: soft's one-step update raises training-split pass@1 more than hard's",
            "fails_underpowered": "fails: not detected at this power (the MDE is above the SESOI)",
            "fails_powered": "fails: an effect of the SESOI's size would have been detected with 80% power",
            "harmful": "fails: soft's update does worse than hard's (the one-sided 95% upper bound is below 0)",
        }
        lines.append(f"Decision (the one pre-registered test): **{words[out['outcome']]}**.")
    lines += [
        "",
        "| measure | soft - hard (the gate) | nsr - hard (beside it, not a decision) |",
        "|---|---|---|",
        f"| baseline runs / states | {g['runs']} / {g['states']} | {b['runs'] if b else 'n/a'} / "
        f"{b['states'] if b else 'n/a'} |",
        f"| mean over run means | {_e(g['mean'])} | {_e(b['mean'] if b else None)} |",
        f"| one-sided 95% lower bound | {_e(g['lower'])} | {_e(b['lower'] if b else None)} |",
        f"| one-sided 95% upper bound | {_e(g['upper'])} | {_e(b['upper'] if b else None)} |",
        f"| one-sided p (H1: mean > 0, df {g['runs'] - 1}) | {g['p']:.4f} | {b['p']:.4f} |"
        if b
        else f"| one-sided p (H1: mean > 0, df {g['runs'] - 1}) | {g['p']:.4f} | n/a |",
        f"| hard's own one-step change H | {_e(g['hard_change'])} | |",
        f"| SESOI = {plan['sesoi']['fraction_of_hard_change']} x |H| | {_e(g['sesoi'])} | |",
        f"| SD of the run means | {_e(g['sd_run_means'])} | |",
        f"| MDE at n = {out['expected']} (80% power, one-sided 0.05) | {_e(g['mde'])} "
        f"({g['mde_over_hard_change']:.3f} x |H|; planned {plan['planning']['mde_n8'].split(' (')[0]}) | |",
        f"| power at the SESOI | {g['power_at_sesoi']:.2f} (planned {plan['planning']['power_at_sesoi_n8']}) | |",
        f"| baseline runs the SESOI needs at this spread | {g['n_for_sesoi']} | |",
        f"| dose (gradient weight on clipped tokens per valid token) | {g['dose']:.5f} | "
        f"{b['dose'] if b else math.nan:.5f} |",
        f"| hard's clip fraction | {g['clip_frac']:.4f} | |",
    ]
    if g["hard_gain_negative"]:
        lines.append("\nHard's own one-step change did not gain on average: the SESOI is 0.10 x |H|.")
    return "\n".join(lines + ["", "```", A3_COMMAND, "```", ""])


# ------------------------------------------------------------------------------------------------ CLI
# ------------------------------------------------------------------------------------------------ stage R0
def _g(x) -> str:
    """A share or rate, 4 significant digits (n/a when missing)."""
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4g}"


R0_COMMAND = "python -m analysis.regime results/runs/regime_r0 --stage r0   # per run: python -m analysis.premise RUN"


def r0_readout(root: str | Path, regime_path: str | Path = REGIME_FILE) -> dict:
    """Stage R0 (analysis/regime.yaml, ``stage_r0``): the premise meter of the hard runs in ``root``, pooled, and each
    pre-registered criterion. Only folders of the stage's seeds with status done count; the others are listed."""
    from analysis.premise import PremiseError
    from analysis.premise import read_run as premise_run
    from experiments.rundir import RunDir, read_rows

    plan = load_regime(regime_path, "r0")
    crit = plan["criteria"]
    seeds, steps = list(plan["seeds"]), int(plan["fixed"]["steps"])
    runs, pending = [], []
    for folder in sorted(p for p in Path(root).iterdir() if p.is_dir()) if Path(root).is_dir() else []:
        rd = RunDir(folder)
        cfg = rd.read_config() or {}
        if cfg.get("seed") not in seeds:
            continue
        status = (rd.status() or {}).get("state")
        if status != "done":  # its progress: the steps logged so far (a resumed run rewrites none it keeps)
            logged = len(read_rows(rd.metrics_path)[0]) if rd.metrics_path.exists() else 0
            pending.append({"run": folder.name, "state": status, "rows": logged})
            continue
        try:
            reading = premise_run(folder)
        except PremiseError as e:
            raise ValueError(str(e)) from None
        metrics, _ = read_rows(rd.metrics_path)
        mixed = [r["mixed_group_frac"] for r in metrics if r.get("mixed_group_frac") is not None]
        runs.append({**reading, "run": folder.name, "seed": cfg["seed"], "rows": len(metrics), "mixed": mixed})
    out: dict = {"plan": plan, "runs": runs, "pending": pending, "criteria": {}}
    if not runs:
        out["outcome"] = "not run"
        return out
    c = out["criteria"]
    short = [f"{r['run']} ({r['rows']} rows)" for r in runs if r["rows"] < steps]
    done = len(runs) == len(seeds) and not short
    value = f"{len(runs)} of {len(seeds)} done" + (f"; short of {steps} steps: {', '.join(short)}" if short else "")
    c["complete"] = {"value": value, "holds": done}
    if not done:  # the plan reads its criteria once, on the whole stage: none is computed from part of it
        out["outcome"] = "incomplete"
        return out
    floor = 100  # stage_r0.criteria.reach: a side with fewer clipped tokens in all fails as too few to measure
    for side in ("pos", "neg"):
        n = sum(r[f"{side}_clipped"] for r in runs)
        share = (
            sum(r[f"{side}_reach"] * r[f"{side}_clipped"] for r in runs if r[f"{side}_clipped"]) / n if n else math.nan
        )
        c[f"reach_{side}"] = {"value": share, "clipped": n, "holds": n >= floor and share >= crit["reach"]["min_share"]}
    zone = float(np.mean([r["pos_zone_per_token"] + r["neg_zone_per_token"] for r in runs]))
    c["zone_mass"] = {"value": zone, "holds": zone >= crit["zone_mass"]["min"]}
    mixed = [m for r in runs for m in r["mixed"]]
    signal = float(np.mean(mixed)) if mixed else math.nan
    c["signal"] = {"value": signal, "holds": bool(mixed) and signal >= crit["signal"]["min"]}
    c["complete"] = c.pop("complete")  # listed last
    out["outcome"] = "qualifies" if all(v["holds"] for v in c.values()) else "fails"
    return out


def r0_markdown(out: dict) -> str:
    """Stage R0's table: each run's premise reading, then every criterion against its pre-registered threshold."""
    plan = out["plan"]
    lines = [
        f"Pre-registered in analysis/regime.yaml, section stage_r0 (preset {plan['preset']}, seeds "
        f"{', '.join(map(str, plan['seeds']))}, {plan['fixed']['steps']} steps, hard runs only).",
        "",
    ]
    if not out["runs"]:
        lines.append(
            "Not run yet: no done run folder of the stage's seeds."
            + (f" Unfinished: {', '.join(p['run'] for p in out['pending'])}." if out["pending"] else "")
        )
        return "\n".join(lines + ["", "```", R0_COMMAND, "```", ""])
    if out["outcome"] == "incomplete":  # progress only: the criteria are read on the whole stage
        lines += ["| run | state | steps |", "|---|---|---|"]
        lines += [f"| {r['run']} | done | {r['rows']} |" for r in out["runs"]]
        lines += [f"| {p['run']} | {p['state'] or 'no status'} | {p['rows']} logged |" for p in out["pending"]]
        missing = [str(x) for x in plan["seeds"] if x not in {r["seed"] for r in out["runs"]}]
        lines += [
            "",
            f"Seeds without a done run: {', '.join(missing)}." if missing else "Every seed has a done run.",
            "",
            f"**In progress: {out['criteria']['complete']['value']}.** The criteria are read once all "
            f"{len(plan['seeds'])} runs are done, as the plan says; nothing is read from part of the stage.",
        ]
        return "\n".join(lines + ["", "```", R0_COMMAND, "```", ""])
    lines += [
        "| run | steps | reach A>0 | reach A<0 | in-zone clipped/token | mixed groups |",
        "|---|---|---|---|---|---|",
    ]
    for r in out["runs"]:
        zone = r["pos_zone_per_token"] + r["neg_zone_per_token"]
        mixed = float(np.mean(r["mixed"])) if r["mixed"] else math.nan
        lines.append(
            f"| {r['run']} | {r['rows']} | {_g(r['pos_reach'])} | {_g(r['neg_reach'])} | {_g(zone)} | {_g(mixed)} |"
        )
    crit = plan["criteria"]
    want = {
        "reach_pos": f">= {crit['reach']['min_share']} (and >= 100 clipped)",
        "reach_neg": f">= {crit['reach']['min_share']} (and >= 100 clipped)",
        "zone_mass": f">= {crit['zone_mass']['min']}",
        "signal": f">= {crit['signal']['min']}",
        "complete": f"{len(plan['seeds'])} runs done, {plan['fixed']['steps']} steps each",
    }
    lines += ["", "| criterion | value | needs | holds |", "|---|---|---|---|"]
    for name, v in out["criteria"].items():
        val = _g(v["value"]) if isinstance(v["value"], float) else str(v["value"])
        lines.append(f"| {name} | {val} | {want[name]} | {'yes' if v['holds'] else 'no'} |")
    if out["pending"]:
        lines += ["", f"Unfinished: {', '.join(p['run'] + ' (' + str(p['state']) + ')' for p in out['pending'])}."]
    lines += ["", f"**Outcome: {out['outcome']}** ({plan['outcomes'].get(out['outcome'], 'stage not complete')})"]
    return "\n".join(lines + ["", "```", R0_COMMAND, "```", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.regime", description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="a folder of run folders, e.g. results/runs/regime_search")
    p.add_argument("--regime", default=str(REGIME_FILE))
    p.add_argument("--sweep", default=None, help="sweep whose runs are expected (default: regime.yaml's)")
    p.add_argument("--stage", default="a", choices=STAGES, help="stage of the plan (a2: section stage_a2)")
    p.add_argument(
        "--gates", default=None, help="stage a2 / a3: folder of the gate files (default results/mechanism/a2, a3)"
    )
    a = p.parse_args(argv)
    try:
        if a.stage == "a3":
            print(a3_markdown(a3_readout(a.root, a.regime, a.gates)), end="")
            return 0
        if a.stage == "r0":
            print(r0_markdown(r0_readout(a.root, a.regime)), end="")
            return 0
        if a.stage == "d":
            from analysis import stage_d

            print(stage_d.markdown(stage_d.readout(a.root, a.regime)), end="")
            return 0
        print_readout(regime_readout(a.root, a.regime, a.sweep, a.stage, a.gates))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
