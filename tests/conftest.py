import contextlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


def make_batch(B=8, T=16, seed=0, spread=0.3, pad=True, dtype=torch.float64, adv_per_token=False):
    """A padded (B, T) batch whose ratios straddle both clip bounds."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g, dtype=dtype) * 0.5 - 2.0
    logp = (old + torch.randn(B, T, generator=g, dtype=dtype) * spread).requires_grad_()
    if adv_per_token:
        adv = torch.randn(B, T, generator=g, dtype=dtype)
    else:
        adv = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T).clone()
        adv[0] = 0.0  # a zero-advantage response
    if pad:
        lens = torch.randint(0, T + 1, (B,), generator=g)
        lens[-1] = T  # at least one full row
        mask = torch.arange(T)[None, :] < lens[:, None]
    else:
        mask = torch.ones(B, T, dtype=torch.bool)
    return logp, old, adv, mask


MACHINE_THREADS = str(min(2, os.cpu_count() or 1))
"""NSR_THREADS of the real-model tests unless the caller set it: `make test` runs one test at a time, so a SmolLM2 run
uses the cores a run of the presets reserves (2) instead of NSR_THREADS' default of 1."""


@pytest.fixture(scope="module")
def machine_threads():
    """NSR_THREADS for a module of real-model tests (the caller's value, else :data:`MACHINE_THREADS`), applied to
    torch by the runs' own experiments.threads.set_threads; both restored after the module."""
    from experiments.threads import set_threads

    saved = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NSR_THREADS", os.environ.get("NSR_THREADS") or MACHINE_THREADS)
        yield set_threads()
    torch.set_num_threads(saved)


def skip_or_fail(why: str | None) -> None:
    """Nothing when ``why`` is None; else skip the test with ``why``, or fail it under CI=true (CI runs what the
    suite claims: a missing prerequisite there is a failure, not a skip)."""
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {why}")
        pytest.skip(why)


def assert_rescue_bins(hard: list[dict], nsr: list[dict], delta: float) -> None:
    """ratio_bins.jsonl rows of a hard and an nsr run (noisy executor): hard clips on each side and rescues nothing;
    nsr rescues inside the zone only (deep violations, the last bin, never), and each bin's logged weight is that of
    its rescued tokens, each between 1 - delta and 1 + delta."""
    for side in ("pos", "neg"):
        assert sum(sum(r[f"{side}_rescued"]) for r in hard) == 0
        assert sum(sum(r[f"{side}_clipped"]) for r in hard) > 0
        rescued = [sum(col) for col in zip(*(r[f"{side}_rescued"] for r in nsr))]
        weight = [sum(col) for col in zip(*(r[f"{side}_weight"] for r in nsr))]
        assert sum(rescued[:-1]) > 0 and rescued[-1] == 0  # deep violations (last bin) are never rescued
        for k, w in zip(rescued, weight):
            assert k * (1 - delta) * 0.999 <= w <= k * (1 + delta) * 1.001


@pytest.fixture
def batch():
    return make_batch()


@contextlib.contextmanager
def run_environment(tmp_path_factory, cache: str = "nsr-cache", **env: str):
    """A warm-start cache under the session's temp folder (NSR_CACHE_DIR), NSR_THREADS=1 unless set, and ``env``
    (e.g. NSR_WARM_STARTS=""); yields the cache path. The environment and torch's thread count are restored after.

    One thread: on a shared 2-core box, two OpenMP threads stall when other jobs run (docs/testbed.md).
    """
    path = tmp_path_factory.getbasetemp() / cache
    keys = ("NSR_CACHE_DIR", "NSR_THREADS", *env)
    saved = {k: os.environ.get(k) for k in keys}
    threads = torch.get_num_threads()
    os.environ["NSR_CACHE_DIR"] = str(path)
    os.environ.setdefault("NSR_THREADS", "1")
    os.environ.update(env)
    try:
        yield path
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run_env(tmp_path_factory):
    """:func:`run_environment` for a test module's runs: one warm-start cache shared by the session's runs."""
    with run_environment(tmp_path_factory) as path:
        yield path


REAL_STEP = Path(__file__).resolve().parent / "fixtures" / "openrlhf" / "real_step.py"
"""The harness that runs OpenRLHF's real actor step on a random tiny Qwen2 (its module doc)."""


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A random tiny Qwen2 folder (config, weights, tokenizer) made by the real-step harness once per session."""
    spec = importlib.util.spec_from_file_location("real_step", REAL_STEP)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    mod.make_model(path)
    return path
