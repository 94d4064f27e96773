"""The per-update gate on the trl backend (stage R1, docs/drafts/stage_r1.md): does what a rule adds to a hard-clip
update raise the log-probability of correct answers, update by update, on a real language model?

The toy's gate (experiments/mechanism_probe.py) walks a hard baseline run and, at chosen states, applies one RL step
of every rule from the same state. Here the same on TRL's loop (nsr.trl.NSRGRPOTrainer), in process: a state of
SmolLM2 (weights + AdamW state) is 1.6 GB, so none is saved to disk.

Two commands:

    python -m experiments.trl.probe make-set --sweep regime_r1 --problems 16-99 --samples 8 --keep 2 --seed 0 \\
        --out results/mechanism/r1/probe_set.jsonl
    python -m experiments.trl.probe walk --sweep regime_r1 --seeds 21-28 --rules soft,nsr --start 5 --every 5 \\
        --states 80 --probe-set results/mechanism/r1/probe_set.jsonl --out 'results/mechanism/r1/s{seed}.jsonl'
    python -m analysis.mechanism 'results/mechanism/r1/s*.jsonl' --gate soft --split held-out

``make-set``: the probe set, made once before any walk from the starting model: for each held-out problem (rows
``--problems A-B`` of the task's eval split, which must lie after the ``eval.n_prompts`` rows a run evaluates, so they
are disjoint from its training and its eval problems), ``--samples`` completions sampled at the rollout temperature
(seeded from ``--seed``), kept (at most ``--keep`` per problem) if they end with EOS and the kit's math reward scores
them 1. Written with its token ids, a header line (git commit, command, model hash, task key, problems).

``walk``: a hard baseline run on the trl backend, written into its run folder exactly as ``python -m experiments.run``
writes it (the same metrics.jsonl, ratio_bins.jsonl, eval.jsonl; wall-clock fields aside: tests/test_trl_probe.py),
probed at RL steps ``--start, --start + --every, ...`` (``--states`` over the seeds). At a probed step, after its
rollout is generated, scored and split into minibatches (NSRGRPOTrainer.after_rollout) and before its first update:

1. score the policy (``before``);
2. save weights, AdamW and scheduler state, every RNG state, the trainer's metric buffers and premise meter, in memory;
3. for each probed rule (``--rules``: soft, nsr, ...), replay the step's updates with that rule: every micro-batch of
   the SAME buffered rollout in the same order, the same loss noise streams (seeded from the run's seed, optimizer step
   and micro-step), the trainer's own training_step, gradient clip, AdamW step and scheduler step; score the result
   (``after[rule]``), then restore the saved state exactly;
4. let the trainer do its own (hard) update; at the end of the RL step score the policy: ``after["hard"]``, the
   baseline's own next state.

The score (:func:`score`) is the teacher-forced log-probability at the rollout temperature of the probe set's
completions given their prompts: ``before`` / ``after`` the mean over completions of the sum over completion tokens
(EOS included), ``before_tok`` / ``after_tok`` the mean over completions of the per-token mean. Each line also has,
per rule, the update's clip / rescue fractions and gradient norm (means over its micro-batches / optimizer steps), the
norm of its weight change and a digest of the weights after it (``same_as_hard``: the rule's update left exactly the
weights hard's did). ``--check-replay`` also replays hard (label ``hard_replay``): its digest must equal the
baseline's (the replay is the trainer's update).

The file is the toy's format (a header line, then one line per state: ``run``, ``seed``, ``step``, ``before``,
``after``, ``metrics``; the training-split fields are NaN), so ``python -m analysis.mechanism FILES --gate RULE
--split held-out`` reads it. A stopped walk is rerun with the same command: an unfinished run resumes from its TRL
checkpoint and its file keeps the states up to it; a done run with a complete file is skipped.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
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

from experiments.config import ConfigError, RunConfig, load_config

SCORE_BATCH = 8
"""Sequences per teacher-forced forward of the score."""


# ------------------------------------------------------------------------------------------------ the probe set
@dataclass(frozen=True)
class ProbeSet:
    """Verified-correct completions of held-out problems, as token ids."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    """Each completion's tokens up to and including its EOS."""
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
    is kept if it ends with EOS within rollout.max_new_tokens and the kit's math reward scores it 1 (``verify(text,
    label)``: another check, for tests on a model that cannot answer)."""
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
                if eos not in c:
                    continue
                c = c[: c.index(eos) + 1]
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
    from analysis.mechanism_stats import load_lines

    lines = load_lines(path)
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
    log-probability of each completion (EOS included) given its prompt, at ``temperature`` (logits / temperature, as
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
    micro-batches) and grad_norm (mean over its optimizer steps). The trainer is left changed: restore() it."""
    ga = tr.args.gradient_accumulation_steps
    micro_steps = tr.args.steps_per_generation * tr.num_iterations
    start = {k: len(v) for k, v in tr._metrics["train"].items()}
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

    return {
        "clip_frac": float(np.mean(new("nsr/clip_frac"))),
        "rescue_frac": float(np.mean(new("nsr/rescue_frac"))),
        "grad_norm": float(np.mean(norms)) if norms else math.nan,
    }


