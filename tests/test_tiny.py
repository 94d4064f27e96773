"""The tiny backend end to end: the run-folder contract, determinism, NSR vs hard, kill + resume, the SFT cache.

Runs use the real ``sweeps/presets/tiny-smoke.yaml`` (30 RL steps) with a per-session warm-start cache.
"""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import assert_rescue_bins

from experiments.config import load_config
from experiments.models.tiny import build_model, generate, logprobs, response_mask
from experiments.run import run
from experiments.rundir import REPO_ROOT, RunDir, read_jsonl
from experiments.sft import warm_start
from experiments.tasks.countdown import EOS, get_task
from experiments.tiny.train import train
from nsr.seeds import generator

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

SMOKE = REPO_ROOT / "sweeps" / "presets" / "tiny-smoke.yaml"
METRIC_FIELDS = {
    "step", "reward_mean", "entropy", "response_len", "clip_frac_low", "clip_frac_high", "rescue_frac",
    "pushout_frac", "ppo_kl", "policy_loss", "grad_norm", "wall_s",
}  # fmt: skip


def _run(tmp_path_factory, name, overrides=()):
    out = tmp_path_factory.mktemp(name) / "run"
    run(load_config(SMOKE, list(overrides)), out, progress=False)
    return RunDir(out)


@pytest.fixture(scope="module")
def nsr_run(run_env, tmp_path_factory):
    return _run(tmp_path_factory, "nsr", ["loss.rule=nsr"])


def _metrics(rd: RunDir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in read_jsonl(rd.metrics_path)]


def test_smoke_run_writes_the_full_contract(nsr_run):
    rd = nsr_run
    cfg = load_config(SMOKE, ["loss.rule=nsr"])
    assert rd.state() == "done" and rd.status()["run_hash"] == cfg.run_hash()
    saved = yaml.safe_load(rd.config_path.read_text())
    assert saved["meta"]["run_hash"] == cfg.run_hash() and "torch" in saved["meta"]["versions"]
    assert saved["loss"]["rule"] == "nsr" and saved["train"]["steps"] == 30
    assert not rd.checkpoint_path.exists() and not (rd.path / "eval.jsonl").exists()

    rows = read_jsonl(rd.metrics_path)
    assert [r["step"] for r in rows] == list(range(1, 31))
    for r in rows:
        assert METRIC_FIELDS <= set(r), METRIC_FIELDS - set(r)
        assert all(isinstance(v, (int, float)) and v == v for v in r.values())  # numbers, no NaN
        assert 0 <= r["reward_mean"] <= 1 and r["entropy"] > 0 and 1 <= r["response_len"] <= 8
        assert r["ratio_out_frac"] >= r["clip_frac"] - 1e-9  # a clipped token is outside the region
        n_upd = cfg.train.epochs * cfg.train.minibatches
        assert r["grad_clipped_frac"] in {k / n_upd for k in range(n_upd + 1)}  # a share of the step's updates
        if r["grad_clipped_frac"] == 0:  # no update was norm-clipped: every pre-clip norm, so their mean, is in bound
            assert r["grad_norm"] <= cfg.train.grad_clip
        assert r["clip_frac"] == pytest.approx(r["clip_frac_low"] + r["clip_frac_high"])
    assert sum(r["clip_frac_low"] + r["clip_frac_high"] for r in rows) > 0  # the clip fires: NSR has work

    ev = read_jsonl(rd.eval_path)
    assert rd.eval_path.suffix == ".gz"
    assert {r["step"] for r in ev} == {0, 10, 20, 30}
    for step in (0, 10, 20, 30):
        at = [r for r in ev if r["step"] == step]
        greedy = [r for r in at if r["decoding"] == "greedy"]
        sampled = [r for r in at if r["decoding"] == "sampled"]
        assert len(greedy) == 64 and {r["sample"] for r in greedy} == {0}
        assert len(sampled) == 64 * 4 and {r["sample"] for r in sampled} == {0, 1, 2, 3}
        assert {r["problem_id"] for r in greedy} == {r["problem_id"] for r in sampled}
        assert len({(r["problem_id"], r["decoding"], r["sample"]) for r in at}) == len(at)
    assert {r["correct"] for r in ev} == {0, 1} and {r["benchmark"] for r in ev} == {"countdown3"}
    held_out = set(get_task("countdown3").eval_ids.tolist())
    assert {r["problem_id"] for r in ev} <= held_out


