"""The paired mechanism test (docs/evidence.md): does what a rule rescues improve the policy, update by update?

From states of a hard-clip baseline run (policy + optimizer), apply one RL step of every rule: the same rollout,
the same minibatches, the same noise stream (``experiments.tiny.train.rl_step`` with the run's seed and step, so
each rule sees exactly the draws the baseline saw), and score each updated policy by its exact expected pass@1 on
Countdown-3's held-out split. The correct answers of a Countdown-3 problem can be enumerated (``task.solutions``:
every ``d op d op d`` over the prompt's digits that hits the target), so the probability that one sampled
completion is correct is the sum, over them, of the teacher-forced probability of ``answer + EOS``; no sampling.

The difference rule - hard at the same state is a paired replicate; its mean over states says whether the signal
the rule adds to hard clipping improves the policy on average. This module measures and writes one JSON line per
state (``--out``); ``python -m analysis.mechanism FILE`` gives the Student-t intervals over states and over the
per-run means, and the stage-A2 gate (docs/evidence.md).

    python -m experiments.mechanism --states 300 --runs 3 --rules nsr,soft,widen --out mech.jsonl
    python -m experiments.mechanism --preset sweeps/presets/tiny-smoke.yaml --states 4 --runs 1 --every 2 \
        --out /tmp/mech.jsonl train.steps=8
    python -m analysis.mechanism mech.jsonl

Baseline runs: ``--runs N`` walks seeds seed, seed + 1, ...; ``--seeds 201-208`` names them; ``--tie-sft-seed``
gives each its own warm start (sft.seed = the run's seed), as the sweeps that tie them. Scores: exact pass@1 on the
task's held-out split and (unless ``--no-train-split``) on its training split; ``--no-held-out`` skips the first.
Any task whose correct answers can be enumerated (``Task.solutions``) can be tested.

Rules: any name of ``nsr.RULES``, with optional loss overrides ``name:key=value:...`` (e.g.
``noisy_decision:ratio_noise=0.3``), or ``widen`` = hard with eps_low and eps_high widened by the preset's delta
(``widen:by=0.05`` for another width). ``hard`` (the preset's own loss) is always run: it is the reference, and
its update is the baseline run's next state. Deterministic: every draw is seeded, one thread (NSR_THREADS).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import nsr
from experiments.config import ConfigError, RunConfig, load_config
from experiments.models.tiny import build_model
from experiments.rundir import append_jsonl
from experiments.sft import warm_start
from experiments.tasks.countdown import EOS, TASKS, Task, encode, get_task
from experiments.threads import set_threads
from experiments.tiny.train import rl_step
from nsr.seeds import generator

DEFAULT_PRESET = "sweeps/presets/tiny.yaml"


# ------------------------------------------------------------------------------------------------ exact pass@1
@dataclass(frozen=True)
class AnswerSet:
    """Every correct completion of a set of problems, as teacher-forcing inputs."""

    prompts: torch.Tensor
    """(M, prompt_len) prompt of each correct answer."""
    answers: torch.Tensor
    """(M, answer_len) answer tokens + EOS."""
    problem: torch.Tensor
    """(M,) index of the answer's problem in 0..n_problems-1."""
    n_problems: int


def answer_set(task: Task, ids: torch.Tensor) -> AnswerSet:
    """The enumerated correct answers of problems ``ids`` (ValueError if one has none: it would score 0)."""
    prompts, answers, problem = [], [], []
    for j, pid in enumerate(ids.tolist()):
        sols = task.solutions(pid)
        if not sols:
            raise ValueError(f"problem {pid} of {task.name} has no correct answer")
        for s in sols:
            answers.append(encode(s) + [EOS])
            problem.append(j)
        prompts.extend([pid] * len(sols))
    return AnswerSet(task.prompts(torch.tensor(prompts)), torch.tensor(answers), torch.tensor(problem), len(ids))


@torch.no_grad()
def expected_pass1(
    model: torch.nn.Module, aset: AnswerSet, temperature: float = 1.0, dtype: torch.dtype = torch.float64
) -> float:
    """Mean over the problems of P(one sample at ``temperature`` is correct), computed in ``dtype`` (float64 by
    default; float32 is 3x faster and exact to about 1e-6 of the probability, far below a one-update change).

    P(correct | x) = sum over the correct answers y of prod_t pi(y_t | x, y_<t); sampling stops at EOS, so
    ``y + EOS`` is the whole completion (a sampled completion is scored up to its first EOS).
    """
    m = copy.deepcopy(model).to(dtype).eval()
    p = aset.prompts.shape[1]
    seq = torch.cat([aset.prompts, aset.answers[:, :-1]], 1)
    logits = m(input_ids=seq, use_cache=False).logits[:, p - 1 :] / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, aset.answers[..., None]).squeeze(-1).sum(-1)
    per_problem = torch.zeros(aset.n_problems, dtype=torch.float64).index_add_(0, aset.problem, logp.exp().double())
    return float(per_problem.mean())


