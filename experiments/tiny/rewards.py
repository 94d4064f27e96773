"""Label-free rewards of the tiny testbed (docs/method.md, "Related methods": multi-reward RLIF).

``reward.source`` picks what the policy is trained on; the verifier's reward is always computed and logged
(``reward_mean``), so a label-free run still reports how often it was right:

* ``verifier`` (default): the task's exact verifier, 1 or 0.
* ``vote``: answer-level cluster vote, as in test-time RL (TTRL, arXiv 2504.16084): 1 if a response's final
  answer equals its group's majority answer, else 0. On Countdown the answer is the expression's value
  (:meth:`experiments.tasks.countdown.Task.answer`), so different expressions with the same value vote together. A
  response that states no answer (malformed, or no EOS) neither votes nor gets the reward; a tie goes to the
  answer that appears first in the group (``collections.Counter.most_common``, as TTRL's code).
* ``certainty``: completion-level self-certainty (INTUITOR, "Learning to Reason without External Rewards", arXiv
  2505.19590): the mean over response tokens of KL(Uniform || p) = -log|V| - mean_v log p(v), p the policy's
  next-token distribution at the rollout temperature.
* ``label_free``: vote + certainty, each normalized within its group (mean 0, std 1, the GRPO formula of
  ``nsr.compute_advantages``) before summing (GDPO, arXiv 2601.05242). GDPO then whitens the sum over the batch;
  here the sum is the response's reward and ``advantages.kind`` turns it into the advantage as for any reward
  (group_norm re-normalizes it within its group, a per-group instead of a batch-wide scale).

Nothing here draws a random number, so switching the reward never shifts the run's other draws.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

import nsr
from experiments.config import REWARD_SOURCES
from experiments.tasks.countdown import Task, decode


def cluster_vote(answers: list, groups: torch.Tensor) -> torch.Tensor:
    """(N,) float: 1.0 where a response's answer equals its group's majority answer, else 0.0.

    Args:
        answers: N hashable answers (None = the response states none; it neither votes nor is rewarded).
        groups: (N,) group id of each response (responses to the same prompt share one).
    """
    out = torch.zeros(len(answers))
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups.tolist()):
        members.setdefault(g, []).append(i)
    for idx in members.values():
        votes = Counter(answers[i] for i in idx if answers[i] is not None)
        if not votes:
            continue
        majority, _ = votes.most_common(1)[0]  # a tie goes to the answer seen first
        for i in idx:
            out[i] = float(answers[i] is not None and answers[i] == majority)
    return out


@torch.no_grad()
def self_certainty(
    model: torch.nn.Module, prompts: torch.Tensor, comps: torch.Tensor, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """(N,) mean over each response's tokens (``mask``) of KL(U || p_t) = -log|V| - mean_v log p_t(v).

    p_t is the policy's next-token distribution before completion token t, at ``temperature`` (as the old
    log-probs); 0 for a response without tokens. Higher = more confident; 0 = uniform.
    """
    p = prompts.shape[1]
    seq = torch.cat([prompts, comps[:, :-1]], 1)
    logits = model(input_ids=seq, use_cache=False).logits[:, p - 1 :].float() / temperature
    logz = torch.log_softmax(logits, -1)  # (N, T, V)
    kl = -math.log(logz.shape[-1]) - logz.mean(-1)  # (N, T)
    m = mask.to(kl.dtype)
    return (kl * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def group_normalized(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(values - group mean) / (group std + 1e-9): the GRPO normalization, one reward at a time (GDPO)."""
    return nsr.compute_advantages(values, groups, nsr.AdvantageConfig(kind="group_norm"))


def train_rewards(
    source: str,
    verifier: torch.Tensor,
    task: Task,
    model: torch.nn.Module,
    prompts: torch.Tensor,
    comps: torch.Tensor,
    mask: torch.Tensor,
    groups: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The (N,) reward the policy is trained on under ``source`` (see the module docstring), and the step's
    metrics of its parts: ``vote_reward_mean`` (fraction of responses agreeing with their group's majority),
    ``vote_correct_frac`` (fraction of responses that are both the majority answer and verified correct),
    ``self_certainty_mean``; ``{}`` for the verifier."""
    if source not in REWARD_SOURCES:
        raise ValueError(f"reward.source={source!r} is not valid; allowed: {', '.join(REWARD_SOURCES)}")
    if source == "verifier":
        return verifier, {}
    logs: dict[str, float] = {}
    parts = []
    if source in ("vote", "label_free"):
        answers = [task.answer(decode(c)) for c in comps.tolist()]
        vote = cluster_vote(answers, groups)
        logs["vote_reward_mean"] = vote.mean().item()
        logs["vote_correct_frac"] = (vote * verifier).mean().item()
        parts.append(vote)
    if source in ("certainty", "label_free"):
        cert = self_certainty(model, prompts, comps, mask, temperature)
        logs["self_certainty_mean"] = cert.mean().item()
        parts.append(cert)
    if len(parts) == 1:
        return parts[0], logs
    return sum(group_normalized(v, groups) for v in parts), logs
