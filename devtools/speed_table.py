"""The speed tables of docs/testbed.md ("Speed: what a SmolLM2 step costs") from the JSON lines that hold them.

    python -m devtools.speed_table                                        # results/smollm2/speed-2026-12-07.jsonl
    python -m devtools.speed_table FILE.jsonl

Each line is one measurement: ``{"table": "trl" | "profile" | "memory" | "openrlhf" | "openrlhf_actor", "order": N,
"command": ..., "commit": ..., "note": ..., "result": {...}}``; ``result`` is what the command printed
(experiments.trl.bench's or experiments.openrlhf.profile_actor's JSON line) or, for ``openrlhf``, the run's own
metrics.jsonl columns per step (``wall_s``, ``generation_s``, ``reward_mean``, ``dynamic_filtering_pass_rate``) with
its wall time. A ``trl`` kit line's ``versus`` is the order of the TRL run its median is divided by (else the first
undisturbed one); an ``openrlhf`` line's ``threads`` is the NSR_THREADS it ran with (1 if absent) and its ``versus``
the label of the run its median is divided by. Medians are over the steps after the first (start-up is in the first).
Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1] / "results" / "smollm2" / "speed-2026-12-07.jsonl"
TABLES = ("trl", "profile", "memory", "openrlhf", "openrlhf_actor")


def load(path: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {t: [] for t in TABLES}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("table") not in TABLES:
            raise SystemExit(f"{path}:{n}: table={row.get('table')!r}; allowed: {', '.join(TABLES)}")
        out[row["table"]].append(row)
    return {t: sorted(rows, key=lambda r: r["order"]) for t, rows in out.items()}  # each table in its run order


def _s(xs) -> str:
    return ", ".join(f"{x:.1f}" for x in xs)


def _range(xs) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f}"


def after_first(xs) -> float:
    return statistics.median(xs[1:])


def trl_table(rows: list[dict]) -> str:
    lines = [
        "| order | trainer | RL steps 1-4 | median of steps 2-4 | generation | peak RSS | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        x = r["result"]
        name = "the kit (`NSRGRPOTrainer`, preset)" if x["trainer"] == "kit" else "TRL's own `GRPOTrainer`"
        lines.append(
            f"| {r['order']} | {name} | {_s(x['step_s'])} s | **{after_first(x['step_s']):.1f} s** | "
            f"{_range(x['generate_s'])} s | {x['peak_rss_gb']:.2f} GB | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    """The kit's median over TRL's: each kit run against the TRL run its ``versus`` names (an order of this table),
    else against the first undisturbed TRL run; one sentence per TRL run."""
    trl = {r["order"]: r for r in rows if r["result"]["trainer"] == "trl" and not r.get("disturbed")}
    kit = [r for r in rows if r["result"]["trainer"] == "kit" and not r.get("disturbed")]
    if not trl or not kit:
        return ""
    groups: dict[int, list[dict]] = {}
    for k in kit:
        groups.setdefault(k.get("versus", min(trl)), []).append(k)
    out = []
    for base_order, runs in groups.items():
        base = after_first(trl[base_order]["result"]["step_s"])
        parts = [f"{after_first(k['result']['step_s']) / base:.2f} (run {k['order']})" for k in runs]
        out.append(f"The kit's median over TRL's (run {base_order}): " + ", ".join(parts) + ".")
    return " ".join(out)


def profile_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        p = r["result"]["profile"]
        sec, parts, peak = p["seconds"], p["parts"], p["peak_rss_gb"]
        lines += [
            f"Median seconds per RL step over steps 2-{p['steps'] + 1} ({r['result']['threads']} threads; total "
            f"{p['total_s']:.1f} s), and each phase's peak RSS:",
            "",
            "| phase | seconds | attention | MLP | LM head | peak RSS |",
            "|---|---|---|---|---|---|",
        ]
        for phase in ("generation", "old_logprobs", "forward", "backward", "optimizer", "other"):
            cells = [f"{parts[f'{phase}/{part}']:.1f}" if f"{phase}/{part}" in parts else "-"
                     for part in ("attention", "mlp", "lm_head")]  # fmt: skip
            lines.append(f"| {phase} | {sec[phase]:.1f} | " + " | ".join(cells) + f" | {peak[phase]:.2f} GB |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    lines = [
        "| `trl.micro_batch_size` | `trl.checkpoint_mlp` | median step (1 thread) | backward | peak RSS | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        x, o = r["result"], r["overrides"]
        lines.append(
            f"| {o['trl.micro_batch_size']} | {o['trl.checkpoint_mlp']} | {x['median_s_after_first']:.1f} s | "
            f"{x['profile']['seconds']['backward']:.1f} s | {x['peak_rss_gb']:.2f} GB | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def openrlhf_table(rows: list[dict]) -> str:
    lines = [
        "| run | code | NSR_THREADS | step wall_s 1, 2, 3 | median of steps 2-3 | generation 1, 2, 3 "
        "| the rest of steps 2-3 | run wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    med, ratios = {}, []
    for r in rows:
        x = r["result"]
        rest = [w - g for w, g in zip(x["wall_s"][1:], x["generation_s"][1:])]
        med[r["label"]] = after_first(x["wall_s"])
        lines.append(
            f"| {r['label']} | {r['commit']} | {r.get('threads', 1)} | {_s(x['wall_s'])} s | "
            f"**{med[r['label']]:.1f} s** | {_s(x['generation_s'])} s | {_range(rest)} s | {x['elapsed']} |"
        )
        if r.get("versus"):
            ratios.append((r["label"], r["versus"]))
    if ratios:
        lines.append("")
        lines.append("; ".join(f"{a} over {b}: {med[a] / med[b]:.2f}" for a, b in ratios) + ".")
    return "\n".join(lines)


def openrlhf_actor_table(rows: list[dict]) -> str:
    """experiments.openrlhf.profile_actor's second rollout (the first also warms up) per line."""
    lines = [
        "| overrides | threads | old log-probs | 16 updates (fit) | forward | backward | optimizer step | peak RSS "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        x = r["result"]
        lines.append(
            f"| {' '.join(x['overrides'])} | {x['threads']} | {x['old_logprobs_s']:.1f} s | {x['fit_s']:.1f} s | "
            f"{x['forward_and_rest_s']:.1f} s | {x['backward_s']:.1f} s | {x['optimizer_step_s']:.1f} s | "
            f"{x['peak_rss_gib'] * 2**30 / 1e9:.2f} GB | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.speed_table", description=__doc__.split("\n")[0])
    p.add_argument("path", nargs="?", type=Path, default=DEFAULT)
    a = p.parse_args(argv)
    t = load(a.path)
    print(trl_table(t["trl"]), "", ratios(t["trl"]), "", profile_table(t["profile"]), "", memory_table(t["memory"]),
          "", openrlhf_table(t["openrlhf"]), "", openrlhf_actor_table(t["openrlhf_actor"]), sep="\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
