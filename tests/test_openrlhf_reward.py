"""The math reward file (experiments/rewards/math.py), loaded by path exactly as OpenRLHF's agent loads it, on the
fixture cases (boxed answers, fractions, equivalent forms, wrong, empty, garbage), in the main thread and in the
worker thread OpenRLHF calls it from."""

import asyncio
import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from experiments.openrlhf.argv import REWARD_FILE

CASES = [json.loads(line) for line in (Path(__file__).parent / "fixtures/openrlhf/reward_cases.jsonl").open()]
PROMPT = "<|im_start|>user\nWhat is 17 + 17? Put the answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"


def _load():
    """As openrlhf/utils/agent.py:202 does: spec_from_file_location on the --reward.remote_url path."""
    spec = importlib.util.spec_from_file_location("reward_func", REWARD_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


reward = _load()


def _response(case):
    return case["response"].replace("HUGE", "1+" * 400 + "1")


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_score_cases(case):
    assert reward.score(_response(case), case["label"]) == case["want"]


def test_reward_func_in_openrlhfs_worker_thread():
    """OpenRLHF awaits asyncio.to_thread(reward_func, [query], [prompt], [label]) per sample."""

    async def run_all():
        calls = [asyncio.to_thread(reward.reward_func, [PROMPT + _response(c)], [PROMPT], [c["label"]]) for c in CASES]
        return await asyncio.gather(*calls)

    outs = asyncio.run(run_all())
    for case, out in zip(CASES, outs):
        assert set(out) == {"rewards", "scores", "extra_logs"}
        assert out["rewards"].shape == (1,) and out["rewards"].dtype == torch.float32
        assert out["rewards"].item() == case["want"], case["case"]  # the prompt's own \boxed{} is not the answer
        assert out["scores"].item() == case["want"]
        boxed = out["extra_logs"]["boxed_frac"].item()
        assert boxed == {"integer": 1.0, "wrong": 1.0, "no_box": 0.0, "empty_response": 0.0}.get(case["case"], boxed)


@pytest.mark.parametrize(
    "bad",
    [
        ([None], [None], [None]),
        ([123], ["p"], ["1"]),
        (["\\boxed{1}"], [b"bytes"], [object()]),
        ([PROMPT + "\\boxed{1}"], [PROMPT], [None]),
    ],
)
def test_reward_func_is_total(bad):
    out = reward.reward_func(*bad)
    assert out["rewards"].tolist() == [0.0]


TOWERS = ["9^{9^{9}}", "10^{10^{10}}", "2^{2^{2^{2^{2^{2}}}}}"]


@pytest.mark.parametrize("tower", TOWERS)
def test_exponent_towers_score_zero_within_the_bound_from_a_worker_thread(tower, monkeypatch):
    """A big-integer power cannot be interrupted inside the process (not by math-verify's signal timeouts, which
    do not even arm in a worker thread); the worker process is killed after TIMEOUT_S and the answer scores 0."""
    monkeypatch.setattr(reward, "TIMEOUT_S", 1.0)
    reward.score("\\boxed{1}", "1")  # a warm worker: the bound below is the comparison's alone
    out, start = {}, time.monotonic()
    t = threading.Thread(
        target=lambda: out.update(reward.reward_func([PROMPT + f"\\boxed{{{tower}}}"], [PROMPT], ["1"]))
    )
    t.start()
    t.join(timeout=30)
    elapsed = time.monotonic() - start
    assert not t.is_alive(), f"reward_func({tower}) did not return within 30 s"
    assert out["rewards"].tolist() == [0.0]
    assert elapsed < 1.0 + 15  # the timeout plus killing the worker (and torch's first import), never the power
    # the killed worker is replaced: the next answer is scored normally
    assert reward.reward_func([PROMPT + "\\boxed{34}"], [PROMPT], ["34"])["rewards"].tolist() == [1.0]


def test_openrlhfs_own_loader_and_thread_offload_call_our_file():
    """OpenRLHF's SingleTurnAgentExecutor loads --reward.remote_url FILE.py and awaits reward_func per sample through
    asyncio.to_thread (utils/agent.py); the rewards it gets back are ours."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    ex = SingleTurnAgentExecutor(str(REWARD_FILE))
    assert ex.reward_func.__name__ == "reward_func" and ex.reward_func.__module__ == "reward_func"
    cases = CASES[:4] + [c for c in CASES if c["want"] == 0][:3]
    outs = asyncio.run(
        ex._fetch_rewards_via_func(
            [PROMPT + _response(c) for c in cases], [PROMPT] * len(cases), [c["label"] for c in cases]
        )
    )
    assert [o["rewards"].item() for o in outs] == [c["want"] for c in cases]


def test_last_boxed():
    assert reward.last_boxed("a \\boxed{x} then \\fbox{\\{1,2\\}}") == "\\{1,2\\}"
    assert reward.last_boxed("\\boxed 5 apples") == "5"
    assert reward.last_boxed("\\boxed{3") is None and reward.last_boxed(None) is None
