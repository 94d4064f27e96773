"""The per-update gate on the trl backend (stage R1, docs/drafts/stage_r1.md), its trainer-side parts: the probe set,
the score, and saving / replaying / restoring one RL step of NSRGRPOTrainer in memory. The walk and its command are
``python -m experiments.mechanism_trl`` (above the backends: it drives experiments.run); its doc has the design.

* :func:`make_probe_set`: verified-correct completions of held-out problems (rows of the arithmetic task's eval split
  after the ``eval.n_prompts`` a run evaluates), sampled from the starting model at the rollout temperature, seeded;
* :func:`score`: the teacher-forced log-probability at the rollout temperature of the probe set's completions (mean
  over completions of the sum over completion tokens, EOS included where there is one; and of the per-token mean);
* :func:`snapshot` / :func:`restore`: weights, AdamW and scheduler state, every RNG state, the trainer's metric buffers
  and premise meter, micro-step and optimizer-step counters, copied in host memory and put back exactly;
* :func:`replay`: one RL step's updates with another rule on the trainer's buffered rollout, as transformers' loop
  does them (NSRGRPOTrainer.replaying: no generation);
* :class:`Prober`: the ``before_step(step, trainer)`` hook (NSRGRPOTrainer.after_rollout) that does the above at the
  probed steps and scores the baseline's own (hard) update at the end of the step.
"""

from __future__ import annotations

import copy
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import TrainerCallback

from experiments.config import RunConfig

SCORE_BATCH = 8
"""Sequences per teacher-forced forward of the score."""


# ------------------------------------------------------------------------------------------------ the probe set
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


# ------------------------------------------------------------------------------------------------ save, replay, restore
@dataclass
class Snapshot:
    """What one RL step's updates change in an NSRGRPOTrainer, copied (host memory)."""

    weights: dict
    optimizer: dict
    scheduler: dict
    rng: tuple
    metrics: dict
    premise: object
    step: int
    global_step: int
    loss: object
    accumulation: int
    sync_gradients: bool
    step_time: float


def snapshot(tr) -> Snapshot:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return Snapshot(
        weights={k: v.detach().clone() for k, v in tr.model.state_dict().items()},
        optimizer=copy.deepcopy(tr.optimizer.state_dict()),
        scheduler=copy.deepcopy(tr.lr_scheduler.state_dict()),
        rng=(torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()),
        metrics=copy.deepcopy(tr._metrics),
        premise=copy.deepcopy(tr.premise),
        step=tr._step,
        global_step=tr.state.global_step,
        loss=tr.nsr_loss,
        accumulation=tr.current_gradient_accumulation_steps,
        sync_gradients=tr.accelerator.gradient_state.sync_gradients,
        step_time=tr._current_train_step_time,
    )


def restore(tr, snap: Snapshot) -> None:
    """Put ``snap`` back exactly (the optimizer state from a fresh copy: load_state_dict keeps the tensors it gets)."""
    tr.model.zero_grad()
    tr.model.load_state_dict(snap.weights)
    tr.optimizer.load_state_dict(copy.deepcopy(snap.optimizer))
    tr.lr_scheduler.load_state_dict(copy.deepcopy(snap.scheduler))
    cpu, cuda, py, npy = snap.rng
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(npy)
    tr._metrics = copy.deepcopy(snap.metrics)
    tr.premise = copy.deepcopy(snap.premise)
    tr._step, tr.state.global_step, tr.nsr_loss = snap.step, snap.global_step, snap.loss
    tr.current_gradient_accumulation_steps = snap.accumulation
    tr.accelerator.gradient_state._set_sync_gradients(snap.sync_gradients)
    tr._current_train_step_time = snap.step_time


def replay(tr, loss) -> dict[str, float]:
    """One RL step's updates with rule ``loss`` on the trainer's buffered rollout, as transformers' Trainer loop does
    them (its training_step per micro-batch; at each accumulation boundary the gradient clip, the optimizer step, the
    scheduler step, zero_grad and global_step + 1). Returns the update's clip_frac, rescue_frac (means over its
    micro-batches), grad_norm (mean over its optimizer steps) and dose (:func:`clipped_weight`). The trainer is left
    changed: restore() it."""
    ga = tr.args.gradient_accumulation_steps
    micro_steps = tr.args.steps_per_generation * tr.num_iterations
    start = {k: len(v) for k, v in tr._metrics["train"].items()}
    weight0, tokens0 = clipped_weight(tr)
    model = tr.model_wrapped if tr.model_wrapped is not None else tr.model
    norms = []
    tr.nsr_loss = loss
    tr.replaying = True
    try:
        for i in range(micro_steps):
            tr.current_gradient_accumulation_steps = ga
            boundary = (i + 1) % ga == 0
            tr.accelerator.gradient_state._set_sync_gradients(boundary)
            tr.training_step(model, {}, None)  # TRL's GRPO batches carry no labels: num_items_in_batch is None
            if boundary:
                if tr.args.max_grad_norm > 0:
                    norms.append(float(tr._clip_grad_norm(model)))
                tr.optimizer.step()
                tr.lr_scheduler.step()
                model.zero_grad()
                tr.state.global_step += 1
    finally:
        tr.replaying = False

    def new(key):
        return tr._metrics["train"][key][start.get(key, 0) :]

    weight, tokens = clipped_weight(tr)
    return {
        "clip_frac": float(np.mean(new("nsr/clip_frac"))),
        "rescue_frac": float(np.mean(new("nsr/rescue_frac"))),
        "grad_norm": float(np.mean(norms)) if norms else math.nan,
        "dose": (weight - weight0) / (tokens - tokens0) if tokens > tokens0 else math.nan,
    }


