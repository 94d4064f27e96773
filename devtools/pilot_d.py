"""The tables of results/pilot_d/README.md (stage D's pilot, outside every stage) from the pilot's run folders.

    python -m devtools.pilot_d                        # every run folder under results/pilot_d
    python -m devtools.pilot_d results/pilot_d/NAME   # one

First the step-0 pass-rate tables of the pilot's spread files (``spread-*.json``, experiments.evaluation.spread).

Per run: its state and, per logged step, the share of drawn prompts dynamic sampling kept (OpenRLHF's
``dynamic_filtering_pass_rate`` is samples kept per prompt drawn x 100, so kept share = rate / (100 x samples per
prompt)), the prompts drawn (8 x ... : prompts per step / kept share), the mean training reward, the clipped token
fractions below and above the trust region, the generation and whole-step seconds. Then, where the run has
evaluations, the accuracy per evaluated step and decoding on each benchmark, per problem family (the part of a
problem id before its last ``-``). Last, the pairs of item (d): 10-step runs of hard and nsr at one seed, their
held-out accuracy at step 10, the differences and their SD (the planning SD). Prints Markdown.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from experiments.rundir import REPO_ROOT, RunDir, read_rows

PILOT = REPO_ROOT / "results" / "pilot_d"


def step_table(folder: Path) -> str:
    rd = RunDir(folder)
    cfg = rd.read_config()
    per_prompt, prompts = int(cfg["rollout"]["samples_per_prompt"]), int(cfg["rollout"]["prompts_per_step"])
    rows, _ = read_rows(rd.metrics_path) if rd.metrics_path.exists() else ([], [])
    lines = [
        "| step | kept share | prompts drawn | reward | clipped low | clipped high | generation | step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    drawn_total = 0.0
    for r in rows:
        rate = r.get("dynamic_filtering_pass_rate")
        kept = rate / (100.0 * per_prompt) if rate else None
        drawn = prompts / kept if kept else None
        drawn_total += drawn or 0.0
        lines.append(
            f"| {r['step']} | {f'{kept:.2f}' if kept else '-'} | {f'{drawn:.0f}' if drawn else '-'} | "
            f"{r['reward_mean']:.3f} | {r['clip_frac_low']:.4f} | {r['clip_frac_high']:.4f} | "
            f"{r['generation_s']:.1f} s | {r['wall_s']:.1f} s |"
        )
    state = rd.state() or "no status"
    head = f"**{folder.name}** ({state}; {len(rows)} of {cfg['train']['steps']} steps logged"
    head += f", about {drawn_total:.0f} prompts drawn)" if drawn_total else ")"
    return head + "\n\n" + "\n".join(lines)


def eval_table(folder: Path) -> str | None:
    rd = RunDir(folder)
    path = rd.log_path("eval.jsonl")
    if not path.exists():
        return None
    rows, _ = read_rows(path)
    acc: dict[tuple, list[int]] = defaultdict(list)
    for r in rows:
        fam = str(r["problem_id"]).rsplit("-", 1)[0]
        for group in (fam, "all"):
            acc[(r["step"], r["decoding"], r["benchmark"], group)].append(int(r["correct"]))
    groups = sorted({k[3] for k in acc} - {"all"}) + ["all"]
    lines = ["| step | decoding | benchmark | " + " | ".join(groups) + " |", "|---|---|---|" + "---|" * len(groups)]
    for step, dec, bench in sorted({k[:3] for k in acc}):
        cells = []
        for g in groups:
            v = acc.get((step, dec, bench, g))
            cells.append(f"{sum(v) / len(v):.3f} ({len(v)})" if v else "-")
        lines.append(f"| {step} | {dec} | {bench} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def accuracy(folder: Path, step: int, decoding: str) -> float | None:
    """Accuracy over every problem x sample of ``decoding`` at evaluated step ``step`` (None: not evaluated)."""
    path = RunDir(folder).log_path("eval.jsonl")
    if not path.exists():
        return None
    hits = [int(r["correct"]) for r in read_rows(path)[0] if r["step"] == step and r["decoding"] == decoding]
    return sum(hits) / len(hits) if hits else None


def pairs_table(folders: list[Path], steps: int = 10) -> str | None:
    """Item (d): the pilot's pairs, runs of ``steps`` steps with rules hard and nsr at one seed, and per decoding the
    held-out accuracy at the last step, the difference nsr - hard and the sample SD (ddof 1) of the differences:
    the planning SD. None while fewer than 2 pairs exist."""
    import statistics

    runs: dict[tuple[int, str], Path] = {}
    for folder in folders:
        cfg = RunDir(folder).read_config()
        if int(cfg["train"]["steps"]) == steps and cfg["loss"]["rule"] in ("hard", "nsr"):
            key = (int(cfg["seed"]), cfg["loss"]["rule"])
            if key in runs:
                raise SystemExit(f"two pilot runs of seed {key[0]} rule {key[1]}: {runs[key].name}, {folder.name}")
            runs[key] = folder
    seeds = sorted(s for s, rule in runs if rule == "hard" and (s, "nsr") in runs)
    if len(seeds) < 2:
        return None
    lines = [
        f"| seed | hard run | nsr run | decoding | hard at step {steps} | nsr at step {steps} | nsr - hard |",
        "|---|---|---|---|---|---|---|",
    ]
    diffs: dict[str, list[float]] = defaultdict(list)
    for dec in ("greedy", "sampled"):
        for seed in seeds:
            h, n = accuracy(runs[(seed, "hard")], steps, dec), accuracy(runs[(seed, "nsr")], steps, dec)
            if h is None or n is None:
                continue
            diffs[dec].append(n - h)
            lines.append(
                f"| {seed} | {runs[(seed, 'hard')].name} | {runs[(seed, 'nsr')].name} | {dec} | {h:.4f} | {n:.4f} "
                f"| {n - h:+.4f} |"
            )
    lines.append("")
    for dec, d in diffs.items():
        if len(d) > 1:
            lines.append(
                f"{dec}: {len(d)} pairs, mean nsr - hard {statistics.mean(d):+.4f}, SD {statistics.stdev(d):.4f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.pilot_d", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="*", type=Path, help="run folders (default: every one under results/pilot_d)")
    a = p.parse_args(argv)
    if not a.runs:
        import json

        from experiments.evaluation.spread import spread_table

        for path in sorted(PILOT.glob("spread-*.json")):
            print(f"**{path.name}**", spread_table(json.loads(path.read_text())), sep="\n\n", end="\n\n")
    folders = a.runs or sorted(x for x in PILOT.iterdir() if (x / "config.yaml").is_file())
    for folder in folders:
        print(step_table(folder), end="\n\n")
        ev = eval_table(folder)
        if ev:
            print("Evaluations (accuracy, problems x samples in brackets):", ev, sep="\n\n", end="\n\n")
    pairs = pairs_table(folders)
    if pairs:
        print("**Pairs (item d)**", pairs, sep="\n\n", end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
