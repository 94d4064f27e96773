"""The trl walk's score (docs/mechanism.md): the probe set, verified-correct completions of held-out problems sampled
once from the starting model, and the teacher-forced log-probability a policy gives them.

* :func:`make_probe_set`: verified-correct completions of held-out problems (rows of the arithmetic task's eval split
  after the ``eval.n_prompts`` a run evaluates), sampled from the starting model at the rollout temperature, seeded;
* :func:`score`: the teacher-forced log-probability at the rollout temperature of the probe set's completions (mean
  over completions of the sum over completion tokens, EOS included where there is one; and of the per-token mean).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from experiments.config import RunConfig

SCORE_BATCH = 8
"""Sequences per teacher-forced forward of the score."""


@dataclass(frozen=True)
class ProbeSet:
    """Verified-correct completions of held-out problems, as token ids."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    """Each completion's tokens up to and including its EOS, or its rollout.max_new_tokens tokens if it had none."""
    problem_ids: list[str]
    header: dict

    def __len__(self) -> int:
        return len(self.completion_ids)


def parse_range(text: str) -> tuple[int, int]:
    """``16-99`` -> (16, 100): rows 16 to 99 of the eval split, both included."""
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi)
    except ValueError:
        raise ValueError(f"--problems {text!r} is not valid; allowed: A-B, two row numbers with A <= B") from None
    if not sep or a < 0 or b < a:
        raise ValueError(f"--problems {text!r} is not valid; allowed: A-B, two row numbers with 0 <= A <= B")
    return a, b + 1


def held_out_rows(cfg: RunConfig, lo: int, hi: int) -> list[dict]:
    """Rows ``lo:hi`` of the arithmetic task's eval split, refused (ValueError) unless they are disjoint from the
    run's training problems (by construction) and from the eval problems a run scores (the first eval.n_prompts)."""
    from experiments.rundir import read_jsonl
    from experiments.tasks.arithmetic import write_files

    if cfg.task.name != "arithmetic":
        raise ValueError(f"task.name={cfg.task.name!r}: allowed: arithmetic (the probe set's problems are its rows)")
    if lo < cfg.eval.n_prompts:
        raise ValueError(
            f"--problems {lo}-{hi - 1}: rows below eval.n_prompts={cfg.eval.n_prompts} are the run's own eval "
            f"problems; allowed: {cfg.eval.n_prompts} <= A <= B < task.n_eval={cfg.task.n_eval}"
        )
    if hi > cfg.task.n_eval:
        raise ValueError(f"--problems {lo}-{hi - 1}: allowed: B < task.n_eval={cfg.task.n_eval}")
    files = write_files(cfg.task)
    rows = read_jsonl(files["eval"])[lo:hi]
    train = {r["problem_id"] for r in read_jsonl(files["train"])}
    if train & {r["problem_id"] for r in rows}:  # a backstop: the split makes them disjoint
        raise ValueError(f"--problems {lo}-{hi - 1}: rows overlap the training problems")
    return rows


