"""Tiny verifiable tasks for the CPU testbed: Countdown-3 (default), Countdown-4 and 3-digit addition.

Both share one 16-token character vocabulary (``0-9 + - * : =`` and EOS) and fixed-length prompts, so there is no
padding on the prompt side. Every task enumerates its problems, splits them once, by a fixed seed that no config
can change, into a training split (SFT and RL prompts) and a held-out eval split, and verifies an answer exactly.

* ``countdown3``: prompt ``abc:ttt=`` (three digits 1-9, sorted; target 0-999 written with 3 digits). A correct
  completion is ``x op y op z`` then EOS (ops ``+ - *``, usual precedence) using exactly the prompt's digits and
  evaluating to the target. 1418 problems; many have several answers, so samples stay diverse.
* ``countdown4``: prompt ``abcd:ttt=``, completion ``a op b op c op d`` then EOS (8 tokens); the same rules with
  four digits. A harder task with longer answers (docs/evidence.md); no tuned warm start yet.
* ``add3``: prompt ``aaa+bbb=`` (operands written least-significant digit first); the answer is the sum, LSB
  first, zero-padded to 4 digits, then EOS. 10^6 problems, one answer each.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch

from nsr.registry import Registry

CHARS = "0123456789+-*:="
EOS = len(CHARS)
VOCAB_SIZE = len(CHARS) + 1
_INDEX = {c: i for i, c in enumerate(CHARS)}
N_POSITIONS = 32
"""Context length of the tiny model: prompt + rollout.max_new_tokens must fit."""
SPLIT_SEED = 20260530
"""Seed of the train / eval split of every task. A constant, not a config field: SFT warm starts and eval sets of
every run must agree on which problems are held out."""


def encode(text: str) -> list[int]:
    return [_INDEX[c] for c in text]


def decode(tokens: Sequence[int]) -> str:
    """Characters up to (not including) the first EOS; ``None`` if there is no EOS."""
    out = []
    for t in tokens:
        t = int(t)
        if t == EOS:
            return "".join(out)
        out.append(CHARS[t])
    return None


class Task:
    """A finite problem set with an exact verifier.

    Subclasses set ``name``, ``prompt_len``, ``answer_len`` (tokens of a correct completion, EOS included),
    ``n_problems``, ``n_eval`` and implement ``prompt_text``, ``solutions`` and ``is_correct``.
    """

    name: str
    prompt_len: int
    answer_len: int
    n_problems: int
    n_eval: int

    def __init__(self):
        perm = torch.randperm(self.n_problems, generator=torch.Generator().manual_seed(SPLIT_SEED))
        self.eval_ids = perm[: self.n_eval].sort().values
        """(n_eval,) held-out problem ids: eval prompts are drawn from these only."""
        self.train_ids = perm[self.n_eval :].sort().values
        """(n_problems - n_eval,) ids that SFT and RL sample from."""

    # ---------------------------------------------------------------- per task
    def prompt_text(self, pid: int) -> str:
        raise NotImplementedError

    def solutions(self, pid: int) -> list[str]:
        """Every correct completion text (without EOS)."""
        raise NotImplementedError

    def is_correct(self, pid: int, text: str | None) -> bool:
        """Exact verifier: ``text`` is a completion up to its EOS (None: no EOS was generated)."""
        raise NotImplementedError

    def answer(self, text: str | None):
        """The final answer ``text`` states, for the label-free vote (experiments.tiny.rewards): completions with
        equal answers vote together. A hashable value, or None if it states none. Needs no label."""
        raise NotImplementedError

    # ---------------------------------------------------------------- shared
    def sample_train(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """(n,) problem ids drawn uniformly, with replacement, from the training split."""
        return self.train_ids[torch.randint(len(self.train_ids), (n,), generator=generator)]

    def eval_set(self, n: int, seed: int) -> torch.Tensor:
        """(n,) distinct held-out problem ids, a seeded draw (the same for every run with this seed)."""
        if n > self.n_eval:
            raise ValueError(f"eval.n_prompts={n} is not valid for task {self.name}; allowed: <= {self.n_eval}")
        perm = torch.randperm(self.n_eval, generator=torch.Generator().manual_seed(seed))
        return self.eval_ids[perm[:n]]

    def prompts(self, ids: torch.Tensor) -> torch.Tensor:
        """(N,) problem ids -> (N, prompt_len) token ids."""
        return torch.tensor([encode(self.prompt_text(int(i))) for i in ids], dtype=torch.long).view(-1, self.prompt_len)

    def sft_completions(self, ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """(N,) problem ids -> (N, answer_len) tokens of one correct answer each (uniform among them) + EOS."""
        out = []
        for i in ids.tolist():
            sols = self.solutions(i)
            k = int(torch.randint(len(sols), (), generator=generator)) if len(sols) > 1 else 0
            out.append(encode(sols[k]) + [EOS])
        return torch.tensor(out, dtype=torch.long)

    def rewards(self, ids: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
        """(N,) problem ids and (N, T) completion tokens -> (N,) float rewards in {0, 1}."""
        comps = completions.tolist()
        return torch.tensor([float(self.is_correct(int(i), decode(c))) for i, c in zip(ids.tolist(), comps)])


# -------------------------------------------------------------------- Countdown-3
_OPS = "+-*"


def countdown_value(expr: str) -> int:
    """Value of ``d op d op d`` (single digits, ops + - *) with the usual precedence."""
    a, o1, b, o2, c = int(expr[0]), expr[1], int(expr[2]), expr[3], int(expr[4])
    if o2 == "*" and o1 != "*":  # a o1 (b * c)
        bc = b * c
        return a + bc if o1 == "+" else a - bc
    ab = a * b if o1 == "*" else a + b if o1 == "+" else a - b  # (a o1 b) o2 c
    return ab * c if o2 == "*" else ab + c if o2 == "+" else ab - c


def _well_formed(text: str) -> bool:
    return len(text) == 5 and all(text[i] in "123456789" for i in (0, 2, 4)) and text[1] in _OPS and text[3] in _OPS


@functools.cache
def _countdown_problems() -> tuple[tuple[tuple[int, int, int], int, tuple[str, ...]], ...]:
    """Every (sorted digits, target, answers) with digits 1-9 and a target in 0-999, sorted."""
    found: dict[tuple[tuple[int, int, int], int], list[str]] = {}
    for digits in itertools.combinations_with_replacement(range(1, 10), 3):
        for perm in sorted(set(itertools.permutations(digits))):
            for o1, o2 in itertools.product(_OPS, repeat=2):
                expr = f"{perm[0]}{o1}{perm[1]}{o2}{perm[2]}"
                v = countdown_value(expr)
                if 0 <= v <= 999:
                    found.setdefault((digits, v), []).append(expr)
    return tuple((d, v, tuple(exprs)) for (d, v), exprs in sorted(found.items()))


class Countdown3(Task):
    name = "countdown3"
    prompt_len = 8
    answer_len = 6
    n_eval = 512
    """36% of the 1418 problems, so the default eval set (512 prompts) is all of the held-out split."""

    def __init__(self):
        self.problems = _countdown_problems()
        self.n_problems = len(self.problems)
        super().__init__()

    def prompt_text(self, pid: int) -> str:
        digits, target, _ = self.problems[pid]
        return "".join(map(str, digits)) + f":{target:03d}="

    def solutions(self, pid: int) -> list[str]:
        return list(self.problems[pid][2])

    def is_correct(self, pid: int, text: str | None) -> bool:
        if text is None or not _well_formed(text):
            return False
        digits, target, _ = self.problems[pid]
        return tuple(sorted(int(text[i]) for i in (0, 2, 4))) == digits and countdown_value(text) == target

    def answer(self, text: str | None) -> int | None:
        """The expression's value (whatever digits it uses), None if it is not ``d op d op d``."""
        return countdown_value(text) if text is not None and _well_formed(text) else None