def test_same_seed_gives_identical_rows_except_wall_time(nsr_run, tmp_path_factory):
    again = _run(tmp_path_factory, "nsr-again", ["loss.rule=nsr"])
    assert _metrics(again) == _metrics(nsr_run)
    assert read_jsonl(again.eval_path) == read_jsonl(nsr_run.eval_path)
    other_seed = _run(tmp_path_factory, "nsr-seed1", ["loss.rule=nsr", "seed=1", "train.steps=3", "eval.every=0"])
    assert _metrics(other_seed)[0]["reward_mean"] != _metrics(nsr_run)[0]["reward_mean"]


@pytest.fixture(scope="module")
def hard_run(run_env, tmp_path_factory):
    return _run(tmp_path_factory, "hard", ["loss.rule=hard"])


def test_nsr_rescues_and_hard_does_not(nsr_run, hard_run):
    hard = hard_run
    h, n = _metrics(hard), _metrics(nsr_run)
    assert all(r["rescue_frac"] == 0 for r in h)
    assert sum(r["rescue_frac"] for r in n) > 0
    assert sum(r["clip_frac_high"] + r["clip_frac_low"] for r in h) > 0
    # the same warm start and the same first rollout: only the objective differs
    assert h[0]["reward_mean"] == n[0]["reward_mean"] and h[0]["entropy"] == n[0]["entropy"]
    ev_h, ev_n = read_jsonl(hard.eval_path), read_jsonl(nsr_run.eval_path)
    assert [r for r in ev_h if r["step"] == 0] == [r for r in ev_n if r["step"] == 0]


def test_ratio_bins_log_what_the_rule_did_with_clipped_tokens(nsr_run, hard_run):
    """ratio_bins.jsonl: one row per step; hard keeps no clipped token, nsr rescues only inside the zone, and the
    logged weights are those of rescued tokens (each between 1 - delta and 1 + delta for the noisy executor)."""
    runs = (("hard", hard_run), ("nsr", nsr_run))
    bins = {name: read_jsonl(rd.log_path("ratio_bins.jsonl")) for name, rd in runs}
    assert [r["step"] for r in bins["nsr"]] == [r["step"] for r in _metrics(nsr_run)]
    assert_rescue_bins(bins["hard"], bins["nsr"], delta=0.2)
    total_rescued = sum(sum(r["pos_rescued"]) + sum(r["neg_rescued"]) for r in bins["nsr"])
    assert total_rescued > 0