# ------------------------------------------------------------------------------------------------ rules
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


# ------------------------------------------------------------------------------------------------ the test
@dataclass
class StateResult:
    run: int
    step: int
    before: float
    after: dict[str, float]
    """rule label -> exact held-out pass@1 after its update (NaN with ``held_out=False``)."""
    train_after: dict[str, float]
    """rule label -> exact pass@1 on the training split after its update (NaN with ``train_split=False``)."""
    train_before: float
    metrics: dict[str, dict[str, float]]
    """rule label -> the update's clip_frac / rescue_frac / grad_norm (means over its optimizer steps) and dose (the
    gradient weight it gave clipped tokens, per valid token; :func:`_dose`)."""
    seed: int = -1
    """The baseline run's RL seed (-1 in files written before it was recorded: seed = preset seed + run)."""
    sft_seed: int = -1
    """The seed of the warm start the baseline run started from."""


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


def run_test(
    cfg: RunConfig,
    specs: list[RuleSpec],
    n_states: int,
    runs: int = 1,
    start: int = 1,
    every: int = 1,
    train_split: bool = True,
    progress: bool = False,
    on_state=None,
    seeds: list[int] | None = None,
    tie_sft_seed: bool = False,
    held_out: bool = True,
    score_dtype: torch.dtype = torch.float64,
) -> list[StateResult]:
    """Walk ``runs`` hard baseline runs (seeds ``seeds``, default cfg.seed, cfg.seed + 1, ...) and test every rule
    at each state. ``tie_sft_seed``: each run starts from its own warm start (sft.seed = its seed).

    ``on_state(result)`` is called after each state (the CLI appends it to ``--out``, so a long test that is
    stopped keeps what it measured)."""
    set_threads()
    seeds = list(seeds) if seeds is not None else [cfg.seed + i for i in range(runs)]
    if len(seeds) != runs:
        raise ValueError(f"seeds={seeds!r}: {len(seeds)} seeds for runs={runs}; allowed: one seed per run")
    task = get_task(cfg.task.name)
    held = answer_set(task, task.eval_ids) if held_out else None
    train = answer_set(task, task.train_ids) if train_split else None
    temp = cfg.eval.temperature
    plan = state_steps(n_states, runs, start, every, cfg.train.steps)
    results: list[StateResult] = []
    t0 = time.perf_counter()

    def score(model, aset):
        return expected_pass1(model, aset, temp, score_dtype) if aset is not None else math.nan

    for i, (steps, seed) in enumerate(zip(plan, seeds)):
        run_cfg = cfg.replace(seed=seed, loss=specs[0].loss)
        if tie_sft_seed:
            run_cfg = run_cfg.replace(sft=dataclasses.replace(cfg.sft, seed=seed))
        state, _ = warm_start(run_cfg, progress=progress)
        model = build_model(cfg.model, generator(run_cfg.sft.seed, "sft-init"))
        model.load_state_dict(state)
        opt = _adamw(model, cfg)
        todo = set(steps)
        for step in range(1, (steps[-1] if steps else 0) + 1):
            if step not in todo:
                rl_step(model, opt, task, run_cfg, step)
                continue
            before, train_before = score(model, held), score(model, train)
            snap = copy.deepcopy((model.state_dict(), opt.state_dict()))
            after, train_after, mets, nxt = {}, {}, {}, None
            for spec in specs:
                m = copy.deepcopy(model)
                m.load_state_dict(snap[0])
                o = _adamw(m, cfg)
                o.load_state_dict(copy.deepcopy(snap[1]))
                row, bins = rl_step(m, o, task, run_cfg.replace(loss=spec.loss), step)
                after[spec.label], train_after[spec.label] = score(m, held), score(m, train)
                mets[spec.label] = {k: row.get(k, math.nan) for k in ("clip_frac", "rescue_frac", "grad_norm")}
                mets[spec.label]["dose"] = _dose(row, bins)
                if nxt is None:  # specs[0] is hard with the preset's loss: the baseline run's own update
                    nxt = (m, o)
            model, opt = nxt
            results.append(StateResult(i, step, before, after, train_after, train_before, mets, seed, run_cfg.sft.seed))
            if on_state is not None:
                on_state(results[-1])
            if progress:
                done = len(results)
                eta = (time.perf_counter() - t0) / done * (n_states - done)
                print(f"\rstate {done}/{n_states} (run {i}, step {step}), ETA {eta:.0f} s", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)
    return results


