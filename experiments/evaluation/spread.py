"""The pass-rate spread of a chat model on the arithmetic task (experiments/tasks/arithmetic.py): how many training
prompts have a pass rate between 0.1 and 0.9 (:data:`BAND`), i.e. give GRPO a signal, sampled as the trl backend
samples. It loads the model (experiments.models.smollm2), so it lives here, above the task and the models.

    python -m experiments.evaluation.spread sweeps/presets/smollm2-trl-cpu.yaml --spread 100 16 \
        --json results/smollm2/spread-100x16-seed0.json

(results/smollm2/spread-100x16-seed0.json was made by the same options under ``python -m experiments.tasks.arithmetic``,
before the spread moved here.)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from experiments.tasks.arithmetic import split, write_files

BAND = (0.1, 0.9)
"""A prompt has signal for GRPO when its pass rate lies in this band (issue 33: at least half of the prompts)."""


def measure_spread(cfg, n_prompts: int, n_samples: int, seed: int = 0, batch: int = 8) -> dict:
    """Pass rates of the first ``n_prompts`` training problems, ``n_samples`` each, sampled as the trl backend samples
    them (transformers' generate on the float32 model, ``rollout.temperature``, top_p 1, top_k 0,
    ``rollout.max_new_tokens``), seeded; scored by the kit's math reward. Returns {"rows": per prompt
    {problem_id, family, pass}, "families": per family {prompts, mean, band, zero, one}, "all": the same overall,
    "seconds", "tokens"}."""
    import time

    import torch
    from tqdm import tqdm

    from experiments.models.smollm2 import load
    from experiments.rewards.math import score

    model, tok, _ = load(cfg.model.name, untie=cfg.model.untie_embeddings)
    model.eval()
    problems_ = split(cfg.task)["train"][:n_prompts]
    texts = [tok.apply_chat_template(p["prompt"], tokenize=False, add_generation_prompt=True) for p in problems_]
    rows, tokens, t0 = [], 0, time.perf_counter()
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        for i in tqdm(range(0, len(texts), batch), desc=f"spread {n_prompts} x {n_samples}", unit="batch"):
            enc = tok(texts[i : i + batch], return_tensors="pt", padding=True, padding_side="left",
                      add_special_tokens=False)  # fmt: skip
            out = model.generate(**enc, do_sample=True, temperature=cfg.rollout.temperature, top_p=1.0, top_k=0,
                                 max_new_tokens=cfg.rollout.max_new_tokens, num_return_sequences=n_samples)  # fmt: skip
            new = out[:, enc["input_ids"].shape[1] :]
            tokens += int((new != tok.pad_token_id).sum())
            answers = tok.batch_decode(new, skip_special_tokens=True)
            for j, prob in enumerate(problems_[i : i + batch]):
                got = [score(a, prob["label"]) for a in answers[j * n_samples : (j + 1) * n_samples]]
                fam = prob["problem_id"].rsplit("-", 1)[0]
                rows.append({"problem_id": prob["problem_id"], "family": fam, "pass": sum(got) / n_samples})
    seconds = time.perf_counter() - t0

    def summary(part):
        rates = [r["pass"] for r in part]
        n = max(len(rates), 1)
        return {"prompts": len(rates), "mean": sum(rates) / n, "band": sum(BAND[0] <= x <= BAND[1] for x in rates) / n,
                "zero": sum(x == 0 for x in rates) / n, "one": sum(x == 1 for x in rates) / n}  # fmt: skip

    families = {f: summary([r for r in rows if r["family"] == f]) for f in cfg.task.families}
    return {"rows": rows, "families": families, "all": summary(rows), "seconds": seconds, "tokens": tokens}


def spread_table(result: dict) -> str:
    lines = [
        "| family | prompts | mean pass | pass rate in [0.1, 0.9] | all wrong | all right |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in [*result["families"].items(), ("all", result["all"])]:
        lines.append(
            f"| {name} | {s['prompts']} | {s['mean']:.3f} | {s['band']:.2f} | {s['zero']:.2f} | {s['one']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from experiments.config import load_config
    from experiments.threads import set_threads

    p = argparse.ArgumentParser(prog="python -m experiments.evaluation.spread", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a RunConfig YAML with task.name arithmetic")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--spread", nargs=2, type=int, metavar=("PROMPTS", "SAMPLES"), required=True,
                   help="the first PROMPTS training problems, SAMPLES completions each")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the result (per-prompt rows, command, load)")
    args = p.parse_intermixed_args(sys.argv[1:] if argv is None else argv)  # overrides before or after options
    cfg = load_config(args.config, args.overrides)
    write_files(cfg.task)
    set_threads()
    result = measure_spread(cfg, *args.spread, seed=args.seed)
    print(spread_table(result))
    print(f"{result['seconds']:.0f} s, {result['tokens']} tokens ({result['tokens'] / result['seconds']:.0f}/s)")
    if args.json:
        command = " ".join(["python -m experiments.evaluation.spread", *(sys.argv[1:] if argv is None else argv)])
        record = {"command": command, "load_average": os.getloadavg(), **result}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
