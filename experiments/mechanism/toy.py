"""The paired per-update test on the toy (the tiny backend; docs/mechanism.md): does what a rule rescues improve the
policy, update by update? ``python -m experiments.mechanism`` runs this module.

From states of a hard-clip baseline run (policy + optimizer), apply one RL step of every rule: the same rollout,
the same minibatches, the same noise stream (``experiments.tiny.train.rl_step`` with the run's seed and step, so
each rule sees exactly the draws the baseline saw), and score each updated policy by its exact expected pass@1 on
Countdown-3's held-out split. The correct answers of a Countdown-3 problem can be enumerated (``task.solutions``:
every ``d op d op d`` over the prompt's digits that hits the target), so the probability that one sampled
completion is correct is the sum, over them, of the teacher-forced probability of ``answer + EOS``; no sampling
(experiments.mechanism.exact).

The difference rule - hard at the same state is a paired replicate; its mean over states says whether the signal
the rule adds to hard clipping improves the policy on average. This module measures and writes one JSON line per
state (``--out``); ``python -m analysis.mechanism FILE`` gives the Student-t intervals over states and over the
per-run means, and the stage-A2 gate (docs/evidence.md).

    python -m experiments.mechanism --states 300 --runs 3 --rules nsr,soft,widen --out mech.jsonl
    python -m experiments.mechanism --preset sweeps/presets/tiny-smoke.yaml --states 4 --runs 1 --every 2 \
        --out /tmp/mech.jsonl train.steps=8
    python -m analysis.mechanism mech.jsonl

A sweep's baselines (stage A3, analysis/regime.yaml ``stage_a3``): ``--sweep regime_a3 --seeds 301-304`` walks the
sweep's hard run of each seed on the single-run trainer and writes its run folder, results/runs/<sweep>/<run_id>/,
exactly as ``python -m experiments.run --sweep regime_a3 --run <run_id>`` would (tests/test_mechanism_walk.py), with
one gate file per seed (``--out 'results/mechanism/a3/tl44-s{seed}.jsonl'``). A stopped walk is rerun with the same
command: each unfinished run resumes from its checkpoint, a finished one is skipped.

    python -m experiments.mechanism --sweep regime_a3 --seeds 301-304 --rules soft,nsr --states 80 --start 20 \
        --every 20 --no-held-out --score-dtype float32 --out 'results/mechanism/a3/tl44-s{seed}.jsonl'

Every output file starts with a header line (git commit, command); analysis.mechanism skips it.

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
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments.config import ConfigError, RunConfig, load_config
from experiments.mechanism.exact import answer_set, expected_pass1
from experiments.mechanism.plan import (
    RuleSpec,
    baseline_specs,
    header,
    parse_rules,
    parse_seeds,
    read_lines,
    state_steps,
)
from experiments.models.tiny import build_model
from experiments.rundir import append_jsonl
from experiments.sft import warm_start
from experiments.tasks.countdown import TASKS, Task, get_task
from experiments.threads import set_threads
from experiments.tiny.train import rl_step
from nsr.seeds import generator

DEFAULT_PRESET = "sweeps/presets/tiny.yaml"


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
            res, nxt = walk_state(model, opt, run_cfg, specs, task, step, score, held, train)
            model, opt = nxt  # specs[0] is hard with the preset's loss: the baseline run's own update
            results.append(dataclasses.replace(res, run=i))
            if on_state is not None:
                on_state(results[-1])
            if progress:
                done = len(results)
                eta = (time.perf_counter() - t0) / done * (n_states - done)
                print(f"\rstate {done}/{n_states} (run {i}, step {step}), ETA {eta:.0f} s", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)
    return results


def walk_state(model, opt, run_cfg: RunConfig, specs: list[RuleSpec], task: Task, step: int, score, held, train):
    """One state of a baseline run: exact pass@1 before, then one RL step of every rule from copies of (model,
    opt) and exact pass@1 after each. (model, opt) are left unchanged. Returns (StateResult with run 0, (model,
    optimizer) after the first spec's update: hard with the run's loss, the baseline run's own next state)."""
    before, train_before = score(model, held), score(model, train)
    snap = copy.deepcopy((model.state_dict(), opt.state_dict()))
    after, train_after, mets, nxt = {}, {}, {}, None
    for spec in specs:
        m = copy.deepcopy(model)
        m.load_state_dict(snap[0])
        o = _adamw(m, run_cfg)
        o.load_state_dict(copy.deepcopy(snap[1]))
        row, bins = rl_step(m, o, task, run_cfg.replace(loss=spec.loss), step)
        after[spec.label], train_after[spec.label] = score(m, held), score(m, train)
        mets[spec.label] = {k: row.get(k, math.nan) for k in ("clip_frac", "rescue_frac", "grad_norm")}
        mets[spec.label]["dose"] = _dose(row, bins)
        if nxt is None:
            nxt = (m, o)
    res = StateResult(0, step, before, after, train_after, train_before, mets, run_cfg.seed, run_cfg.sft.seed)
    return res, nxt


# ------------------------------------------------------------------------------------------------ a sweep's runs
def _checkpoint_step(rd) -> int:
    """The step a not-done run folder resumes from (its checkpoint's, 0 without one)."""
    if not rd.checkpoint_path.exists():
        return 0
    return int(torch.load(rd.checkpoint_path, weights_only=True)["step"])


def walk_sweep(
    sweep: str | Path,
    seeds: list[int],
    rules: str,
    n_states: int,
    start: int,
    every: int,
    out_pattern: str,
    *,
    runs_root: str | Path | None = None,
    train_split: bool = True,
    held_out: bool = True,
    score_dtype: torch.dtype = torch.float64,
    progress: bool = False,
    command: str = "",
) -> list[StateResult]:
    """Walk the baseline runs of ``sweep`` (one per seed) on the single-run trainer, each into its own run folder
    ``runs_root/<sweep>/<run_id>`` (default results/runs), as ``python -m experiments.run --sweep SWEEP --run
    <run_id>`` writes it, and test ``rules`` at its states (``n_states`` over the runs, from ``start`` every
    ``every``), written to ``out_pattern.format(seed=seed)``: a header line (git commit, command), then a line per
    state as it is measured.

    A seed whose folder is done and whose file holds every state is skipped; a done folder whose file lacks states
    is an error (nothing is rerun over a finished run). A folder that is not done resumes from its checkpoint
    (experiments.run), and its file keeps the states up to that step (they are the same numbers) and gets a new
    header. The config.yaml of each folder records the git commit of the walk's start (the code that runs)."""
    from experiments.run import run
    from experiments.rundir import RUNS_ROOT, RunDir, atomic_write_text, git_info

    if "{seed}" not in out_pattern:
        raise ValueError(f"--out {out_pattern!r} with --sweep: allowed: a path with {{seed}} (one file per run)")
    bases = baseline_specs(sweep, seeds)
    cfg0 = bases[0].config
    specs = parse_rules(rules, cfg0.loss)
    plan = state_steps(n_states, len(seeds), start, every, cfg0.train.steps)
    root = Path(runs_root) if runs_root is not None else RUNS_ROOT
    git = git_info()  # once: the code this process runs, recorded in every folder and file it writes
    task = get_task(cfg0.task.name)
    set_threads()
    held = answer_set(task, task.eval_ids) if held_out else None
    train = answer_set(task, task.train_ids) if train_split else None
    results: list[StateResult] = []

    if cfg0.backend != "tiny" or not _task_enumerable(cfg0.task.name):
        raise ValueError(f"sweep {sweep}: backend {cfg0.backend!r}, task {cfg0.task.name!r}; allowed: backend tiny and "
                         "a task whose answers can be enumerated")  # fmt: skip
    todo_runs = []
    for i, (spec, steps) in enumerate(zip(bases, plan)):  # every check before any work
        cfg = spec.config
        if cfg.task.name != cfg0.task.name or cfg.loss != cfg0.loss:
            raise ValueError(f"{spec.run_id}: task or loss differs from {bases[0].run_id}; allowed: one regime")
        rd = RunDir(root / spec.sweep / spec.run_id)
        out = Path(out_pattern.format(seed=cfg.seed))
        lines = read_lines(out)
        have = [r for r in lines if "header" not in r]
        if rd.state() == "done":
            missing = sorted(set(steps) - {r["step"] for r in have})
            if not missing:
                print(f"seed {cfg.seed}: {rd.path} done and {out} complete; skipped", file=sys.stderr)
                results += [StateResult(**{**r, "run": i}) for r in have]
                continue
            raise ValueError(
                f"{rd.path} is done but {out} lacks the states of steps {missing}; allowed: a done run with its "
                "complete file (nothing is rerun over a finished run; remove both to walk it again)"
            )
        todo_runs.append((i, spec, steps, rd, out, lines, have))

    for i, spec, steps, rd, out, lines, have in todo_runs:
        cfg = spec.config
        resume = _checkpoint_step(rd) if rd.path.exists() else 0
        kept = [r for r in have if r["step"] <= resume]
        head = header(command, git, sweep=spec.sweep, run_id=spec.run_id, seed=cfg.seed, resumed_from_step=resume)
        out.parent.mkdir(parents=True, exist_ok=True)
        keep = [r for r in lines if "header" in r] + kept + [head]
        atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in keep))
        todo = set(steps) - {r["step"] for r in kept}
        run_cfg = cfg
        mine = [StateResult(**{**r, "run": i}) for r in kept]

        def before_step(step, model, opt, run_cfg=run_cfg, todo=todo, out=out, mine=mine, i=i):
            if step not in todo:
                return

            def score(m, a):
                return expected_pass1(m, a, run_cfg.eval.temperature, score_dtype) if a is not None else math.nan

            res, _ = walk_state(model, opt, run_cfg, specs, task, step, score, held, train)
            res = dataclasses.replace(res, run=i)
            append_jsonl(out, [res.__dict__])
            mine.append(res)

        run(run_cfg, rd.path, run_id=spec.run_id, meta={**spec.meta, **git}, progress=progress, before_step=before_step)
        results += mine
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
    p.add_argument(
        "--sweep",
        help="walk this sweep's hard baseline runs of --seeds on the single-run trainer, each into its run folder "
        "(--runs-root/<sweep>/<run_id>, as experiments.run --sweep writes it); --out then names one file per seed "
        "with {seed}; no --preset or overrides (the sweep has the config)",
    )
    p.add_argument("--runs-root", help="with --sweep: where the run folders go (default results/runs)")
    p.add_argument(
        "--out",
        required=True,
        help="JSON-lines file: a header line (git commit, command), then one line per state, written as it is measured",
    )
    p.add_argument("--quiet", action="store_true")
    a = p.parse_intermixed_args(argv)  # overrides may come after the options
    a.argv = argv
    try:
        seeds = parse_seeds(a.seeds) if a.seeds else None
        runs = len(seeds) if seeds else a.runs
        for k, v in (("--states", a.states), ("--runs", runs), ("--start", a.start), ("--every", a.every)):
            if v < 1:
                raise ValueError(f"{k}={v} is not valid; allowed: an integer >= 1")
        if a.no_train_split and a.no_held_out:
            raise ValueError("--no-train-split with --no-held-out scores nothing; allowed: at most one of them")
        if a.sweep:
            return _main_sweep(a, seeds, runs)
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
    from experiments.rundir import git_info

    append_jsonl(out, [header(_command(argv), git_info(), preset=a.preset)])

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


