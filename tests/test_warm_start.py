"""Each tiny run records the warm start it starts from (key and weights sha256); committed warm starts are used before
the cache; a run never resumes from other weights than it started from."""

import os
import shutil

import pytest
import torch

from experiments.config import load_config
from experiments.run import run
from experiments.rundir import REPO_ROOT, RunDir
from experiments.sft import sft_key, sft_path, warm_start, weights_sha256

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

SMOKE = REPO_ROOT / "sweeps" / "presets" / "tiny-smoke.yaml"
QUICK = ["sft.steps=3", "sft.warmup=1", "train.steps=2", "eval.every=0", "eval.n_prompts=8"]
QUICK += ["logging.checkpoint_every=1"]


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("NSR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("NSR_WARM_STARTS", str(tmp_path / "committed"))
    monkeypatch.setenv("NSR_THREADS", "1")
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)


def test_weights_hash_ignores_the_file_and_sees_one_changed_weight():
    state = {"b": torch.zeros(3), "a": torch.arange(4.0)}
    h = weights_sha256(state)
    assert h == weights_sha256(dict(reversed(state.items())))  # name order, not insertion order
    state["a"][2] = torch.nextafter(state["a"][2], torch.tensor(9.0))  # one ulp
    assert weights_sha256(state) != h


def test_a_run_records_its_warm_start(env):
    cfg = load_config(SMOKE, QUICK)
    run(cfg, env / "run", progress=False)
    meta = RunDir(env / "run").read_config()["meta"]
    blob = torch.load(sft_path(cfg), weights_only=True)
    assert meta["warm_start"] == {"key": sft_key(cfg), "sha256": weights_sha256(blob["state_dict"])}


def test_a_committed_warm_start_is_used_before_the_cache(env):
    cfg = load_config(SMOKE, QUICK)
    state, info = warm_start(cfg)
    assert info["source"] == "cache"
    other = {k: v + 1e-3 for k, v in state.items()}  # as if built on another CPU
    (env / "committed").mkdir()
    torch.save({"state_dict": other, "info": {"key": sft_key(cfg)}}, env / "committed" / f"{sft_key(cfg)}.pt")
    got, info = warm_start(cfg)
    assert info["source"] == "committed" and info["sha256"] == weights_sha256(other) != weights_sha256(state)
    os.environ["NSR_WARM_STARTS"] = ""  # empty: no committed store
    assert warm_start(cfg)[1]["source"] == "cache"


def test_a_run_does_not_resume_from_other_weights(env):
    cfg = load_config(SMOKE, [*QUICK, "train.steps=3", "logging.keep_checkpoint=true"])
    out = RunDir(env / "run")
    run(cfg, out.path, progress=False)
    shutil.copy(out.checkpoint_path, env / "ck.pt")
    status = out.status()
    status["state"] = "cancelled"  # as if killed after its last checkpoint
    out.status_path.write_text(__import__("json").dumps(status))
    state, _ = warm_start(cfg)
    sft_path(cfg).unlink()
    torch.save({"state_dict": {k: v * 1.001 for k, v in state.items()}, "info": {}}, sft_path(cfg))
    with pytest.raises(RuntimeError, match="started from warm start"):
        run(cfg, out.path, progress=False)


def test_the_analysis_pairs_only_runs_from_the_same_weights():
    """A hard and an nsr run of one seed are a pair only when they started from the same warm start; runs made
    before the hash was recorded ("") pair with each other only."""
    import pandas as pd

    from analysis.summary import pairs
    from analysis.tables import compare

    s = pd.DataFrame(
        {
            "label": ["hard"] * 4 + ["nsr"] * 4,
            "seed": [0, 1, 2, 3] * 2,
            "warm_start": ["", "aa", "bb", "cc", "", "aa", "bb", "xx"],  # seed 3: nsr started from other weights
            "legacy": [False] * 8,
            "pass@1": [0.1, 0.2, 0.3, 0.4, 0.2, 0.25, 0.3, 0.9],
        }
    )
    assert pairs(s)[:2] == [(0, ""), (1, "aa")]
    r = compare(s, "nsr", "hard", "pass@1")
    assert r["n"] == 3 and [k[0] for k in r["seeds"]] == [0, 1, 2]
    assert r["mean"] == pytest.approx((0.1 + 0.05 + 0.0) / 3)  # seed 3's 0.9 - 0.4 is not a pair


def test_committed_warm_starts_are_the_weights_the_committed_runs_record():
    """Every committed warm start hashes to what the committed runs that name its key recorded (the file is theirs)."""
    from experiments.rundir import RUNS_ROOT

    store = REPO_ROOT / "results" / "warm_starts"
    files = sorted(store.glob("*.pt"))
    assert files
    recorded: dict[str, set[str]] = {}
    for cfg in RUNS_ROOT.rglob("config.yaml"):
        ws = (RunDir(cfg.parent).read_config().get("meta") or {}).get("warm_start")
        if ws:
            recorded.setdefault(ws["key"], set()).add(ws["sha256"])
    for f in files:
        blob = torch.load(f, weights_only=True)
        assert recorded.get(f.stem) == {weights_sha256(blob["state_dict"])}, f.name