def clipped_weight(tr) -> tuple[float, float]:
    """(gradient weight the premise meter has seen on clipped tokens, valid tokens it has seen) in its current window;
    (nan, 0) without a meter. The dose of an update (the toy's, experiments.mechanism_probe._dose) is the change of
    the first over the change of the second: the weight on clipped tokens relative to the unclipped gradient, per
    valid token."""
    if tr.premise is None:
        return math.nan, 0.0
    return float(tr.premise.counts()[:, 2].sum()), float(tr.premise.tokens)


def weights_digest(model) -> str:
    """The first 16 hex digits of the weights' sha256 as a run records it (experiments.models.smollm2.weights_sha256):
    equal digests, identical weights."""
    from experiments.models.smollm2 import weights_sha256

    return weights_sha256(model)[:16]


def update_norm(model, before: dict) -> float:
    """L2 norm of the weight change from ``before`` (a state dict) to ``model``'s parameters."""
    total = 0.0
    for name, p in model.named_parameters():
        total += float((p.detach() - before[name]).double().pow(2).sum())
    return math.sqrt(total)


# ------------------------------------------------------------------------------------------------ the walk
class Prober:
    """The ``before_step(step, trainer)`` hook of a probed trl run (experiments.run): probes the RL steps in
    ``steps`` (module doc) and calls ``on_state(line)`` with each state's line once the RL step has ended."""

    def __init__(
        self, specs, steps, pset: ProbeSet, temperature: float, on_state, check_replay=False, run=0, progress=False
    ):
        self.progress = progress
        self.wall: dict = {}
        self.specs = [s for s in specs if s.label != "hard"]
        self.hard = next(s for s in specs if s.label == "hard")
        self.steps, self.pset, self.temperature = set(steps), pset, temperature
        self.on_state, self.check_replay, self.run = on_state, check_replay, run
        self.pending: dict | None = None
        self.trainer = None

    def _score(self, model) -> tuple[float, float]:
        t0 = time.perf_counter()
        out = score(model, self.pset, self.temperature)
        self._time("score", t0)
        return out

    def _time(self, what: str, t0: float) -> None:
        """Wall-clock seconds of each part of a probed state (the line's ``wall_s``; printed with progress)."""
        self.wall.setdefault(what, []).append(round(time.perf_counter() - t0, 2))
        if self.progress:
            print(f"probe: {what} {self.wall[what][-1]:.1f} s", file=sys.stderr, flush=True)

    def __call__(self, step: int, tr) -> None:
        if self.trainer is None:
            self.trainer = tr
            tr.add_callback(_StepEnd(self))
        if step not in self.steps:
            return
        self.wall = {}
        before, before_tok = self._score(tr.model)
        t0 = time.perf_counter()
        snap = snapshot(tr)
        self._time("snapshot", t0)
        after, after_tok, metrics, digest = {}, {}, {}, {}
        runs = ([RuleSpecLike("hard_replay", self.hard.loss)] if self.check_replay else []) + self.specs
        for spec in runs:
            t0 = time.perf_counter()
            met = replay(tr, spec.loss)
            self._time(f"replay_{spec.label}", t0)
            after[spec.label], after_tok[spec.label] = self._score(tr.model)
            t0 = time.perf_counter()
            digest[spec.label] = weights_digest(tr.model)
            metrics[spec.label] = {**met, "update_norm": update_norm(tr.model, snap.weights)}
            restore(tr, snap)
            self._time("digest_restore", t0)
        self.pending = {
            "step": step,
            "before": before,
            "before_tok": before_tok,
            "after": after,
            "after_tok": after_tok,
            "metrics": metrics,
            "digest": digest,
            "weights": snap.weights,
            "loss": tr.nsr_loss,
        }

    def finish(self, tr) -> None:
        """At the end of the pending state's RL step: hard's score is the baseline's own next state."""
        p, self.pending = self.pending, None
        logs = tr._metrics["train"]
        after, after_tok = self._score(tr.model)
        hard = {
            "clip_frac": float(np.mean(logs["nsr/clip_frac"])) if logs.get("nsr/clip_frac") else math.nan,
            "rescue_frac": float(np.mean(logs["nsr/rescue_frac"])) if logs.get("nsr/rescue_frac") else math.nan,
            "grad_norm": math.nan,
            "dose": (lambda w, t: w / t if t > 0 else math.nan)(*clipped_weight(tr)),
            "update_norm": update_norm(tr.model, p["weights"]),
        }
        digest = {"hard": weights_digest(tr.model), **p["digest"]}
        labels = ["hard", *p["after"]]
        line = {
            "run": self.run,
            "seed": tr.nsr_seed,
            "sft_seed": -1,
            "step": p["step"],
            "before": p["before"],
            "after": {"hard": after, **p["after"]},
            "before_tok": p["before_tok"],
            "after_tok": {"hard": after_tok, **p["after_tok"]},
            "train_before": math.nan,
            "train_after": {k: math.nan for k in labels},
            "metrics": {"hard": hard, **p["metrics"]},
            "digest": digest,
            "same_as_hard": {k: digest[k] == digest["hard"] for k in labels if k != "hard"},
            "n_completions": len(self.pset),
            "wall_s": self.wall,
        }
        self.on_state(line)


@dataclass(frozen=True)
class RuleSpecLike:
    label: str
    loss: object


class _StepEnd(TrainerCallback):
    """Finishes the prober's pending state at the end of its RL step (the last of its optimizer steps)."""

    def __init__(self, prober: Prober):
        self.prober = prober

    def on_step_end(self, args, state, control, **kwargs):
        tr = self.prober.trainer
        k = tr.args.steps_per_generation * tr.num_iterations // tr.args.gradient_accumulation_steps
        if self.prober.pending is not None and state.global_step % k == 0:
            self.prober.finish(tr)