def _dose(row: dict, bins: dict | None) -> float:
    """Gradient weight the update gave its clipped tokens, per valid token: clip_frac x (sum of the clipped tokens'
    weights relative to the unclipped gradient) / (clipped tokens), from the step's ratio bins (0 for hard; NaN at
    sequence level, which has no bins)."""
    if bins is None:
        return math.nan
    clipped = sum(sum(bins[f"{side}_clipped"]) for side in ("pos", "neg"))
    weight = sum(sum(bins[f"{side}_weight"]) for side in ("pos", "neg"))
    return row["clip_frac"] * weight / clipped if clipped else 0.0


def _adamw(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    tr = cfg.train  # as experiments.tiny.train.train builds it
    return torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=tr.adam_betas, weight_decay=tr.weight_decay)


# ------------------------------------------------------------------------------------------------ CLI
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


def _task_enumerable(name: str) -> bool:
    task = get_task(name)
    return type(task).solutions is not Task.solutions and task.n_problems <= 100_000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.mechanism", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value overrides of the preset (e.g. train.lr=1e-4)")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"the baseline's config (default {DEFAULT_PRESET})")
    p.add_argument("--rules", default="nsr,soft,widen", help="comma-separated rule specs; hard is always run")
    p.add_argument("--states", type=int, default=300, help="states tested in all")
    p.add_argument("--runs", type=int, default=3, help="baseline runs (seeds seed, seed + 1, ...)")
    p.add_argument("--seeds", help="the baseline runs' seeds, e.g. 201-208 (sets --runs)")
    p.add_argument("--tie-sft-seed", action="store_true", help="each baseline run gets its own warm start")
    p.add_argument("--start", type=int, default=1, help="first baseline step tested")
    p.add_argument("--every", type=int, default=1, help="baseline steps between tested states")
    p.add_argument("--no-train-split", action="store_true", help="skip the training-split score (faster)")
    p.add_argument("--no-held-out", action="store_true", help="skip the held-out score (faster)")
    p.add_argument("--score-dtype", choices=("float64", "float32"), default="float64", help="exact pass@1 in this")
    p.add_argument("--out", required=True, help="JSON-lines file: one line per state, written as it is measured")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_intermixed_args(argv)  # overrides may come after the options
    try:
        seeds = parse_seeds(a.seeds) if a.seeds else None
        runs = len(seeds) if seeds else a.runs
        for k, v in (("--states", a.states), ("--runs", runs), ("--start", a.start), ("--every", a.every)):
            if v < 1:
                raise ValueError(f"{k}={v} is not valid; allowed: an integer >= 1")
        if a.no_train_split and a.no_held_out:
            raise ValueError("--no-train-split with --no-held-out scores nothing; allowed: at most one of them")
        cfg = load_config(a.preset, a.overrides)
        if cfg.backend != "tiny" or not _task_enumerable(cfg.task.name):
            enumerable = ", ".join(n for n in TASKS if _task_enumerable(n))
            raise ValueError(
                f"backend={cfg.backend!r}, task.name={cfg.task.name!r}: allowed: backend tiny and a task whose answers "
                f"can be enumerated ({enumerable})"
            )
        specs = parse_rules(a.rules, cfg.loss)
        state_steps(a.states, runs, a.start, a.every, cfg.train.steps)
        out = Path(a.out)
        if out.exists() and out.stat().st_size:
            raise ValueError(f"--out {out} exists and is not empty; allowed: a new file (a test is never appended to)")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.touch()

    def sink(result: StateResult) -> None:
        append_jsonl(out, [result.__dict__])

    t0 = time.perf_counter()
    results = run_test(
        cfg, specs, a.states, runs, a.start, a.every, not a.no_train_split, not a.quiet, sink, seeds,
        a.tie_sft_seed, not a.no_held_out, getattr(torch, a.score_dtype),
    )  # fmt: skip
    print(
        f"{len(results)} states of {runs} hard baseline run(s) ({a.preset}"
        f"{' ' + ' '.join(a.overrides) if a.overrides else ''}; seeds {[r.seed for r in results][:1]}..., steps "
        f"{a.start}, {a.start + a.every}, ...) in {time.perf_counter() - t0:.0f} s -> {out}\n"
        f"summary: python -m analysis.mechanism {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