def _command(argv: list[str] | None) -> str:
    import shlex

    return shlex.join(["python", "-m", "experiments.mechanism", *(sys.argv[1:] if argv is None else argv)])


def _main_sweep(a, seeds: list[int] | None, runs: int) -> int:
    """--sweep: walk the sweep's baseline runs (:func:`walk_sweep`)."""
    from experiments.sweep import SweepError

    if a.preset != DEFAULT_PRESET or a.overrides or a.tie_sft_seed or not seeds:
        print(
            "error: --sweep takes its configs from the sweep: allowed with it: --seeds (required), no --preset, no "
            "key=value overrides, no --tie-sft-seed (the sweep ties seeds)",
            file=sys.stderr,
        )
        return 2
    from experiments.rundir import RunFolderError

    t0 = time.perf_counter()
    try:
        results = walk_sweep(
            a.sweep, seeds, a.rules, a.states, a.start, a.every, a.out, runs_root=a.runs_root,
            train_split=not a.no_train_split, held_out=not a.no_held_out, score_dtype=getattr(torch, a.score_dtype),
            progress=not a.quiet, command=_command(a.argv),
        )  # fmt: skip
    except (ConfigError, SweepError, ValueError, RunFolderError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if not isinstance(e, RunFolderError) else 3
    print(
        f"{len(results)} states of {runs} baseline run(s) of sweep {a.sweep} (seeds {seeds}) in "
        f"{time.perf_counter() - t0:.0f} s -> {a.out}\n"
        f"summary: python -m analysis.mechanism {a.out.replace('{seed}', '*')} --gate soft"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
