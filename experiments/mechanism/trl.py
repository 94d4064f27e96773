"""The paired per-update test on the trl backend (docs/mechanism.md; stage R1's draft: docs/drafts/stage_r1.md):
does what a rule adds to a hard-clip update raise the log-probability of correct answers, update by update, on a real
language model?

The toy's gate (experiments/mechanism/toy.py) walks a hard baseline run and, at chosen states, applies one RL step
of every rule from the same state. Here the same on TRL's loop (nsr.trl.NSRGRPOTrainer), in process: a state of
SmolLM2 (weights + AdamW state) is 1.6 GB, so none is saved to disk.

Two commands:

    python -m experiments.mechanism.trl make-set --sweep regime_r1 --problems 16-99 --samples 8 --keep 2 --seed 0 \\
        --out results/mechanism/r1/probe_set.jsonl
    python -m experiments.mechanism.trl walk --sweep regime_r1 --seeds 21-28 --rules soft,nsr --start 5 --every 5 \\
        --states 80 --probe-set results/mechanism/r1/probe_set.jsonl --out 'results/mechanism/r1/s{seed}.jsonl'
    python -m analysis.mechanism results/mechanism/r1/s*.jsonl --gate soft --split held-out

``make-set``: the probe set, made once before any walk from the starting model: for each held-out problem (rows
``--problems A-B`` of the task's eval split, which must lie after the ``eval.n_prompts`` rows a run evaluates, so they
are disjoint from its training and its eval problems), ``--samples`` completions sampled at the rollout temperature
(seeded from ``--seed``), each cut as the rollout cuts it (at its first EOS or at rollout.max_new_tokens), kept (at most
``--keep`` distinct ones per problem) if the kit's math reward scores them 1. Written with its token ids, a header line
(git commit, command, model hash, task key, problems).

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

The score (experiments.mechanism.probe_set.score) is the teacher-forced log-probability at the rollout temperature of
the probe set's completions given their prompts: ``before`` / ``after`` the mean over completions of the sum over
completion tokens (EOS included where there is one), ``before_tok`` / ``after_tok`` the mean over completions of the
per-token mean. Each line also has, per rule, the update's clip / rescue fractions and gradient norm (means over its
micro-batches / optimizer steps), its dose (gradient weight on clipped tokens per valid token, from the premise meter),
the norm of its weight change and a digest of the weights after it (``same_as_hard``: the rule's update left exactly the
weights hard's did), and ``wall_s``, the seconds of each part (scores, snapshot, each replay, digests and restores).
``--check-replay`` also replays hard (label ``hard_replay``): its digest must equal the baseline's (the replay is the
trainer's update).

The file is the toy's format (a header line, then one line per state: ``run``, ``seed``, ``step``, ``before``,
``after``, ``metrics``; the training-split fields are NaN), so ``python -m analysis.mechanism FILES --gate RULE
--split held-out`` reads it. A stopped walk is rerun with the same command: an unfinished run resumes from its TRL
checkpoint and its file keeps the states up to it; a done run with a complete file is skipped. SIGUSR1 stops a walk
without loss: the RL step under way ends (its state line written), a checkpoint is saved there, exit 143.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from transformers import TrainerCallback

from experiments.config import ConfigError, RunConfig, load_config
from experiments.mechanism.plan import (
    RuleSpec,
    baseline_specs,
    header,
    parse_rules,
    parse_seeds,
    read_lines,
    state_steps,
)
from experiments.mechanism.probe_set import (
    ProbeSet,
    check_probe_set,
    held_out_rows,
    make_probe_set,
    parse_range,
    read_probe_set,
    score,
)
from experiments.rundir import Cancelled
from experiments.trl.replay import clipped_weight, replay, restore, snapshot, update_norm, weights_digest


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
    from experiments.run import run as run_cfg
    from experiments.rundir import RunDir, append_jsonl, atomic_write_text, git_info

    if cfg.backend != "trl" or cfg.loss.rule != "hard":
        raise ValueError(f"backend={cfg.backend!r}, loss.rule={cfg.loss.rule!r}: allowed: backend trl, rule hard")
    bad = [s for s in steps if not 1 <= s <= cfg.train.steps]
    if bad:
        raise ValueError(f"probed steps {bad}: allowed: 1 <= step <= train.steps={cfg.train.steps}")
    rd, out = RunDir(run_dir), Path(out)
    lines = read_lines(out)
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
    prober = Prober(specs, todo, pset, cfg.rollout.temperature, sink, check_replay, run, progress)
    checked = []

    def before_step(step, trainer):
        if not checked:  # the probe set's model and task are the run's (before any probe)
            check_probe_set(pset, cfg, getattr(trainer.model, "model_info", None))
            checked.append(True)
        prober(step, trainer)

    run_cfg(cfg, rd.path, run_id=run_id, meta={**(meta or {}), **git}, progress=progress, before_step=before_step)
    return mine


def _resume_step(rd, cfg: RunConfig) -> int:
    from experiments.trl.train import checkpoint_rl_step, latest_checkpoint

    ck = latest_checkpoint(rd)
    return checkpoint_rl_step(ck, cfg) if ck is not None else 0


# ------------------------------------------------------------------------------------------------ the probe at a state
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
        runs = ([RuleSpec("hard_replay", self.hard.loss)] if self.check_replay else []) + self.specs
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


class _StepEnd(TrainerCallback):
    """Finishes the prober's pending state at the end of its RL step (the last of its optimizer steps)."""

    def __init__(self, prober: Prober):
        self.prober = prober

    def on_step_end(self, args, state, control, **kwargs):
        tr = self.prober.trainer
        k = tr.args.steps_per_generation * tr.num_iterations // tr.args.gradient_accumulation_steps
        if self.prober.pending is not None and state.global_step % k == 0:
            self.prober.finish(tr)


# ------------------------------------------------------------------------------------------------ CLI
def _command(argv: list[str] | None) -> str:
    import shlex

    return shlex.join(["python", "-m", "experiments.mechanism.trl", *(sys.argv[1:] if argv is None else argv)])


def _configs(a) -> list[tuple[RunConfig, str | None, dict, Path | None]]:
    """(config, run id, meta, run folder) of each baseline run: the sweep's hard run of each --seeds, or --preset with
    overrides (one run, --run-dir)."""
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
    s = argparse.ArgumentParser(prog=f"python -m experiments.mechanism.trl {cmd}", description=COMMANDS[cmd])
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
            prog="python -m experiments.mechanism.trl",
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
    except Cancelled as e:  # SIGTERM, or SIGUSR1 after saving at the step's end: the same command resumes
        print(f"cancelled: {e}", file=sys.stderr)
        return 143


def _make_set(a, cfg: RunConfig, argv) -> int:
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