def _prompt_ids(tok, messages) -> list[int]:
    """The prompt's tokens as the run's evaluation tokenizes a chat (experiments.trl.generate)."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def make_probe_set(
    cfg: RunConfig, lo: int, hi: int, samples: int, keep: int, seed: int, verify=None
) -> tuple[list[dict], dict]:
    """(rows, summary): up to ``keep`` distinct correct completions of each held-out problem ``lo:hi``, sampled from
    cfg's starting model at the rollout temperature (``samples`` per problem, torch seeded from ``seed``); a completion
    is its tokens up to its first EOS (included) or all rollout.max_new_tokens of them (the rollout's own cut; ``eos``
    says which), kept if the kit's math reward scores it 1 (``verify(text, label)``: another check, for tests on a
    model that cannot answer)."""
    from experiments.models.smollm2 import load
    from experiments.tasks.arithmetic import key as task_key
    from nsr.seeds import derive_seed

    rows = held_out_rows(cfg, lo, hi)
    model, tok, info = load(cfg.model.name, untie=cfg.model.untie_embeddings)
    model.eval()
    eos = tok.eos_token_id
    out, correct, sampled = [], 0, 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "trl-probe-set"))
        for r in rows:
            pids = _prompt_ids(tok, r["prompt"])
            ids = model.generate(
                input_ids=torch.tensor([pids]),
                attention_mask=torch.ones(1, len(pids), dtype=torch.long),
                max_new_tokens=cfg.rollout.max_new_tokens,
                num_return_sequences=samples,
                do_sample=True,
                temperature=cfg.rollout.temperature,
                top_p=1.0,
                top_k=0,
                pad_token_id=tok.pad_token_id,
            )[:, len(pids) :].tolist()
            seen: set[tuple[int, ...]] = set()
            for c in ids:
                sampled += 1
                c = c[: c.index(eos) + 1] if eos in c else c  # as the rollout: to EOS, or cut at max_new_tokens
                ok = (verify or _math_correct)(tok.decode(c, skip_special_tokens=True), r["label"])
                correct += ok
                if ok and tuple(c) not in seen and len(seen) < keep:
                    seen.add(tuple(c))
                    out.append(
                        {
                            "problem_id": r["problem_id"],
                            "label": r["label"],
                            "prompt_ids": pids,
                            "completion_ids": c,
                            "eos": c[-1] == eos,
                            "completion": tok.decode(c, skip_special_tokens=True),
                        }
                    )
    summary = {
        "model": {k: info[k] for k in ("name", "weights_sha256", "untied")},
        "task_key": task_key(cfg.task),
        "problems": [lo, hi - 1],
        "problem_ids": [r["problem_id"] for r in rows],
        "samples": samples,
        "keep": keep,
        "seed": seed,
        "temperature": cfg.rollout.temperature,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "sampled": sampled,
        "correct": correct,
        "kept": len(out),
        "problems_kept": len({r["problem_id"] for r in out}),
    }
    return out, summary


def _math_correct(text: str, label: str) -> bool:
    from experiments.rewards.math import score as math_score

    return math_score(text, label) == 1.0


def read_probe_set(path: str | Path) -> ProbeSet:
    """The probe set written by ``make-set`` (ValueError naming the file if it has no header or no completion)."""
    lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    heads = [r["header"] for r in lines if "header" in r]
    rows = [r for r in lines if "header" not in r]
    if len(heads) != 1 or not rows:
        raise ValueError(f"--probe-set {path}: allowed: a file of make-set (one header line, at least one completion)")
    return ProbeSet(
        [r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows], [r["problem_id"] for r in rows], heads[0]
    )


def check_probe_set(pset: ProbeSet, cfg: RunConfig, model_info: dict | None) -> None:
    """The probe set belongs to this run: the same task and starting model, its problems held out (ValueError)."""
    from experiments.tasks.arithmetic import key as task_key

    h = pset.header
    if h.get("task_key") != task_key(cfg.task):
        raise ValueError(f"--probe-set: made for task key {h.get('task_key')}, the run's is {task_key(cfg.task)}")
    if model_info is not None and h["model"]["weights_sha256"] != model_info["weights_sha256"]:
        raise ValueError("--probe-set: made from other starting weights than the run's (model.weights_sha256 differs)")
    lo, hi = h["problems"]
    held_out_rows(cfg, lo, hi + 1)


# ------------------------------------------------------------------------------------------------ the score
@torch.no_grad()
def score(model, pset: ProbeSet, temperature: float, batch: int = SCORE_BATCH) -> tuple[float, float]:
    """(mean over completions of sum log p, mean over completions of mean log p per token): the teacher-forced
    log-probability of each completion (its EOS included) given its prompt, at ``temperature`` (logits / temperature, as
    the rollout samples), in the model's dtype, eval mode (no dropout); the model's mode is restored."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sums, means = [], []
    for i in range(0, len(pset), batch):
        seqs = [p + c for p, c in zip(pset.prompt_ids[i : i + batch], pset.completion_ids[i : i + batch])]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        att = torch.zeros(len(seqs), width, dtype=torch.long)
        comp = torch.zeros(len(seqs), width - 1, dtype=torch.bool)  # position t predicts token t + 1
        for j, (s, p) in enumerate(zip(seqs, pset.prompt_ids[i : i + batch])):
            ids[j, : len(s)] = torch.tensor(s)
            att[j, : len(s)] = 1
            comp[j, len(p) - 1 : len(s) - 1] = True
        logits = model(input_ids=ids.to(device), attention_mask=att.to(device), use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits.float() / temperature, -1)
        tok = logp.gather(-1, ids[:, 1:, None].to(device)).squeeze(-1).cpu()
        del logits, logp
        s = (tok * comp).sum(1)
        sums += s.double().tolist()
        means += (s / comp.sum(1)).double().tolist()
    model.train(was_training)
    return float(np.mean(sums)), float(np.mean(means))