# -------------------------------------------------------------------- Countdown-4
def countdown4_value(expr: str) -> int:
    """Value of ``d op d op d op d`` (single digits, ops + - *) with the usual precedence: products first, then
    sums and differences from left to right."""
    terms, signs = [int(expr[0])], [1]
    for op, d in zip(expr[1::2], map(int, expr[2::2])):
        if op == "*":
            terms[-1] *= d
        else:
            terms.append(d)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def _well_formed4(text: str) -> bool:
    return (
        len(text) == 7 and all(text[i] in "123456789" for i in (0, 2, 4, 6)) and all(text[i] in _OPS for i in (1, 3, 5))
    )


@functools.cache
def _countdown4_problems() -> tuple[tuple[tuple[int, int, int, int], int, tuple[str, ...]], ...]:
    """Every (sorted digits, target, answers) with four digits 1-9 and a target in 0-999, sorted."""
    found: dict[tuple[tuple[int, ...], int], list[str]] = {}
    for digits in itertools.combinations_with_replacement(range(1, 10), 4):
        for perm in sorted(set(itertools.permutations(digits))):
            for ops in itertools.product(_OPS, repeat=3):
                expr = f"{perm[0]}{ops[0]}{perm[1]}{ops[1]}{perm[2]}{ops[2]}{perm[3]}"
                v = countdown4_value(expr)
                if 0 <= v <= 999:
                    found.setdefault((digits, v), []).append(expr)
    return tuple((d, v, tuple(exprs)) for (d, v), exprs in sorted(found.items()))


