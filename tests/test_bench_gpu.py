"""The GPU benchmark script (experiments/bench/gpu.py) runs end to end at its CPU smoke size: the batched trainer at
two batch sizes and the loss table against OpenRLHF's PolicyLoss (no timing is asserted)."""

import json

import pytest
import torch

from experiments.bench import gpu as bench_gpu

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)


@pytest.fixture
def hermetic(tmp_path, monkeypatch):
    monkeypatch.setenv("NSR_CACHE_DIR", str(tmp_path / "cache"))  # no warm start: each run's own random init
    monkeypatch.setenv("NSR_WARM_STARTS", "")
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)


def test_bench_gpu_smoke_on_cpu(hermetic, capsys):
    out = hermetic / "bench.json"
    assert bench_gpu.main(["--device", "cpu", "--small", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["S"] for r in res["trainer"]] == [1, 2] and res["weights"].startswith("random init")
    for r in res["trainer"]:
        assert r["step_s"] > 0 and r["run_steps_per_s"] == pytest.approx(r["S"] / r["step_s"])
        assert r["runs_per_hour"] == pytest.approx(3600 * r["S"] / (r["step_s"] * r["train_steps"]))
    loss = res["loss"]
    assert loss["B"] == 4 and loss["T"] == 64 and loss["rows"][0]["loss"] == "openrlhf"
    assert {r["loss"] for r in loss["rows"]} >= {"openrlhf", "hard", "nsr", "clip_cov", "kl_cov"}
    printed = capsys.readouterr().out
    assert "run-steps / s" in printed and "x OpenRLHF" in printed and res["device"].startswith("cpu")


def test_bench_gpu_refuses_what_it_cannot_run(hermetic, capsys):
    if not torch.cuda.is_available():
        assert bench_gpu.main([]) == 2 and "no CUDA device" in capsys.readouterr().err
    assert bench_gpu.main(["--device", "cpu", "--rule", "nope"]) == 2
    assert "--rule 'nope' is not valid" in capsys.readouterr().err
