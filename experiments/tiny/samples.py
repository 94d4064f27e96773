"""What a tiny policy writes: the outcome shares and the most common completions of a run's checkpoint.

A reward curve says that a run went wrong, not how; this says what the policy samples on held-out prompts::

    python -m experiments.run sweeps/presets/tiny.yaml loss.rule=gppo train.steps=60 \\
        logging.keep_checkpoint=true --out /tmp/gppo60                    # any tiny run with a kept checkpoint
    python -m experiments.tiny.samples /tmp/gppo60 [--prompts 256 --samples 4 --seed 0 --top 5]

Outcomes (``experiments.tasks.countdown.OUTCOMES``): correct; on Countdown a wrong answer is ``wrong_value`` (the
prompt's digits, another value) or ``wrong_digits`` (digits the prompt does not have); ``malformed`` (no answer
stated); ``no_eos``. Prompts are a seeded draw from the held-out split; samples at the run's rollout temperature from a
generator seeded by ``--seed``, so the same folder and seed give the same table.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

from experiments.config import ConfigError, load_config
from experiments.models.tiny import build_model, generate
from experiments.rundir import RunDir
from experiments.tasks.countdown import OUTCOMES, Task, decode, get_task
from experiments.threads import set_threads
from nsr.seeds import generator


def outcomes(
    model: torch.nn.Module,
    task: Task,
    ids: torch.Tensor,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    gen: torch.Generator,
) -> tuple[dict[str, float], list[tuple[str, int]]]:
    """Sample ``samples`` completions per problem id; return (share of each outcome, completions by count).

    A completion is its text up to EOS, or ``"<no eos>"``. Shares cover every outcome of ``OUTCOMES`` (0 if absent).
    """
    model.eval()
    comps = generate(model, task.prompts(ids).repeat_interleave(samples, 0), max_new_tokens, temperature, gen)
    kinds: Counter = Counter()
    texts: Counter = Counter()
    for pid, c in zip(ids.repeat_interleave(samples).tolist(), comps.tolist()):
        text = decode(c)
        kinds[task.outcome(pid, text)] += 1
        texts["<no eos>" if text is None else text] += 1
    n = len(comps)
    return {k: kinds[k] / n for k in OUTCOMES}, texts.most_common()


def load_policy(folder: Path) -> tuple[torch.nn.Module, object, int]:
    """(model, RunConfig, step) of a tiny run folder's checkpoint; ValueError saying what is missing."""
    rd = RunDir(folder)
    if not rd.config_path.is_file():
        raise ValueError(f"{folder}: no config.yaml (not a run folder)")
    try:
        cfg = load_config(rd.config_path)  # a run's config.yaml: its meta section is set aside
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if cfg.backend != "tiny":
        raise ValueError(f"{folder}: backend is {cfg.backend!r}; this reads tiny runs only (backend: tiny)")
    if not rd.checkpoint_path.exists():
        raise ValueError(
            f"{folder}: no checkpoint ({rd.checkpoint_path.name}); a done run deletes it unless it ran with "
            "logging.keep_checkpoint=true (rerun with that override into a new --out)"
        )
    ck = torch.load(rd.checkpoint_path, weights_only=True)
    model = build_model(cfg.model, generator(cfg.sft.seed, "sft-init"))
    model.load_state_dict(ck["model"])
    return model, cfg, int(ck["step"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.tiny.samples", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("folder", type=Path, help="a tiny run folder with a checkpoint (logging.keep_checkpoint=true)")
    ap.add_argument("--prompts", type=int, default=256, help="held-out prompts (default 256)")
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt (default 4)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt draw and of sampling (default 0)")
    ap.add_argument("--top", type=int, default=5, help="most common completions to list (default 5)")
    a = ap.parse_args(argv)
    for name in ("prompts", "samples"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    try:
        model, cfg, step = load_policy(a.folder)
        task = get_task(cfg.task.name)
        ids = task.eval_set(a.prompts, a.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    set_threads()
    shares, common = outcomes(
        model,
        task,
        ids,
        a.samples,
        cfg.rollout.max_new_tokens,
        cfg.rollout.temperature,
        generator(a.seed, "samples"),
    )
    n = len(ids) * a.samples
    print(f"{a.folder} (rule {cfg.loss.rule}, step {step}): {n} samples, {len(ids)} held-out {task.name} prompts")
    for k, v in shares.items():
        if v or k in ("correct", "malformed", "no_eos"):
            print(f"  {k:<13} {v:.3f}")
    print("  most common: " + ", ".join(f"{t!r} x{c}" for t, c in common[: a.top]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
