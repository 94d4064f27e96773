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

from experiments.config_errors import check_field
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


OUTCOMES = ("correct", "wrong_value", "wrong_digits", "wrong_answer", "malformed", "no_eos")
"""The outcome classes of ``Task.outcome`` (wrong_value / wrong_digits: Countdown; wrong_answer: other tasks)."""


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

    def outcome(self, pid: int, text: str | None) -> str:
        """What a completion is, one of ``OUTCOMES``: no EOS, malformed (states no answer), a wrong answer, correct."""
        if text is None:
            return "no_eos"
        if self.is_correct(pid, text):
            return "correct"
        return "malformed" if self.answer(text) is None else "wrong_answer"

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
    """Value of ``d op d ... op d`` (single digits, ops + - *) with the usual precedence: products first, then sums
    and differences from left to right."""
    terms, signs = [int(expr[0])], [1]
    for op, d in zip(expr[1::2], map(int, expr[2::2])):
        if op == "*":
            terms[-1] *= d
        else:
            terms.append(d)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def _well_formed(text: str, n_digits: int) -> bool:
    digits, ops = text[::2], text[1::2]
    return len(text) == 2 * n_digits - 1 and all(c in "123456789" for c in digits) and all(c in _OPS for c in ops)


@functools.cache
def _countdown_problems(n_digits: int) -> tuple[tuple[tuple[int, ...], int, tuple[str, ...]], ...]:
    """Every (sorted digits, target, answers) with ``n_digits`` digits 1-9 and a target in 0-999, sorted."""
    found: dict[tuple[tuple[int, ...], int], list[str]] = {}
    for digits in itertools.combinations_with_replacement(range(1, 10), n_digits):
        for perm in sorted(set(itertools.permutations(digits))):
            for ops in itertools.product(_OPS, repeat=n_digits - 1):
                expr = str(perm[0]) + "".join(o + str(d) for o, d in zip(ops, perm[1:]))
                v = countdown_value(expr)
                if 0 <= v <= 999:
                    found.setdefault((digits, v), []).append(expr)
    return tuple((d, v, tuple(exprs)) for (d, v), exprs in sorted(found.items()))


class Countdown(Task):
    """Countdown with ``n_digits`` digits: prompt ``digits:ttt=``, answer the digits in any order joined by
    ``+ - *`` (usual precedence) equal to the target, then EOS."""

    n_digits: int
    n_eval = 512

    def __init__(self):
        self.problems = _countdown_problems(self.n_digits)
        self.n_problems = len(self.problems)
        super().__init__()

    def prompt_text(self, pid: int) -> str:
        digits, target, _ = self.problems[pid]
        return "".join(map(str, digits)) + f":{target:03d}="

    def solutions(self, pid: int) -> list[str]:
        return list(self.problems[pid][2])

    def is_correct(self, pid: int, text: str | None) -> bool:
        if text is None or not _well_formed(text, self.n_digits):
            return False
        digits, target, _ = self.problems[pid]
        return tuple(sorted(map(int, text[::2]))) == digits and countdown_value(text) == target

    def answer(self, text: str | None) -> int | None:
        """The expression's value (whatever digits it uses), None if it is not ``n_digits`` digits and ops."""
        return countdown_value(text) if text is not None and _well_formed(text, self.n_digits) else None

    def outcome(self, pid: int, text: str | None) -> str:
        """As Task.outcome, with a wrong answer split by whether it uses the prompt's digits: "wrong_value" (the
        prompt's digits, another value) or "wrong_digits" (other digits: the prompt is not copied)."""
        out = super().outcome(pid, text)
        if out != "wrong_answer":
            return out
        return "wrong_value" if tuple(sorted(map(int, text[::2]))) == self.problems[pid][0] else "wrong_digits"


class Countdown3(Countdown):
    name = "countdown3"
    n_digits = 3
    prompt_len = 8
    answer_len = 6
    """1418 problems; 36% held out, so the default eval set (512 prompts) is all of the held-out split."""


class Countdown4(Countdown):
    """Four digits, 8-token answers (``rollout.max_new_tokens`` >= 8): a harder task with longer answers than
    countdown3 (a stage-A candidate of docs/evidence.md; its warm start is not measured yet)."""

    name = "countdown4"
    n_digits = 4
    prompt_len = 9
    answer_len = 8


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


def check_task_fits(cfg, task) -> None:
    """The answers and held-out split of a testbed task fit the config (the tiny backend and the trl backend on a
    testbed task check it)."""
    new = cfg.rollout.max_new_tokens
    allowed = f">= {task.answer_len} (a correct {task.name} answer and its EOS)"
    check_field("rollout", "max_new_tokens", new >= task.answer_len, allowed, new)
    allowed = f"<= {N_POSITIONS - task.prompt_len} (the tiny model's context)"
    check_field("rollout", "max_new_tokens", task.prompt_len + new <= N_POSITIONS, allowed, new)
    allowed = f"<= {task.n_eval} (the held-out split of {task.name})"
    check_field("eval", "n_prompts", cfg.eval.n_prompts <= task.n_eval, allowed, cfg.eval.n_prompts)