class Countdown4(Task):
    """Countdown with four digits: prompt ``abcd:ttt=``, answer ``a op b op c op d`` then EOS (8 tokens, so
    ``rollout.max_new_tokens`` >= 8). A harder task with longer answers than countdown3 (a stage-A candidate of
    docs/evidence.md; its warm start is not tuned yet)."""

    name = "countdown4"
    prompt_len = 9
    answer_len = 8
    n_eval = 512

    def __init__(self):
        self.problems = _countdown4_problems()
        self.n_problems = len(self.problems)
        super().__init__()

    def prompt_text(self, pid: int) -> str:
        digits, target, _ = self.problems[pid]
        return "".join(map(str, digits)) + f":{target:03d}="

    def solutions(self, pid: int) -> list[str]:
        return list(self.problems[pid][2])

    def is_correct(self, pid: int, text: str | None) -> bool:
        if text is None or not _well_formed4(text):
            return False
        digits, target, _ = self.problems[pid]
        return tuple(sorted(int(text[i]) for i in (0, 2, 4, 6))) == digits and countdown4_value(text) == target

    def answer(self, text: str | None) -> int | None:
        """The expression's value (whatever digits it uses), None if it is not ``d op d op d op d``."""
        return countdown4_value(text) if text is not None and _well_formed4(text) else None


# -------------------------------------------------------------------- 3-digit addition
class Add3(Task):
    name = "add3"
    prompt_len = 8
    answer_len = 5
    n_problems = 1_000_000
    n_eval = 10_000

    def prompt_text(self, pid: int) -> str:
        a, b = divmod(pid, 1000)
        return f"{a:03d}"[::-1] + "+" + f"{b:03d}"[::-1] + "="

    def solutions(self, pid: int) -> list[str]:
        a, b = divmod(pid, 1000)
        return [f"{a + b:04d}"[::-1]]

    def is_correct(self, pid: int, text: str | None) -> bool:
        return text == self.solutions(pid)[0]

    def answer(self, text: str | None) -> str | None:
        """The 4 digits of the sum, None if the completion is not 4 digits."""
        return text if text is not None and len(text) == 4 and text.isdigit() else None


TASKS: Registry[type[Task]] = Registry("task.name")
TASKS.register("countdown3")(Countdown3)
TASKS.register("add3")(Add3)
TASKS.register("countdown4")(Countdown4)


@functools.cache
def get_task(name: str) -> Task:
    """The task instance of ``name`` (built once per process; raises ValueError listing valid names)."""
    return TASKS[name]()