def weights_digest(model) -> str:
    """sha256 of every parameter's bytes, in named order (equal digests: identical weights)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


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

    def __init__(self, specs, steps, pset: ProbeSet, temperature: float, on_state, check_replay=False, run=0):
        self.specs = [s for s in specs if s.label != "hard"]
        self.hard = next(s for s in specs if s.label == "hard")
        self.steps, self.pset, self.temperature = set(steps), pset, temperature
        self.on_state, self.check_replay, self.run = on_state, check_replay, run
        self.pending: dict | None = None
        self.trainer = None

    def _score(self, model) -> tuple[float, float]:
        return score(model, self.pset, self.temperature)

    def __call__(self, step: int, tr) -> None:
        if self.trainer is None:
            self.trainer = tr
            tr.add_callback(_StepEnd(self))
        if step not in self.steps:
            return
        before, before_tok = self._score(tr.model)
        snap = snapshot(tr)
        after, after_tok, metrics, digest = {}, {}, {}, {}
        runs = ([RuleSpecLike("hard_replay", self.hard.loss)] if self.check_replay else []) + self.specs
        for spec in runs:
            met = replay(tr, spec.loss)
            after[spec.label], after_tok[spec.label] = self._score(tr.model)
            digest[spec.label] = weights_digest(tr.model)
            metrics[spec.label] = {**met, "update_norm": update_norm(tr.model, snap.weights)}
            restore(tr, snap)
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


def walk_run(
    cfg: RunConfig,
    run_dir: str | Path,
    specs,
    steps: list[int],
    pset: ProbeSet,
    out: str | Path,
    *,
    run: int = 0,
    run_id: str | None = None,
    meta: dict | None = None,
    command: str = "",
    check_replay: bool = False,
    progress: bool = False,
) -> list[dict]:
    """Run ``cfg`` (hard) into ``run_dir`` as experiments.run does, probing RL steps ``steps``; each state's line is
    appended to ``out`` when its RL step ends (after a header line). An unfinished folder resumes from its
    checkpoint and ``out`` keeps the states up to it; a done folder whose file holds every state is skipped."""
    from experiments.mechanism_probe import _read_lines, header
    from experiments.run import run as run_cfg
    from experiments.rundir import RunDir, append_jsonl, atomic_write_text, git_info

    if cfg.backend != "trl" or cfg.loss.rule != "hard":
        raise ValueError(f"backend={cfg.backend!r}, loss.rule={cfg.loss.rule!r}: allowed: backend trl, rule hard")
    bad = [s for s in steps if not 1 <= s <= cfg.train.steps]
    if bad:
        raise ValueError(f"probed steps {bad}: allowed: 1 <= step <= train.steps={cfg.train.steps}")
    rd, out = RunDir(run_dir), Path(out)
    lines = _read_lines(out)
    have = [r for r in lines if "header" not in r]
    if rd.path.exists() and rd.state() == "done":
        missing = sorted(set(steps) - {r["step"] for r in have})
        if not missing:
            print(f"{rd.path} done and {out} complete; skipped", file=sys.stderr)
            return have
        raise ValueError(
            f"{rd.path} is done but {out} lacks the states of steps {missing}; allowed: a done run with "
            "its complete file (nothing is rerun over a finished run; remove both to walk it again)"
        )
    resume = _resume_step(rd, cfg) if rd.path.exists() else 0
    kept = [r for r in have if r["step"] <= resume]
    git = git_info()
    head = header(
        command,
        git,
        run_id=run_id,
        seed=cfg.seed,
        resumed_from_step=resume,
        rules=[s.label for s in specs],
        probe_set=pset.header,
        n_completions=len(pset),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in [*(r for r in lines if "header" in r), *kept, head]))
    mine = list(kept)

    def sink(line):
        line["run"] = run
        append_jsonl(out, [line])
        mine.append(line)

    todo = sorted(set(steps) - {r["step"] for r in kept})
    prober = Prober(specs, todo, pset, cfg.rollout.temperature, sink, check_replay, run)
    checked = []

    def before_step(step, trainer):
        if not checked:  # the probe set's model and task are the run's (before any probe)
            check_probe_set(pset, cfg, getattr(trainer.model, "model_info", None))
            checked.append(True)
        prober(step, trainer)

    run_cfg(cfg, rd.path, run_id=run_id, meta={**(meta or {}), **git}, progress=progress, before_step=before_step)
    return mine


def _resume_step(rd, cfg: RunConfig) -> int:
    from experiments.trl.train import latest_checkpoint, optimizer_steps_per_rl_step

    ck = latest_checkpoint(rd)
    return int(ck.name.split("-")[1]) // optimizer_steps_per_rl_step(cfg) if ck is not None else 0


# ------------------------------------------------------------------------------------------------ CLI
def _command(argv: list[str] | None) -> str:
    import shlex

    return shlex.join(["python", "-m", "experiments.trl.probe", *(sys.argv[1:] if argv is None else argv)])


def _configs(a) -> list[tuple[RunConfig, str | None, dict, Path | None]]:
    """(config, run id, meta, run folder) of each baseline run: the sweep's hard run of each --seeds, or --preset with
    overrides (one run, --run-dir)."""
    from experiments.mechanism_probe import baseline_specs, parse_seeds

    if a.sweep:
        if a.preset or a.overrides:
            raise ValueError("--sweep takes its configs from the sweep; allowed with it: no --preset, no overrides")
        if not a.seeds and a.cmd == "make-set":  # the set depends on the model and task, not on the seed
            from experiments.sweep import expand, load_sweep

            first = next(s for s in expand(load_sweep(a.sweep)) if s.config.loss.rule == "hard")
            return [(first.config, first.run_id, first.meta, None)]
        if not a.seeds:
            raise ValueError("--sweep needs --seeds (e.g. 21-28)")
        from experiments.rundir import RUNS_ROOT

        root = Path(a.runs_root) if a.runs_root else RUNS_ROOT
        return [
            (s.config, s.run_id, s.meta, root / s.sweep / s.run_id)
            for s in baseline_specs(a.sweep, parse_seeds(a.seeds))
        ]
    if not a.preset:
        raise ValueError("allowed: --sweep SWEEP --seeds ... or --preset FILE [key=value ...]")
    if a.seeds:
        raise ValueError("--seeds goes with --sweep; allowed with --preset: seed=N as an override")
    rd = Path(a.run_dir) if getattr(a, "run_dir", None) else None
    return [(load_config(a.preset, a.overrides), None, {}, rd)]


COMMANDS = {
    "make-set": "write the probe set (once, before any walk)",
    "walk": "walk hard baseline run(s), probing rules at chosen RL steps",
}


def _parser(cmd: str) -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(prog=f"python -m experiments.trl.probe {cmd}", description=COMMANDS[cmd])
    s.add_argument("overrides", nargs="*", help="key=value overrides of --preset")
    s.add_argument("--sweep", help="the sweep whose hard runs are walked (make-set: its model and task)")
    s.add_argument("--seeds", help="with --sweep: the baseline runs' seeds, e.g. 21-28 or 21,22")
    s.add_argument("--preset", help="instead of --sweep: a preset file (one run; seed=N as an override)")
    s.add_argument("--out", required=True, help="output JSON-lines file (walk --sweep: a path with {seed})")
    s.add_argument("--quiet", action="store_true")
    if cmd == "make-set":
        s.add_argument("--problems", required=True, help="rows A-B of the task's eval split (A >= eval.n_prompts)")
        s.add_argument("--samples", type=int, default=8, help="completions sampled per problem (default 8)")
        s.add_argument("--keep", type=int, default=2, help="at most this many correct completions per problem")
        s.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    else:
        s.add_argument("--probe-set", required=True, help="the file of make-set")
        s.add_argument("--rules", default="soft,nsr", help="rules replayed at each state; hard is the baseline")
        s.add_argument("--start", type=int, default=1, help="first probed RL step")
        s.add_argument("--every", type=int, default=1, help="RL steps between probed states")
        s.add_argument("--states", type=int, default=1, help="probed states in all, spread over the seeds")
        s.add_argument("--runs-root", help="with --sweep: where run folders go (default results/runs)")
        s.add_argument("--run-dir", help="with --preset: the run folder")
        s.add_argument("--check-replay", action="store_true", help="also replay hard (label hard_replay)")
    return s


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] not in COMMANDS:
        p = argparse.ArgumentParser(
            prog="python -m experiments.trl.probe",
            description=__doc__.split("\n\n")[0],
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=__doc__.split("\n\n", 1)[1],
        )
        p.add_argument("command", choices=list(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
        p.parse_args(args[:1])  # --help, or an error naming the allowed commands
        return 2
    a = _parser(args[0]).parse_intermixed_args(args[1:])  # overrides may come after the options
    a.cmd = args[0]
    try:
        runs = _configs(a)
        return _make_set(a, runs[0][0], argv) if a.cmd == "make-set" else _walk(a, runs, argv)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _make_set(a, cfg: RunConfig, argv) -> int:
    from experiments.mechanism_probe import header
    from experiments.rundir import atomic_write_text, git_info
    from experiments.threads import set_threads

    lo, hi = parse_range(a.problems)
    for k, v in (("--samples", a.samples), ("--keep", a.keep)):
        if v < 1:
            raise ValueError(f"{k}={v} is not valid; allowed: an integer >= 1")
    out = Path(a.out)
    if out.exists():
        raise ValueError(f"--out {out} exists; allowed: a new file (a probe set is made once)")
    held_out_rows(cfg, lo, hi)  # refusals before the model loads
    set_threads()
    t0 = time.perf_counter()
    rows, summary = make_probe_set(cfg, lo, hi, a.samples, a.keep, a.seed)
    if not rows:
        raise ValueError(f"no correct completion in {summary['sampled']} samples; allowed: more --samples or problems")
    out.parent.mkdir(parents=True, exist_ok=True)
    head = header(_command(argv), git_info(), **summary)
    atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in [head, *rows]))
    print(
        f"{summary['kept']} completions of {summary['problems_kept']} problems ({summary['correct']} of "
        f"{summary['sampled']} samples correct) in {time.perf_counter() - t0:.0f} s -> {out}"
    )
    return 0


def _walk(a, runs, argv) -> int:
    from experiments.mechanism_probe import parse_rules, state_steps

    for k, v in (("--states", a.states), ("--start", a.start), ("--every", a.every)):
        if v < 1:
            raise ValueError(f"{k}={v} is not valid; allowed: an integer >= 1")
    if a.sweep and "{seed}" not in a.out:
        raise ValueError(f"--out {a.out!r} with --sweep: allowed: a path with {{seed}} (one file per run)")
    if not a.sweep and (a.run_dir is None):
        raise ValueError("--preset needs --run-dir (the baseline's run folder)")
    cfg0 = runs[0][0]
    specs = parse_rules(a.rules, cfg0.loss)
    plan = state_steps(a.states, len(runs), a.start, a.every, cfg0.train.steps)
    pset = read_probe_set(a.probe_set)
    for cfg, *_ in runs:  # every check before any work
        check_probe_set(pset, cfg, None)
    t0 = time.perf_counter()
    n = 0
    for i, ((cfg, run_id, meta, rd), steps) in enumerate(zip(runs, plan)):
        out = a.out.format(seed=cfg.seed) if a.sweep else a.out
        n += len(
            walk_run(
                cfg,
                rd,
                specs,
                steps,
                pset,
                out,
                run=i,
                run_id=run_id,
                meta=meta,
                command=_command(argv),
                check_replay=a.check_replay,
                progress=not a.quiet,
            )
        )
    print(
        f"{n} states of {len(runs)} run(s) in {time.perf_counter() - t0:.0f} s -> {a.out}\n"
        f"summary: python -m analysis.mechanism {a.out.replace('{seed}', '*')} --gate soft --split held-out"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
