"""experiments.openrlhf.profile_actor on the SmolLM2 OpenRLHF CPU preset at 2 prompts x 2 samples (about 20 s a call):
the policy rank built as a CPU run builds it (OpenRLHF's Actor, DeepSpeed engine, NSRPolicyLoss), one rollout's
old-log-prob pass and fit, each part timed (times are not compared: a shared machine); with --full-logits and
--loop-adam the savings they switch off are off (OpenRLHF's own forward over every position, torch's per-tensor AdamW
loop)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openrlhf", reason="openrlhf==0.11.2 (requirements-cpu.txt)")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "sweeps" / "presets" / "smollm2-openrlhf-cpu.yaml"
SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "train.minibatches=2",
         "openrlhf.micro_rollout_batch_size=2"]  # fmt: skip


def profile(tmp_path, *flags):
    out = tmp_path / ("-".join(flags) or "default")
    cmd = [sys.executable, "-m", "experiments.openrlhf.profile_actor", str(PRESET), *SMALL, "--rollouts", "1",
           "--json", str(out), *flags]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=600)
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_profile_actor_times_the_policy_ranks_parts(machine_threads, tmp_path):
    (row,) = profile(tmp_path)
    assert row["rollout"] == 1 and row["updates"] == 2 and not row["full_logits"] and not row["loop_adam"]
    for key in ("old_logprobs_s", "fit_s", "optimizer_step_s", "backward_s", "forward_mlp_s", "backward_mlp_s"):
        assert row[key] > 0, key
    assert row["fit_s"] >= row["optimizer_step_s"] + row["backward_s"]
    assert row["forward_log_softmax_s"] > 0 and row["peak_rss_gib"] > 0
    (full,) = profile(tmp_path, "--full-logits", "--loop-adam")
    assert full["full_logits"] and full["loop_adam"] and full["updates"] == 2
    assert full["old_logprobs_log_softmax_s"] > 0 and full["fit_s"] > 0  # (no timing compared: a shared machine)
