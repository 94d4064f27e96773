"""The paired mechanism test (docs/evidence.md): does what a rule rescues improve the policy, update by update?

From states of a hard-clip baseline run (policy + optimizer), apply one RL step of every rule: the same rollout,
the same minibatches, the same noise stream (``experiments.tiny.train.rl_step`` with the run's seed and step, so
each rule sees exactly the draws the baseline saw), and score each updated policy by its exact expected pass@1 on
Countdown-3's held-out split. The correct answers of a Countdown-3 problem can be enumerated (``task.solutions``:
every ``d op d op d`` over the prompt's digits that hits the target), so the probability that one sampled
completion is correct is the sum, over them, of the teacher-forced probability of ``answer + EOS``; no sampling.

The difference rule - hard at the same state is a paired replicate; its mean over states says whether the signal
the rule adds to hard clipping improves the policy on average, with a Student-t interval over states (and one over
the per-run means, which does not assume states of one run to be independent).

    python -m experiments.mechanism --states 300 --runs 3 --rules hard,nsr,soft,widen
    python -m experiments.mechanism --preset sweeps/presets/tiny-smoke.yaml --states 4 --runs 1 --every 2 train.steps=8

Rules: any name of ``nsr.RULES``, with optional loss overrides ``name:key=value:...`` (e.g.
``noisy_decision:ratio_noise=0.3``), or ``widen`` = hard with eps_low and eps_high widened by the preset's delta
(``widen:by=0.05`` for another width). ``hard`` (the preset's own loss) is always run: it is the reference, and
its update is the baseline run's next state. Deterministic: every draw is seeded, one thread (NSR_THREADS).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

import nsr
from experiments.config import ConfigError, RunConfig, load_config
from experiments.tiny import set_threads
from experiments.tiny.model import build_model
from experiments.tiny.rng import generator
from experiments.tiny.sft import warm_start
from experiments.tiny.task import EOS, Task, encode, get_task
from experiments.tiny.train import rl_step

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
def expected_pass1(model: torch.nn.Module, aset: AnswerSet, temperature: float = 1.0) -> float:
    """Mean over the problems of P(one sample at ``temperature`` is correct), in float64.

    P(correct | x) = sum over the correct answers y of prod_t pi(y_t | x, y_<t); sampling stops at EOS, so
    ``y + EOS`` is the whole completion (a sampled completion is scored up to its first EOS).
    """
    m = copy.deepcopy(model).double().eval()
    p = aset.prompts.shape[1]
    seq = torch.cat([aset.prompts, aset.answers[:, :-1]], 1)
    logits = m(input_ids=seq, use_cache=False).logits[:, p - 1 :] / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, aset.answers[..., None]).squeeze(-1).sum(-1)
    per_problem = torch.zeros(aset.n_problems, dtype=torch.float64).index_add_(0, aset.problem, logp.exp())
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
    """rule label -> exact held-out pass@1 after its update."""
    train_after: dict[str, float]
    """rule label -> exact pass@1 on the training split after its update (secondary)."""
    train_before: float
    metrics: dict[str, dict[str, float]]
    """rule label -> the update's clip_frac / rescue_frac (means over its optimizer steps)."""


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
) -> list[StateResult]:
    """Walk ``runs`` hard baseline runs (seeds cfg.seed, cfg.seed + 1, ...) and test every rule at each state.

    ``on_state(result)`` is called after each state (the CLI appends it to ``--out``, so a long test that is
    stopped keeps what it measured)."""
    set_threads()
    task = get_task(cfg.task.name)
    held = answer_set(task, task.eval_ids)
    train = answer_set(task, task.train_ids) if train_split else None
    temp = cfg.eval.temperature
    plan = state_steps(n_states, runs, start, every, cfg.train.steps)
    state, _ = warm_start(cfg, progress=progress)
    results: list[StateResult] = []
    t0 = time.perf_counter()
    for i, steps in enumerate(plan):
        run_cfg = cfg.replace(seed=cfg.seed + i, loss=specs[0].loss)
        model = build_model(cfg.model, generator(cfg.sft.seed, "sft-init"))
        model.load_state_dict(state)
        opt = _adamw(model, cfg)
        todo = set(steps)
        for step in range(1, (steps[-1] if steps else 0) + 1):
            if step not in todo:
                rl_step(model, opt, task, run_cfg, step)
                continue
            before = expected_pass1(model, held, temp)
            train_before = expected_pass1(model, train, temp) if train else math.nan
            snap = copy.deepcopy((model.state_dict(), opt.state_dict()))
            after, train_after, mets, nxt = {}, {}, {}, None
            for spec in specs:
                m = copy.deepcopy(model)
                m.load_state_dict(snap[0])
                o = _adamw(m, cfg)
                o.load_state_dict(copy.deepcopy(snap[1]))
                row, _ = rl_step(m, o, task, run_cfg.replace(loss=spec.loss), step)
                after[spec.label] = expected_pass1(m, held, temp)
                train_after[spec.label] = expected_pass1(m, train, temp) if train else math.nan
                mets[spec.label] = {k: row.get(k, math.nan) for k in ("clip_frac", "rescue_frac", "grad_norm")}
                if nxt is None:  # specs[0] is hard with the preset's loss: the baseline run's own update
                    nxt = (m, o)
            model, opt = nxt
            results.append(StateResult(i, step, before, after, train_after, train_before, mets))
            if on_state is not None:
                on_state(results[-1])
            if progress:
                done = len(results)
                eta = (time.perf_counter() - t0) / done * (n_states - done)
                print(f"\rstate {done}/{n_states} (run {i}, step {step}), ETA {eta:.0f} s", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)
    return results


