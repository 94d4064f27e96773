"""Math reward for OpenRLHF 0.11.2's ``--reward.remote_url /abs/path/reward.py``: 1 if the response's last
``\\boxed{...}`` is equivalent to the label (math-verify), else 0.

OpenRLHF loads this file by path inside every vLLM rollout actor (utils/agent.py) and calls
``reward_func(queries, prompts, labels)`` with lists of length 1 from a worker thread (``asyncio.to_thread``);
``queries`` is the decoded prompt + response. It swallows exceptions (reward None), so the function is total:
garbage, empty or unparsable input scores 0, never raises. math-verify's timeouts use ``signal.alarm``, which only
works in the main thread; in other threads the input sizes are capped instead (answers longer than MAX_ANSWER_CHARS
score 0). Self-contained (torch and math-verify only): it must load in any Ray worker.

The offline evaluator (experiments/openrlhf/evaluate.py) scores with the same :func:`score`.
"""

from __future__ import annotations

import logging
import re
import threading

import torch

# math-verify warns on every call made without a timeout (worker threads); the size cap below replaces it
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_ANSWER_CHARS = 300
"""A boxed answer longer than this is not a final answer (and would be slow to parse without a timeout)."""


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced) or ``\\boxed 5``, else None."""
    if not isinstance(text, str):
        return None
    hits = [(text.rfind(cmd), cmd) for cmd in ("\\boxed", "\\fbox")]
    start, cmd = max(hits)
    if start < 0:
        return None
    i = start + len(cmd)
    if text[i : i + 1] != "{":
        m = re.match(r" +([^\s$]+)", text[i:])  # "\boxed 5"
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: the response was cut off inside the box


def response_of(query: str, prompt: str) -> str:
    """The response part of OpenRLHF's ``query`` (prompt + response), or the whole query if the prompt differs."""
    if isinstance(prompt, str) and prompt and query.startswith(prompt):
        return query[len(prompt) :]
    return query


def score(response: str, label: str) -> float:
    """1.0 if the last boxed answer of ``response`` equals ``label`` mathematically (math-verify), else 0.0. Total."""
    try:
        if not isinstance(label, str) or not label.strip():
            return 0.0
        pred = last_boxed(response)
        if pred is None or not pred.strip() or len(pred) > MAX_ANSWER_CHARS:
            return 0.0
        from math_verify import parse, verify

        main = threading.current_thread() is threading.main_thread()
        t = 5 if main else None  # signal.alarm timeouts only in the main thread
        gold = parse(f"${label.strip()}$", parsing_timeout=t)
        guess = parse(f"${pred.strip()}$", parsing_timeout=t)
        if not gold or not guess:
            return 0.0
        return 1.0 if verify(gold, guess, timeout_seconds=t) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never raise (OpenRLHF would log and drop the sample)
        return 0.0


def reward_func(queries, prompts, labels, **kwargs) -> dict:
    """OpenRLHF's contract: {"rewards": (N,) tensor, "scores": (N,) tensor, "extra_logs": {name: (N,) tensor}}."""
    try:
        values = [score(response_of(q, p), lab) for q, p, lab in zip(queries, prompts, labels)]
        boxed = [float(last_boxed(response_of(q, p)) is not None) for q, p in zip(queries, prompts)]
    except Exception:  # noqa: BLE001 - malformed batch: zero reward, still the right shape
        n = len(queries) if hasattr(queries, "__len__") else 1
        values, boxed = [0.0] * n, [0.0] * n
    rewards = torch.tensor(values, dtype=torch.float32)
    return {"rewards": rewards, "scores": rewards.clone(), "extra_logs": {"boxed_frac": torch.tensor(boxed)}}
