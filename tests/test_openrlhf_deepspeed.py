"""A real OpenRLHF 0.11.2 training step with real DeepSpeed on CPU (ZeRO-2 and ZeRO-3, gloo), through the NSR layer.

Each scenario runs tests/fixtures/openrlhf/real_step.py in its own process per data-parallel rank (module doc there:
OpenRLHF's real Actor on a random tiny Qwen2 saved locally, the NSR actor subclass's init_model_from_pretrained,
fit -> ppo_train -> training_step with NSRPolicyLoss, DeepSpeed's backward and step, checkpoint and resume). Only
vLLM generation, three CUDA calls and Ray are replaced. Checked:
* ``hard`` gives exactly OpenRLHF's own PolicyLoss (loss and gradient, every micro-batch) inside the real step;
  ``nsr`` at delta 0 equals it too, and ``nsr`` at delta 0.5 does not (it rescues clipped tokens);
* the metrics.jsonl row built from the real status dict has every field, each from the key it maps;
* a resume restores the RL step (the loss's streams) and the weights;
* two data-parallel ranks agree on every reduced metric and draw different z;
* ``--nsr.dgg`` gates a surging optimizer step under ZeRO-2 and ZeRO-3 (DeepSpeed skips it: weights, Adam state and
  LR schedule untouched), both stages measure the same lm_head gradient norm, and the gate's window survives a resume.

Cost: DeepSpeed builds its CPU shared-memory comm op once (cached in TORCH_EXTENSIONS_DIR); the optimizer is
DeepSpeed's torch_adam AdamW, so no FusedAdam op is built. Each scenario then takes 20-40 s on 2 idle cores.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nsr
from nsr.openrlhf.metrics import REQUIRED, premise_row_from_logs

pytest.importorskip("deepspeed", reason="deepspeed==0.19.6 (requirements-cpu.txt) runs the real training step")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "fixtures" / "openrlhf" / "real_step.py"


@pytest.fixture(scope="module")
def model(tiny_qwen2):
    return tiny_qwen2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_step(model, ckpt, *flags, world=1, timeout=600) -> list[dict]:
    """One scenario: ``world`` rank processes of the harness; their JSON outputs, by rank."""
    port, procs, outs = _free_port(), [], []
    for rank in range(world):
        out = Path(ckpt).parent / f"{Path(ckpt).name}-rank{rank}.json"
        argv = [sys.executable, str(HARNESS), "step", "--model", str(model), "--ckpt", str(ckpt), "--out", str(out)]
        argv += ["--rank", str(rank), "--world", str(world), "--port", str(port), *flags]
        procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs.append(out)
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [json.loads(o.read_text()) for o in outs]


@pytest.fixture(scope="module")
def hard(model, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("hard") / "ckpt"
    (out,) = run_step(model, ckpt, "--rule", "hard", "--zero", "2", "--save")
    return out, ckpt


def test_hard_is_openrlhfs_policy_loss_in_the_real_step(hard):
    out, _ = hard
    assert out["loss_class"] == "NSRPolicyLoss" and out["parent"] == "openrlhf.models.loss.PolicyLoss"
    probe = out["probe"]
    assert probe["calls"] == 8  # 2 epochs x 4 micro-batches, every one through NSRPolicyLoss
    assert probe["clip"] > 0  # clipped tokens exist, so the comparison covers the clip
    assert probe["loss_diff"] == 0.0 and probe["grad_diff"] == 0.0  # bit for bit
    assert out["weights_after"] != out["weights_at_start"]  # DeepSpeed stepped the optimizer
    assert out["loaded_equals_saved"]  # the Actor loaded the saved model


def test_metrics_row_from_the_real_status_dict(hard):
    out, _ = hard
    row, status = out["row"], out["status"]
    assert set(REQUIRED) <= set(row) and all(row[k] is not None for k in REQUIRED)
    for ours, theirs in REQUIRED.items():  # each field is the first of its keys that OpenRLHF really logged
        assert row[ours] == next(status[k] for k in theirs if k in status), ours
    assert row["entropy"] == status["entropy_loss"]  # --actor.entropy_coef 0 here: OpenRLHF's own entropy
    assert abs(status["nsr_entropy_mc"] - status["entropy_loss"]) < 0.5  # the free estimate is close
    assert row["clip_frac"] == status["ppo_clip_ratio"] and out["nsr_rl_step_after"] == 1
    # the premise meter's counts of the step (8 micro-batches): hard rescues nothing, and its clipped tokens over its
    # tokens are OpenRLHF's token-weighted mean of the loss's clip fraction
    bins = premise_row_from_logs(1, status, nsr.LossConfig(rule="hard", eps_low=0.2, eps_high=0.28))
    clipped = sum(bins["pos_clipped"]) + sum(bins["neg_clipped"])
    assert clipped > 0 and sum(bins["pos_rescued"]) + sum(bins["neg_rescued"]) == 0
    assert clipped / status["nsr_premise_tokens"] == pytest.approx(status["nsr_clip_frac"], rel=1e-6)


def test_resume_restores_the_rl_step_and_the_weights(model, hard):
    out, ckpt = hard
    assert (ckpt / "_actor" / "latest").read_text().strip() == "global_step1"
    (resumed,) = run_step(model, ckpt, "--rule", "hard", "--zero", "2", "--resume")
    assert resumed["resumed_global_step"] == 1 and resumed["nsr_rl_step"] == 1  # streams continue at step 2
    assert resumed["weights_at_start"] == out["weights_after"]


def test_the_cpu_runs_fused_adam_is_torchs_adamw_loop_to_float32_rounding(model, tmp_path):
    """The optimizer of a CPU run (nsr/openrlhf/cpu_shim.py ADAM_PARAMS: torch's fused CPU AdamW, one pass over the
    weights) against DeepSpeed's default torch_adam (torch's per-tensor loop), in a float32 actor (--nsr.fp32): the
    same step to float32 rounding (measured: max abs difference 1.4e-7 after 4 AdamW steps at lr 1e-3)."""
    outs, weights = {}, {}
    for adam in ("fused", "loop"):
        w = tmp_path / f"{adam}.pt"
        (tmp_path / adam).mkdir()
        (outs[adam],) = run_step(model, tmp_path / adam / "ckpt", "--fp32", "--adam", adam, "--weights-out", str(w))
        weights[adam] = torch.load(w)
    assert (outs["fused"]["fused"], outs["loop"]["fused"]) == (True, None)  # the kernel each step ran
    for out in outs.values():
        assert out["param_dtype"] == "torch.float32" and out["optimizer"] == "AdamW"
        assert out["probe"]["loss_diff"] == 0.0 and out["weights_after"] != out["weights_at_start"]
    assert weights["fused"].keys() == weights["loop"].keys()
    for name, value in weights["loop"].items():
        torch.testing.assert_close(weights["fused"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_nsr_at_delta_zero_equals_hard(model, tmp_path):
    (out,) = run_step(model, tmp_path / "ckpt", "--rule", "nsr", "--delta", "0", "--zero", "2")
    probe = out["probe"]
    assert probe["calls"] == 8 and probe["clip"] > 0
    assert probe["loss_diff"] < 1e-6 and probe["grad_diff"] < 1e-6  # nsr's own path, OpenRLHF's numbers
    assert out["status"]["nsr_rescue_frac"] == 0.0


def test_two_zero3_ranks_agree_and_nsr_rescues(model, tmp_path):
    outs = run_step(model, tmp_path / "ckpt", "--rule", "nsr", "--delta", "0.5", "--zero", "3", world=2)
    # ZeRO-3 loading on gloo needs stage3_allgather_sequential (the harness's module doc: without it DeepSpeed's
    # coalesced all-gather corrupted 1 load in 2-4 and the step's metrics were NaN); the weights are the saved ones
    assert all(o["loaded_equals_saved"] for o in outs)
    a, b = (o["status"] for o in outs)
    reduced = [k for k in a if k.startswith(("policy_loss", "ppo_", "nsr_", "actor_", "rollout/"))]
    assert reduced and all(a[k] == a[k] for k in reduced)  # no NaN
    assert {k: (a[k], b[k]) for k in reduced if a[k] != pytest.approx(b[k], rel=1e-6)} == {}
    assert [o["world"] for o in outs] == [2, 2] and [o["loss_rank"] for o in outs] == [0, 1]  # different z
    assert a["nsr_rescue_frac"] > 0  # clipped tokens got a gradient: the rule is in the step
    bins = premise_row_from_logs(1, a, nsr.LossConfig(rule="nsr", delta=0.5))  # both ranks' counts, summed
    rescued = [x + y for x, y in zip(bins["pos_rescued"], bins["neg_rescued"])]
    assert sum(rescued[:-1]) > 0 and rescued[-1] == 0  # rescued inside the zone only
    assert sum(rescued) / a["nsr_premise_tokens"] == pytest.approx(a["nsr_rescue_frac"], rel=1e-6)
    assert all(o["probe"]["grad_diff"] > 0 for o in outs)  # so it is not PolicyLoss
    assert outs[0]["weights_after"] == outs[1]["weights_after"]  # one model after the step


# ---------------------------------------------------------------- Dynamic Gradient Gating on the DeepSpeed engine
@pytest.fixture(scope="module")
def dgg_runs(model, tmp_path_factory):
    """--nsr.dgg on two ranks under ZeRO-2 (saved) and ZeRO-3; the loss of optimizer step 2 (of 4) is multiplied
    by 100, a gradient surge."""
    out = {}
    for zero in (2, 3):
        ckpt = tmp_path_factory.mktemp(f"dgg-zero{zero}") / "ckpt"
        flags = ["--rule", "hard", "--zero", str(zero), "--dgg", "--surge-update", "2"]
        out[zero] = (run_step(model, ckpt, *flags, *(["--save"] if zero == 2 else []), world=2), ckpt)
    return out


@pytest.mark.parametrize("zero", [2, 3])
def test_dgg_gates_the_surge_and_deepspeed_skips_that_step(dgg_runs, zero):
    outs, _ = dgg_runs[zero]
    a, b = (o["dgg"] for o in outs)
    assert a["norms"] == b["norms"] and a["gated"] == b["gated"]  # one decision on every rank
    assert a["gated"] == [False, False, True, False]  # only the surge
    norms = a["norms"]
    assert norms[2] > 3 * max(norms[:2]) and all(0 < v < 10 for i, v in enumerate(norms) if i != 2)
    # the gate's norm, summed from each rank's ZeRO fragment, is the norm of DeepSpeed's assembled gradient
    assert norms == pytest.approx([u["full_norm"] for u in a["updates"]], rel=1e-5)
    assert a["skipped_steps"] == 1
    for i, u in enumerate(a["updates"]):
        if a["gated"][i]:  # no update: weights, Adam's step count and the LR schedule as before
            assert not u["applied"] and not u["weights_changed"]
            assert u["adam_steps"][1] == u["adam_steps"][0] and u["lr"][1] == u["lr"][0]
        else:
            assert u["applied"] and u["adam_steps"][1] == u["adam_steps"][0] + 1 and u["lr"][1] != u["lr"][0]
            assert u["weights_changed"] == (u["lr"][0] > 0)  # the warm-up's first step has lr 0
    row = outs[0]["row"]  # the metrics.jsonl row the controller writes
    assert row["dgg_gated"] == 1.0 and row["lm_head_grad_norm"] == pytest.approx(sum(norms) / 4)
    assert outs[0]["weights_after"] == outs[1]["weights_after"]


def test_dgg_norm_agrees_across_zero_stages_and_its_window_survives_a_resume(model, dgg_runs):
    """ZeRO-2 assembles the lm_head gradient from the optimizer's partitions (all-reduce), ZeRO-3 from the fp32
    partitions (all-gather): two code paths, one gradient."""
    z2, z3 = (dgg_runs[z][0][0]["dgg"]["norms"] for z in (2, 3))
    assert z2 == pytest.approx(z3, rel=1e-3)
    outs, ckpt = dgg_runs[2]
    resumed = run_step(model, ckpt, "--rule", "hard", "--zero", "2", "--dgg", "--resume", world=2)
    assert all(r["dgg_history_at_start"] == outs[0]["dgg"]["history"] for r in resumed)
