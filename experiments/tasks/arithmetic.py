"""``task.name: arithmetic``: a verifiable arithmetic task for a real chat model (SmolLM2-135M-Instruct on CPU).

Problems come from small families (:data:`FAMILIES`: ``mul_add`` is ``a * b + c`` with one-digit operands,
``add_2d1d`` is a two-digit plus a one-digit number, ``mul_add_2d`` is ``a * b + c`` with a two-digit ``c``, ...).
Every problem of the chosen families (``task.families``) is listed, each family shuffled by a generator seeded from
the task's version, and the families interleaved, so any prefix mixes them evenly; the first ``task.n_eval`` problems
are the evaluation set and the next ``task.n_train`` the training set (disjoint by construction, and the evaluation
set does not move when ``n_train`` changes).

A prompt is a chat: the system turn ``task.system_prompt`` (none if empty: the model's template then adds its own),
a worked example as an earlier user / assistant turn (``task.one_shot``), then the problem in ``task.prompt_template``
(``{problem}`` replaced). The answer is scored by the kit's one math reward (experiments/rewards/math.py: the last
``\\boxed{}`` of the response, math-verify against the label). Template, one-shot turn, system prompt, families,
sizes and :data:`GENERATOR_VERSION` (``task.generator_version``) are config fields, so they are part of a run's
identity.

Written on first use: ``cache_dir()/tasks/arithmetic-<key>/{train,eval}.jsonl`` (key: sha256 of those fields), rows
``{"prompt": [chat messages], "label": "17", "problem_id": "mul_add-0042", "problem": "3 * 4 + 5"}`` (OpenRLHF reads the
same files: ``--data.input_key prompt --data.label_key label --data.apply_chat_template``).

    python -m experiments.tasks.arithmetic sweeps/presets/smollm2-trl-cpu.yaml   # write the files; print paths, sizes
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path

from experiments.config_errors import check_field, check_range
from nsr.seeds import derive_seed

NAME = "arithmetic"
GENERATOR_VERSION = 1
"""Version of the problem lists and their order; a config names it (``task.generator_version``) and a config of
another version is refused. Bump when a family's problems or the shuffle change; a new family changes no existing
family's problems or order (each family is shuffled by its own generator), so it needs no bump
(tests/test_arithmetic.py pins every family's list)."""
DIGITS = range(1, 10)
SMALL = range(2, 10)  # multiplication operands: x 1 is trivial
TWO_DIGITS = range(10, 100)

FAMILIES: dict[str, Callable[[], list[tuple[str, int]]]] = {
    "add_1d": lambda: [(f"{a} + {b}", a + b) for a in DIGITS for b in DIGITS],
    "mul_1d": lambda: [(f"{a} * {b}", a * b) for a in SMALL for b in SMALL],
    "add_3x1d": lambda: [(f"{a} + {b} + {c}", a + b + c) for a in DIGITS for b in DIGITS for c in DIGITS],
    "mul_add": lambda: [(f"{a} * {b} + {c}", a * b + c) for a in SMALL for b in SMALL for c in DIGITS],
    "add_2d1d": lambda: [(f"{a} + {b}", a + b) for a in TWO_DIGITS for b in DIGITS],
    "sub_2d1d": lambda: [(f"{a} - {b}", a - b) for a in TWO_DIGITS for b in DIGITS],
    # added 2026-12-07 as candidates for a harder mix (stage D's pilot): the model's step-0 pass rates unmeasured
    "add_2d2d": lambda: [(f"{a} + {b}", a + b) for a in TWO_DIGITS for b in TWO_DIGITS],
    "mul_2d1d": lambda: [(f"{a} * {b}", a * b) for a in TWO_DIGITS for b in SMALL],
    "mul_add_2d": lambda: [(f"{a} * {b} + {c}", a * b + c) for a in SMALL for b in SMALL for c in TWO_DIGITS],
    "mul_sub": lambda: [(f"{a} * {b} - {c}", a * b - c) for a in SMALL for b in SMALL for c in DIGITS],
}
"""Problem families: name -> every (problem text, answer) of it."""


def problems(families: tuple[str, ...], version: int = GENERATOR_VERSION) -> list[dict]:
    """Every problem of ``families``: each family shuffled by its own seeded generator, then interleaved."""
    lists = []
    for fam in families:
        items = [(f"{fam}-{i:04d}", text, ans) for i, (text, ans) in enumerate(FAMILIES[fam]())]
        random.Random(derive_seed("arithmetic", version, fam)).shuffle(items)
        lists.append(items)
    out = []
    for row in itertools.chain.from_iterable(itertools.zip_longest(*lists)):
        if row is not None:
            pid, text, ans = row
            out.append({"problem_id": pid, "problem": text, "label": str(ans)})
    return out


def messages(task, problem: str) -> list[dict]:
    """The chat of one prompt (module doc)."""
    out = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
    if task.one_shot:
        out += [{"role": "user", "content": task.one_shot[0]}, {"role": "assistant", "content": task.one_shot[1]}]
    return out + [{"role": "user", "content": task.prompt_template.replace("{problem}", problem)}]


def check_task(task) -> None:
    """ConfigError naming the ``task.`` field and what is allowed (run at the config's construction)."""
    allowed = f"{GENERATOR_VERSION} (this code's arithmetic generator)"
    check_field("task", "generator_version", task.generator_version == GENERATOR_VERSION, allowed,
                task.generator_version)  # fmt: skip
    bad = [f for f in task.families if f not in FAMILIES]
    allowed = f"a non-empty list of {', '.join(FAMILIES)}"
    check_field("task", "families", bool(task.families) and not bad and len(set(task.families)) == len(task.families),
                allowed, list(task.families))  # fmt: skip
    total = sum(len(FAMILIES[f]()) for f in task.families) - 1  # at most one problem is the one-shot's own
    check_range("task", "n_train", task.n_train, 1, total)
    check_range("task", "n_eval", task.n_eval, 0, total - task.n_train)
    check_field("task", "prompt_template", "{problem}" in task.prompt_template, "a text containing {problem}",
                task.prompt_template)  # fmt: skip
    check_field("task", "one_shot", len(task.one_shot) in (0, 2), "[] or [user turn, assistant turn]",
                list(task.one_shot))  # fmt: skip
    check_field("task", "chat_template", task.chat_template, "true (the prompts are chats)", task.chat_template)


FIELDS = ("families", "n_train", "n_eval", "prompt_template", "one_shot", "system_prompt", "generator_version")
"""The task fields the problems and prompts depend on (the cache key)."""


def key(task) -> str:
    blob = json.dumps({f: getattr(task, f) for f in FIELDS}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def data_dir(task) -> Path:
    from experiments.rundir import cache_dir

    return cache_dir() / "tasks" / f"{NAME}-{key(task)}"


def split(task) -> dict[str, list[dict]]:
    """{"eval": first n_eval problems, "train": the next n_train}, each row with its chat prompt; the one-shot turn's
    own problem is left out of both."""
    shot = task.one_shot[0] if task.one_shot else None
    rows = [r for r in problems(tuple(task.families), task.generator_version)
            if task.prompt_template.replace("{problem}", r["problem"]) != shot]  # fmt: skip
    out = {"eval": rows[: task.n_eval], "train": rows[task.n_eval : task.n_eval + task.n_train]}
    for part in out.values():
        for r in part:
            r["prompt"] = messages(task, r["problem"])
    return out


def write_files(task) -> dict[str, Path]:
    """{"train": path, "eval": path}: the JSONL files of ``task``, written on first use (file lock, atomic rename)."""
    from filelock import FileLock

    folder = data_dir(task)
    paths = {part: folder / f"{part}.jsonl" for part in ("train", "eval")}
    if all(p.is_file() for p in paths.values()):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / ".lock")):
        if not all(p.is_file() for p in paths.values()):
            for part, rows in split(task).items():
                tmp = paths[part].with_name(f".{part}.tmp{os.getpid()}")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
                os.replace(tmp, paths[part])
    return paths


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reward_func():
    """TRL reward function: the kit's math reward of each completion against its row's label."""
    from experiments.rewards.math import score

    def arithmetic_correct(prompts, completions, label, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(t, lab) for t, lab in zip(texts, label)]

    return arithmetic_correct


def main(argv: list[str] | None = None) -> int:
    import argparse
    import shlex

    from experiments.config import load_config

    args = sys.argv[1:] if argv is None else list(argv)
    if "--spread" in args:  # the pass-rate spread loads a model, so it lives above tasks and models: say where
        again = shlex.join(["python", "-m", "experiments.evaluation.spread", *args])
        msg = "--spread is not an option here; allowed: CONFIG [key=value ...] (writes the task files). The spread"
        print(f"error: {msg} moved to python -m experiments.evaluation.spread: {again}", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="python -m experiments.tasks.arithmetic", description=__doc__.split("\n")[0])
    p.add_argument("config", help="a RunConfig YAML with task.name arithmetic")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    a = p.parse_intermixed_args(args)  # overrides before or after options
    cfg = load_config(a.config, a.overrides)
    paths = write_files(cfg.task)
    print(json.dumps({part: {"path": str(q), "rows": len(read_rows(q))} for part, q in paths.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