def _adamw(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    tr = cfg.train  # as experiments.tiny.train.train builds it
    return torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=tr.adam_betas, weight_decay=tr.weight_decay)


# ------------------------------------------------------------------------------------------------ summary
def summarize(results: list[StateResult], labels: list[str], level: float = 0.95) -> list[dict]:
    """Per rule label: mean one-step change of exact held-out pass@1, and the paired difference to hard with its
    Student-t interval over states and over per-run means; the same on the training split; clip / rescue."""
    from analysis.stats import interval as t_interval

    runs = sorted({r.run for r in results})
    rows = []
    for lab in labels:
        change = np.array([r.after[lab] - r.before for r in results])
        diff = np.array([r.after[lab] - r.after["hard"] for r in results])
        tdiff = np.array([r.train_after[lab] - r.train_after["hard"] for r in results])
        per_run = [diff[[r.run == k for r in results]].mean() for k in runs]
        mean, lo, hi, n = t_interval(diff, level)
        _, rlo, rhi, _ = t_interval(per_run, level)
        tmean, tlo, thi, _ = t_interval(tdiff, level)
        rows.append(
            {
                "rule": lab,
                "states": n,
                "change": float(change.mean()),
                "diff": mean,
                "diff_lo": lo,
                "diff_hi": hi,
                "diff_run_lo": rlo,
                "diff_run_hi": rhi,
                "share_positive": float((diff > 0).mean()),
                "train_diff": tmean,
                "train_diff_lo": tlo,
                "train_diff_hi": thi,
                "clip_frac": float(np.mean([r.metrics[lab]["clip_frac"] for r in results])),
                "rescue_frac": float(np.mean([r.metrics[lab]["rescue_frac"] for r in results])),
            }
        )
    return rows


