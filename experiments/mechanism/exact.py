"""The toy's score (docs/mechanism.md): a policy's exact expected pass@1 on a task whose correct answers can be
enumerated (Countdown: ``task.solutions``), computed by teacher forcing with no sampling."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from experiments.tasks.countdown import EOS, Task, encode


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
