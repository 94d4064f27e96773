"""The plan of a paired per-update test and its file, shared by every backend's walk (experiments.mechanism.toy,
experiments.mechanism.trl): the rules tested (:func:`parse_rules`), the baseline runs' seeds (:func:`parse_seeds`), the
states walked (:func:`state_steps`), a sweep's hard baseline of each seed (:func:`baseline_specs`), and the file: a
header line (:func:`header`), then one JSON line per state (:func:`read_lines`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import nsr


@dataclass(frozen=True)
class RuleSpec:
    label: str
    loss: nsr.LossConfig


def parse_rules(text: str, base: nsr.LossConfig) -> list[RuleSpec]:
    """``hard,nsr,soft:delta=0.1,widen,widen:by=0.05`` -> RuleSpecs; ``hard`` (the base loss) comes first.

    ValueError naming the spec and the allowed values for anything else.
    """
    specs = [RuleSpec("hard", base.replace(rule="hard"))]
    fields = [f for f in nsr.LossConfig.__dataclass_fields__ if f != "rule"]
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        name, *kvs = item.split(":")
        opts = {}
        for kv in kvs:
            key, sep, value = kv.partition("=")
            allowed = ["by"] if name == "widen" else fields
            if not sep or key not in allowed:
                raise ValueError(f"--rules {item!r}: {kv!r} is not valid; allowed: key=value with key in {allowed}")
            try:
                opts[key] = float(value) if key not in ("level", "executor") else value
            except ValueError:
                raise ValueError(f"--rules {item!r}: {key}={value!r} is not valid; allowed: a number") from None
        if name == "widen":
            by = opts.get("by", base.delta)
            loss = base.replace(rule="hard", eps_low=base.eps_low + by, eps_high=base.eps_high + by)
        elif name in nsr.RULES:
            loss = base.replace(rule=name, **opts)
        else:
            raise ValueError(f"--rules {item!r}: unknown rule {name!r}; allowed: widen, {', '.join(nsr.RULES)}")
        if item != "hard":
            if item in [s.label for s in specs]:
                raise ValueError(f"--rules {item!r} is repeated; allowed: each rule once")
            specs.append(RuleSpec(item, loss))
    return specs


def state_steps(n_states: int, runs: int, start: int, every: int, steps: int) -> list[list[int]]:
    """The baseline steps whose states are tested, per run: ``start, start + every, ...``, n_states in all."""
    per_run = [n_states // runs + (1 if i < n_states % runs else 0) for i in range(runs)]
    out = [[start + k * every for k in range(n)] for n in per_run]
    last = max((s[-1] for s in out if s), default=0)
    if last > steps:
        raise ValueError(
            f"--states {n_states} over --runs {runs} from step {start} every {every} needs step {last}; allowed: "
            f"at most train.steps = {steps} (raise train.steps or --runs, or lower --every)"
        )
    return out


def parse_seeds(text: str) -> list[int]:
    """``201-208`` or ``1,4,9`` (or a mix) -> distinct non-negative seeds in that order; ValueError otherwise."""
    out: list[int] = []
    try:
        for part in [p.strip() for p in text.split(",") if p.strip()]:
            lo, sep, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if sep else [int(part)]
    except ValueError:
        raise ValueError(f"--seeds {text!r} is not valid; allowed: A-B or a comma list of integers") from None
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise ValueError(f"--seeds {text!r} is not valid; allowed: distinct non-negative integers, at least one")
    return out


def header(command: str, git: dict, **extra) -> dict:
    """The header line of a mechanism file: {"header": {command, git_commit, git_dirty, started, ...}}; the analysis
    (analysis.mechanism.load_states) skips it."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"header": {"command": command, **git, "started": started, **extra}}


def baseline_specs(sweep: str | Path, seeds: list[int]) -> list:
    """The sweep's baseline run (arm = the sweep's ``baseline``, rule hard) of each seed, in the order of ``seeds``;
    ValueError naming the seeds the sweep has when one is missing."""
    from experiments.sweep import check_ready, expand, load_sweep

    sw = load_sweep(sweep)
    check_ready(sw)
    base = sw.baseline or "hard"
    runs = [s for s in expand(sw) if s.meta.get("arm") == base and s.config.loss.rule == "hard"]
    by_seed: dict[int, list] = {}
    for s in runs:
        by_seed.setdefault(s.config.seed, []).append(s)
    out = []
    for seed in seeds:
        found = by_seed.get(seed, [])
        if len(found) != 1:
            have = sorted(by_seed)
            raise ValueError(
                f"--seeds: sweep {sw.name} has {len(found)} hard {base!r} runs of seed {seed}; allowed: seeds with "
                f"exactly one ({', '.join(map(str, have)) or 'none'})"
            )
        out.append(found[0])
    return out


def read_lines(path: Path) -> list[dict]:
    """The JSON lines of a mechanism file ([] if there is none; a truncated last line, from a walk stopped while
    writing, is dropped)."""
    if not path.exists():
        return []
    text = path.read_text().splitlines()
    out = []
    for j, line in enumerate(text):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if j != len(text) - 1:
                    raise ValueError(f"{path}: line {j + 1} is not JSON") from None
    return out