def table(rows: list[dict], scale: float = 1e4) -> str:
    """Markdown table, changes in units of 1/scale (1e4: basis points of pass@1)."""
    u = f"x1e-{round(math.log10(scale))}" if scale != 1 else ""
    lines = [
        f"| rule | one-step change of held-out pass@1 ({u}) | rule - hard ({u}) [95% CI over states] | "
        f"[95% CI over runs] | states with rule > hard | train split: rule - hard ({u}) [95% CI] | "
        "clip frac | rescue frac |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "nan" if not math.isfinite(x) else f"{x * scale:+.3f}"

    for r in rows:
        lines.append(
            f"| {r['rule']} | {f(r['change'])} | {f(r['diff'])} [{f(r['diff_lo'])}, {f(r['diff_hi'])}] | "
            f"[{f(r['diff_run_lo'])}, {f(r['diff_run_hi'])}] | {r['share_positive']:.2f} | "
            f"{f(r['train_diff'])} [{f(r['train_diff_lo'])}, {f(r['train_diff_hi'])}] | "
            f"{r['clip_frac']:.4f} | {r['rescue_frac']:.4f} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.mechanism", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value overrides of the preset (e.g. train.lr=1e-4)")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"the baseline's config (default {DEFAULT_PRESET})")
    p.add_argument("--rules", default="nsr,soft,widen", help="comma-separated rule specs; hard is always run")
    p.add_argument("--states", type=int, default=300, help="states tested in all")
    p.add_argument("--runs", type=int, default=3, help="baseline runs (seeds seed, seed + 1, ...)")
    p.add_argument("--start", type=int, default=1, help="first baseline step tested")
    p.add_argument("--every", type=int, default=1, help="baseline steps between tested states")
    p.add_argument("--no-train-split", action="store_true", help="skip the training-split score (faster)")
    p.add_argument("--json", help="write the per-rule summary and per-state numbers here")
    p.add_argument("--out", help="append each state's numbers to this JSON-lines file as it is measured")
    p.add_argument("--summarize", metavar="JSONL", help="only print the table of a --out file (e.g. a stopped test)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.summarize:
        with open(a.summarize) as f:
            results = [StateResult(**json.loads(line)) for line in f if line.strip()]
        labels = list(results[0].after) if results else []
        runs = len({r.run for r in results})
        print(f"Paired mechanism test: {len(results)} states of {runs} hard baseline run(s) ({a.summarize})\n")
        print(table(summarize(results, labels)))
        return 0
    try:
        for k, v in (("--states", a.states), ("--runs", a.runs), ("--start", a.start), ("--every", a.every)):
            if v < 1:
                raise ValueError(f"{k}={v} is not valid; allowed: an integer >= 1")
        cfg = load_config(a.preset, a.overrides)
        if cfg.backend != "tiny" or cfg.task.name != "countdown3":
            raise ValueError(
                f"backend={cfg.backend!r}, task.name={cfg.task.name!r}: allowed: backend tiny, task countdown3"
            )
        specs = parse_rules(a.rules, cfg.loss)
        state_steps(a.states, a.runs, a.start, a.every, cfg.train.steps)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    sink = None
    if a.out:
        open(a.out, "w").close()

        def sink(result: StateResult) -> None:
            with open(a.out, "a") as f:
                f.write(json.dumps(result.__dict__) + "\n")

    results = run_test(cfg, specs, a.states, a.runs, a.start, a.every, not a.no_train_split, not a.quiet, sink)
    rows = summarize(results, [s.label for s in specs])
    print(
        f"Paired mechanism test: {len(results)} states of {a.runs} hard baseline run(s) ({a.preset}"
        f"{' ' + ' '.join(a.overrides) if a.overrides else ''}; seeds {cfg.seed}..{cfg.seed + a.runs - 1}, "
        f"steps {a.start}, {a.start + a.every}, ...), one update per rule, exact held-out pass@1 "
        f"({len(get_task(cfg.task.name).eval_ids)} problems); {time.perf_counter() - t0:.0f} s\n"
    )
    print(table(rows))
    if a.json:
        blob = {
            "args": vars(a),
            "summary": rows,
            "states": [r.__dict__ for r in results],
        }
        with open(a.json, "w") as f:
            json.dump(blob, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
