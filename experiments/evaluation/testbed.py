"""Evaluation on a fixed, seeded set of held-out problems; one eval.jsonl row per (problem, decoding, sample).

The prompt set depends only on (task, eval.n_prompts, eval.seed), so every run of a grid is scored on the same
problems, and the sampling generator only on (eval.seed, step), so arms are paired sample for sample. Greedy
accuracy, sampled accuracy and unbiased pass@k are recomputed downstream from the raw 0/1 labels.
"""

from __future__ import annotations

import torch

from experiments.config import RunConfig
from experiments.models.tiny import generate
from experiments.tasks.countdown import Task
from nsr.seeds import generator


def evaluate(model: torch.nn.Module, task: Task, cfg: RunConfig, step: int) -> list[dict]:
    """Rows ``{step, benchmark, problem_id, decoding, sample, correct}`` for greedy (sample 0) and sampled decoding.

    Sampled decoding draws ``eval.n_samples`` completions per prompt at ``eval.temperature``.
    """
    e = cfg.eval
    ids = task.eval_set(e.n_prompts, e.seed)
    if len(ids) == 0:
        return []
    prompts = task.prompts(ids)
    max_new = cfg.rollout.max_new_tokens
    rows: list[dict] = []
    model.eval()
    if e.greedy:
        comps = generate(model, prompts, max_new, greedy=True)
        rows += eval_rows(task, step, "greedy", ids, comps)
    if e.n_samples:
        k = e.n_samples
        comps = generate(
            model, prompts.repeat_interleave(k, 0), max_new, e.temperature, generator(e.seed, step, "eval")
        )
        rows += eval_rows(task, step, "sampled", ids, comps, k)
    return rows


def eval_rows(task: Task, step: int, decoding: str, ids: torch.Tensor, comps: torch.Tensor, k: int = 1) -> list[dict]:
    """The eval.jsonl rows of one decoding: ``comps`` holds ``k`` completions of each problem of ``ids`` in a row
    (prompts repeated with ``repeat_interleave``), sample numbers 0 .. k - 1 (greedy: k = 1, sample 0)."""
    pids = ids.repeat_interleave(k) if k > 1 else ids
    samples = torch.arange(k).repeat(len(ids))
    correct = task.rewards(pids, comps).long().tolist()
    return [
        {"step": step, "benchmark": task.name, "problem_id": pid, "decoding": decoding, "sample": j, "correct": c}
        for pid, j, c in zip(pids.tolist(), samples.tolist(), correct)
    ]


def summary(rows: list[dict]) -> dict[str, float]:
    """Mean accuracy per decoding of a list of eval rows (for progress output and quick checks)."""
    out: dict[str, list[int]] = {}
    for r in rows:
        out.setdefault(r["decoding"], []).append(r["correct"])
    return {k: sum(v) / len(v) for k, v in out.items()}
