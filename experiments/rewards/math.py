"""Math reward for OpenRLHF 0.11.2's ``--reward.remote_url /abs/path/reward.py``: 1 if the response's last
``\\boxed{...}`` is equivalent to the label (math-verify), else 0.

OpenRLHF loads this file by path inside every vLLM rollout actor (utils/agent.py) and calls
``reward_func(queries, prompts, labels)`` with lists of length 1 from a worker thread (``asyncio.to_thread``);
``queries`` is the decoded prompt + response. It swallows exceptions (reward None), so the function is total:
garbage, empty or unparsable input scores 0, never raises.

Bounded time: math-verify's own timeouts use ``signal.alarm``, which works only in a main thread, and cannot stop
a big-integer power (``\\boxed{9^{9^{9}}}`` runs for minutes inside one C call). So the comparison runs in a
small pool of worker processes (this file run as ``python -I reward.py --serve``, at most MAX_WORKERS per
process that calls it); a comparison that has not answered after TIMEOUT_S seconds scores 0 and its worker is killed
and replaced. One call therefore returns within TIMEOUT_S plus a worker start (STARTUP_TIMEOUT_S at most), plus
the wait for a free worker when more than MAX_WORKERS threads call at once. Answers longer than MAX_ANSWER_CHARS
score 0 without a comparison. Self-contained (torch and math-verify only): it must load in any Ray worker.

The offline evaluator (experiments/evaluation/math.py) scores with the same :func:`score`.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import re
import select
import subprocess
import sys
import threading

# math-verify warns on every call made without a timeout; the workers call it with one, in their main thread
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_ANSWER_CHARS = 300
"""A boxed answer longer than this is not a final answer (scored 0 without parsing)."""
TIMEOUT_S = 5.0
"""Wall-clock bound of one comparison (parse + verify) in a worker process; past it the answer scores 0."""
STARTUP_TIMEOUT_S = 120.0
"""Bound on starting a worker (importing math-verify and sympy)."""
MAX_WORKERS = 4
"""Worker processes per calling process (OpenRLHF calls from up to min(32, CPUs + 4) threads per rollout actor)."""


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


def equivalent(pred: str, label: str) -> bool:
    """math-verify's verdict on two answers, in the calling (main) thread: the workers' code."""
    from math_verify import parse, verify

    t = max(1, int(TIMEOUT_S))  # signal.alarm inside math-verify: stops the pure-Python part early
    gold = parse(f"${label.strip()}$", parsing_timeout=t)
    guess = parse(f"${pred.strip()}$", parsing_timeout=t)
    return bool(gold and guess and verify(gold, guess, timeout_seconds=t))


class _Worker:
    """One ``python -I reward.py --serve`` process: a JSON line [pred, label] in, a JSON line 0/1 out."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-I", __file__, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        if self._read(STARTUP_TIMEOUT_S) != "ready":
            self.kill()
            raise RuntimeError("the reward worker did not start")

    def _read(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().strip() if ready else None

    def ask(self, pred: str, label: str) -> float | None:
        """1.0 / 0.0, or None when the worker did not answer within TIMEOUT_S (then it is dead)."""
        try:
            self.proc.stdin.write(json.dumps([pred, label]) + "\n")
            self.proc.stdin.flush()
            line = self._read(TIMEOUT_S)
        except (OSError, ValueError):
            line = None
        if not line:
            self.kill()
            return None
        return float(json.loads(line))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_idle: queue.LifoQueue = queue.LifoQueue()
_all: list[_Worker] = []
_lock = threading.Lock()


def _acquire() -> _Worker:
    try:
        return _idle.get_nowait()
    except queue.Empty:
        pass
    with _lock:
        start = len(_all) < MAX_WORKERS
        if start:
            _all.append(None)  # reserve the slot; the worker starts outside the lock
    if not start:
        return _idle.get()
    try:
        w = _Worker()
    except BaseException:
        with _lock:
            _all.remove(None)
        raise
    with _lock:
        _all[_all.index(None)] = w
    return w


def _release(w: _Worker, alive: bool) -> None:
    if alive:
        _idle.put(w)
        return
    with _lock:
        _all.remove(w)


@atexit.register
def _stop_workers() -> None:
    for w in list(_all):
        if w is not None:
            w.kill()


def score(response: str, label: str) -> float:
    """1.0 if the last boxed answer of ``response`` equals ``label`` mathematically (math-verify), else 0.0.
    Total, and bounded in time (module doc): an answer math-verify cannot settle within TIMEOUT_S scores 0."""
    try:
        if not isinstance(label, str) or not label.strip():
            return 0.0
        pred = last_boxed(response)
        if pred is None or not pred.strip() or len(pred) > MAX_ANSWER_CHARS:
            return 0.0
        w = _acquire()
        verdict = w.ask(pred, label)
        _release(w, verdict is not None)
        return verdict or 0.0
    except Exception:  # noqa: BLE001 - a reward must never raise (OpenRLHF would log and drop the sample)
        return 0.0


def reward_func(queries, prompts, labels, **kwargs) -> dict:
    """OpenRLHF's contract: {"rewards": (N,) tensor, "scores": (N,) tensor, "extra_logs": {name: (N,) tensor}}."""
    import torch

    try:
        values = [score(response_of(q, p), lab) for q, p, lab in zip(queries, prompts, labels)]
        boxed = [float(last_boxed(response_of(q, p)) is not None) for q, p in zip(queries, prompts)]
    except Exception:  # noqa: BLE001 - malformed batch: zero reward, still the right shape
        n = len(queries) if hasattr(queries, "__len__") else 1
        values, boxed = [0.0] * n, [0.0] * n
    rewards = torch.tensor(values, dtype=torch.float32)
    return {"rewards": rewards, "scores": rewards.clone(), "extra_logs": {"boxed_frac": torch.tensor(boxed)}}


def serve() -> None:
    """The worker loop: answer each [pred, label] line with 1 or 0 until stdin closes."""
    equivalent("\\frac{1}{2}", "0.5")  # imports and warms math-verify before the first timed answer
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            pred, label = json.loads(line)
            ok = equivalent(pred, label)
        except Exception:  # noqa: BLE001 - unparsable input is a wrong answer
            ok = False
        print(1 if ok else 0, flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