def test_killed_run_resumes_to_the_same_rows(nsr_run, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.run", str(SMOKE), "loss.rule=nsr", "logging.checkpoint_every=5"]
    cmd += ["--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rd = RunDir(out)
    deadline = time.time() + 240
    try:  # kill once a checkpoint exists and rows past it were written (those must be dropped on resume)
        while not (rd.metrics_path.exists() and len(read_jsonl(rd.metrics_path)) >= 8):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.time() < deadline, "the run did not reach step 8 in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stderr.close()
    assert rd.state() == "running" and rd.checkpoint_path.exists()
    ck = torch.load(rd.checkpoint_path, weights_only=True)
    assert ck["step"] % 5 == 0 and len(read_jsonl(rd.metrics_path)) > ck["step"]

    # logging.checkpoint_every is not part of the run id, so this is the same run and it resumes
    status = run(load_config(SMOKE, ["loss.rule=nsr", "logging.checkpoint_every=5"]), out, progress=False)
    assert status["state"] == "done" and status["attempts"] == 2
    assert _metrics(rd) == _metrics(nsr_run)
    assert read_jsonl(rd.eval_path) == read_jsonl(nsr_run.eval_path)
    assert read_jsonl(rd.log_path("ratio_bins.jsonl")) == read_jsonl(nsr_run.log_path("ratio_bins.jsonl"))
    assert rd.log_path("ratio_bins.jsonl").suffix == ".gz"  # compressed when the run finished
    assert not rd.checkpoint_path.exists()


def test_resume_after_eval_was_compressed(nsr_run, tmp_path_factory):
    """A run that died after gzipping eval.jsonl but before finishing resumes from its last checkpoint."""
    overrides = ["loss.rule=nsr", "train.steps=12", "eval.every=4", "logging.checkpoint_every=8"]
    full = _run(tmp_path_factory, "short", overrides)

    class CrashAfterCompress(RunDir):
        def compress_eval(self):
            super().compress_eval()
            raise RuntimeError("crash")

    cfg = load_config(SMOKE, overrides)
    rd = CrashAfterCompress(tmp_path_factory.mktemp("crash"))
    with pytest.raises(RuntimeError, match="crash"):
        train(cfg, rd, progress=False)
    assert torch.load(rd.checkpoint_path, weights_only=True)["step"] == 8 and (rd.path / "eval.jsonl.gz").exists()
    assert run(cfg, rd.path, progress=False)["state"] == "done"
    assert _metrics(rd) == _metrics(full) and read_jsonl(rd.eval_path) == read_jsonl(full.eval_path)


@pytest.mark.parametrize(
    "overrides, extra_key",
    [
        (["train.kl_coef=0.1", "train.entropy_coef=0.01"], "ref_kl"),
        (["loss.level=sequence", "loss.rule=nsr"], None),
        (["loss.rule=pushout", "advantages.kind=no_std", "train.agg_mode=seq-mean-token-mean"], None),
        (["task.name=add3", "sft.steps=10", "rollout.max_new_tokens=5"], None),
        (["task.name=countdown4", "sft.steps=10", "rollout.max_new_tokens=10"], None),
    ],
)
def test_other_paths_run(run_env, tmp_path_factory, overrides, extra_key):
    rd = _run(tmp_path_factory, "paths", [*overrides, "train.steps=2", "eval.every=0", "eval.n_prompts=8"])
    rows = read_jsonl(rd.metrics_path)
    assert len(rows) == 2 and rd.state() == "done"
    assert all(v == v for r in rows for v in r.values())
    if extra_key:
        assert extra_key in rows[0] and rows[0][extra_key] >= 0
    if "loss.level=sequence" in overrides:  # token ratios against sequence bounds would mean nothing
        assert "ratio_out_frac" not in rows[0]
    if "loss.rule=pushout" in overrides:
        assert sum(r["pushout_frac"] for r in rows) > 0


def test_generation_is_seeded_and_greedy_is_deterministic(nsr_run):
    cfg = load_config(SMOKE)
    model = build_model(cfg.model, generator(0, "init")).eval()
    model.load_state_dict(warm_start(cfg)[0])  # a trained model: no near-ties between logits
    task = get_task("countdown3")
    prompts = task.prompts(task.train_ids[:16])
    a = generate(model, prompts, 8, 1.0, generator(1))
    b = generate(model, prompts, 8, 1.0, generator(1))
    c = generate(model, prompts, 8, 1.0, generator(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    after = (a == EOS).long().cumsum(-1) > 0
    assert (a[after] == EOS).all()  # everything after the first EOS is EOS
    assert torch.equal(generate(model, prompts, 8, greedy=True), generate(model, prompts, 8, greedy=True))
    logp, ent = logprobs(model, prompts, a, with_entropy=True)
    assert logp.shape == a.shape and (logp <= 0).all() and (ent >= 0).all()
    # the KV-cache decoding and the full forward behind the log-probs agree: greedy tokens are the argmax
    greedy = generate(model, prompts, 8, greedy=True)
    seq = torch.cat([prompts, greedy[:, :-1]], 1)
    full = model(input_ids=seq, use_cache=False).logits[:, prompts.shape[1] - 1 :].argmax(-1)
    mask = response_mask(greedy)
    assert torch.equal(full[mask], greedy[mask])


def test_warm_start_is_built_once_by_concurrent_jobs(tmp_path):
    """Two processes that need the same (missing) warm start: one builds it under the lock, the other waits."""
    env = {**os.environ, "NSR_CACHE_DIR": str(tmp_path), "NSR_THREADS": "1"}
    cmd = [sys.executable, "-m", "experiments.sft", str(SMOKE), "sft.steps=20", "sft.seed=7"]
    procs = [subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    infos = [json.loads(p.communicate(timeout=240)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert infos[0]["built_by"] == infos[1]["built_by"]  # one build, read by both
    files = sorted(p.name for p in (tmp_path / "sft").iterdir())
    assert files == [f"{infos[0]['key']}.lock", f"{infos[0]['key']}.pt"]  # no temp file left behind
    assert torch.load(Path(infos[0]["path"]), weights_only=True)["info"]["key"] == infos[0]["key"]


def test_warm_start_eval_is_the_step0_eval_of_a_run(hard_run):
    """`python -m experiments.sft CONFIG --eval` prints the held-out accuracy an RL run logs at step 0."""
    from experiments.sft import main

    cfg_path = Path(hard_run.path) / "config.yaml"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(cfg_path), "--eval"]) == 0
    printed = json.loads(out.getvalue())["eval"]
    rows = read_jsonl(hard_run.eval_path)
    for decoding in ("greedy", "sampled"):
        step0 = [r["correct"] for r in rows if r["step"] == 0 and r["decoding"] == decoding]
        assert step0 and printed[decoding] == pytest.approx(sum(step0) / len(step0))


def test_demo_figure_from_two_runs(nsr_run, hard_run, tmp_path):
    from analysis.demo import _eval_curves, plot

    path = plot({"hard": hard_run.path, "nsr": nsr_run.path}, tmp_path / "fig.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    # pass@k from raw labels: 2 problems x 4 samples with 1 and 0 correct -> pass@1 = 1/8, pass@4 = 1/2
    rows = [{"step": 0, "decoding": "sampled", "problem_id": p, "correct": int(p == 0 and s == 0)} for p in (0, 1)
            for s in range(4)]  # fmt: skip
    assert _eval_curves(rows, k=8) == ([0], [1 / 8], [0.5], 4)
    assert _eval_curves(rows, k=1) == ([0], [1 / 8], [1 / 8], 1)


def test_samples_cli_reads_a_kept_checkpoint(run_env, tmp_path_factory, nsr_run, capsys):
    """``python -m experiments.tiny.samples``: outcome shares of a kept checkpoint, seeded; a folder without one is
    refused with the override that keeps it."""
    from experiments.tiny import samples

    kept = _run(tmp_path_factory, "kept", ["loss.rule=hard", "logging.keep_checkpoint=true"])
    assert kept.checkpoint_path.exists()
    args = [str(kept.path), "--prompts", "16", "--samples", "2", "--top", "3"]
    assert samples.main(args) == 0
    first = capsys.readouterr().out
    assert samples.main(args) == 0
    assert capsys.readouterr().out == first  # same folder and seed: the same table
    assert "(rule hard, step 30): 32 samples, 16 held-out countdown3 prompts" in first

    model, cfg, step = samples.load_policy(kept.path)
    task = get_task(cfg.task.name)
    ids = task.eval_set(16, 0)
    shares, common = samples.outcomes(model, task, ids, 2, cfg.rollout.max_new_tokens, 1.0, generator(0, "samples"))
    assert step == 30 and sum(shares.values()) == pytest.approx(1.0) and sum(c for _, c in common) == 32
    for k, v in shares.items():
        if v or k in ("correct", "malformed", "no_eos"):
            assert f"{k:<13} {v:.3f}" in first
    # the correct share is the verifier's reward on the same samples
    comps = generate(
        model, task.prompts(ids).repeat_interleave(2, 0), cfg.rollout.max_new_tokens, 1.0, generator(0, "samples")
    )
    assert shares["correct"] == pytest.approx(task.rewards(ids.repeat_interleave(2), comps).mean().item())

    assert samples.main([str(nsr_run.path)]) == 2  # a done run without logging.keep_checkpoint
    assert "logging.keep_checkpoint=true" in capsys.readouterr().err
