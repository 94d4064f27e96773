"""The trl backend for real on CPU: TRL 1.16.0's GRPOTrainer loop (generation, reward function, num_iterations = 2
so clipping fires, checkpoints) with nsr.trl.NSRGRPOTrainer on the tiny Qwen2 / Countdown-3 testbed.

Time: one warm start (150 SFT steps, ~25 s on a busy 2-core box) shared by the module, then runs of 1-4 RL steps
(~1 s each after TRL's start-up)."""

import os
import signal

import pytest
import torch

pytest.importorskip("trl", reason="trl is installed by `make venv` (trl==1.16.0)")

from conftest import assert_rescue_bins  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import nsr  # noqa: E402
from experiments.config import ConfigError, load_config  # noqa: E402
from experiments.run import run  # noqa: E402
from experiments.rundir import REPO_ROOT, Cancelled, RunDir, read_jsonl  # noqa: E402
from experiments.trl.train import CHECKPOINT_DIR, build_trainer, latest_checkpoint, run_trl  # noqa: E402
from nsr.trl import NSRGRPOTrainer  # noqa: E402

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

PRESET = REPO_ROOT / "sweeps" / "presets" / "trl-tiny.yaml"
SMALL = [
    "train.steps=4", "eval.every=2", "eval.n_prompts=32", "eval.n_samples=2", "sft.steps=150", "sft.warmup=50",
    "logging.checkpoint_every=2",
]  # fmt: skip
METRIC_FIELDS = {
    "step", "reward_mean", "entropy", "response_len", "clip_frac_low", "clip_frac_high", "clip_frac", "rescue_frac",
    "pushout_frac", "ratio_mean", "ratio_min", "ratio_max", "ppo_kl", "policy_loss", "grad_norm", "adv_abs_mean",
    "mixed_group_frac", "wall_s",
}  # fmt: skip


def config(*overrides):
    return load_config(PRESET, [*SMALL, *overrides])


@pytest.fixture(scope="module")
def nsr_run(run_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("nsr") / "run"
    run(config("loss.rule=nsr"), out, progress=False)
    return RunDir(out)


@pytest.fixture(scope="module")
def hard_run(run_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("hard") / "run"
    run(config("loss.rule=hard"), out, progress=False)
    return RunDir(out)


def _rows(rd: RunDir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in read_jsonl(rd.metrics_path)]


def test_run_folder_contract(nsr_run):
    assert nsr_run.state() == "done"
    names = {p.name for p in nsr_run.path.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "eval.jsonl.gz", "ratio_bins.jsonl.gz", "status.json"} <= names
    assert not (nsr_run.path / CHECKPOINT_DIR).exists()  # removed when done (logging.keep_checkpoint false)
    ws = nsr_run.read_config()["meta"]["warm_start"]  # the testbed warm start it trained from: pairs need it
    assert len(ws["sha256"]) == 64 and ws["key"]
    rows = read_jsonl(nsr_run.metrics_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert set(r) == METRIC_FIELDS and all(v is not None for v in r.values()), r
        assert 0 < r["reward_mean"] < 1 and r["ratio_min"] <= r["ratio_mean"] <= r["ratio_max"]
    evals = read_jsonl(nsr_run.eval_path)
    assert {r["step"] for r in evals} == {0, 2, 4}
    assert all(set(r) == {"step", "benchmark", "problem_id", "decoding", "sample", "correct"} for r in evals)
    for step in (0, 2, 4):  # 32 prompts: 1 greedy + 2 sampled each, 0/1 labels
        got = [r for r in evals if r["step"] == step]
        assert len(got) == 32 * 3 and {r["correct"] for r in got} <= {0, 1}
    assert sum(r["correct"] for r in evals) > 0
    assert load_config(nsr_run.config_path).backend == "trl"


def test_nsr_rescues_and_hard_does_not(nsr_run, hard_run):
    nsr_rows, hard_rows = read_jsonl(nsr_run.metrics_path), read_jsonl(hard_run.metrics_path)
    assert all(r["clip_frac"] > 0 for r in nsr_rows + hard_rows)  # num_iterations = 2: clipping fires
    assert all(r["rescue_frac"] > 0 for r in nsr_rows) and all(r["rescue_frac"] == 0 for r in hard_rows)
    assert all(r["rescue_frac"] <= r["clip_frac"] for r in nsr_rows)


def test_ratio_bins_log_what_the_rule_did_with_clipped_tokens(nsr_run, hard_run):
    """ratio_bins.jsonl (NSRGRPOTrainer's premise meter): one row per RL step in the tiny backend's format; hard keeps
    no clipped token, nsr rescues only inside the zone with weights in [1 - delta, 1 + delta] per token, and the
    clipped counts agree with TRL's own clip fractions (both sides clipped somewhere)."""
    from nsr.premise import counts_row

    bins = {name: read_jsonl(rd.log_path("ratio_bins.jsonl")) for name, rd in (("hard", hard_run), ("nsr", nsr_run))}
    fields = set(counts_row(torch.zeros(2, 3, 11), 1, nsr.LossConfig(), 1, 1))  # with the token counts
    for name, rows in bins.items():
        assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(set(r) == fields for r in rows), name
        assert all(0 < r["tokens_adv"] <= r["tokens"] for r in rows), name
        assert all(r["delta"] == 0.2 and r["executor"] == "noisy" for r in rows)
    assert_rescue_bins(bins["hard"], bins["nsr"], delta=0.2)
    for rd, rows in ((hard_run, bins["hard"]), (nsr_run, bins["nsr"])):  # clipped tokens exist iff TRL saw some
        for m, b in zip(read_jsonl(rd.metrics_path), rows):
            assert (m["clip_frac_high"] > 0) == (sum(b["pos_clipped"]) > 0)
            assert (m["clip_frac_low"] > 0) == (sum(b["neg_clipped"]) > 0)


def test_analysis_premise_reads_the_trl_folder(nsr_run, capsys):
    """python -m analysis.premise on a trl run folder: reach and the exact in-zone mass per token from its
    ratio_bins.jsonl, whose rows hold the step's token counts (tests/test_analysis_premise.py reads tiny and R0
    folders and framework logs)."""
    import numpy as np

    from analysis import premise
    from analysis.regime import reach_share

    got = premise.read_run(nsr_run.path)
    assert (got["backend"], got["rule"], got["delta"], got["steps"]) == ("trl", "nsr", 0.2, 4)
    bins, metrics = read_jsonl(nsr_run.log_path("ratio_bins.jsonl")), read_jsonl(nsr_run.metrics_path)
    tokens = sum(r["tokens"] for r in bins)
    assert got["tokens"] == tokens > 0 and got["per_token"] == "exact" and len(metrics) == 4
    for side in ("pos", "neg"):
        hist = np.sum([r[f"{side}_clipped"] for r in bins], axis=0)
        share = reach_share(hist)
        assert got[f"{side}_reach"] == share and 0 < share <= 1
        assert got[f"{side}_zone_per_token"] == pytest.approx(hist[:-1].sum() / tokens, rel=1e-12)
    assert premise.main([str(nsr_run.path)]) == 0
    assert f"{nsr_run.path} (run folder: backend trl, rule nsr, eps 0.2 / 0.28" in capsys.readouterr().out


def test_killed_run_resumes_to_the_same_rows(nsr_run, tmp_path):
    """Killed after RL step 3 (its checkpoint is at step 2): the rerun resumes from TRL's checkpoint, cuts the logs
    back to step 2 and ends with the rows of the uninterrupted run."""
    cfg, rd = config("loss.rule=nsr"), RunDir(tmp_path / "run")
    rd.write_config(cfg)
    rd.set_status("running", run_hash=cfg.run_hash())
    run_trl(cfg, rd, progress=False, stop_after=3)
    assert [r["step"] for r in read_jsonl(rd.metrics_path)] == [1, 2, 3]
    assert latest_checkpoint(rd).name == "checkpoint-8"  # RL step 2 = optimizer step 2 x (2 minibatches x 2 passes)
    run(cfg, rd.path, progress=False)
    assert rd.state() == "done"
    assert _rows(rd) == _rows(nsr_run)
    assert read_jsonl(rd.eval_path) == read_jsonl(nsr_run.eval_path)
    assert read_jsonl(rd.log_path("ratio_bins.jsonl")) == read_jsonl(nsr_run.log_path("ratio_bins.jsonl"))


def test_sigusr1_saves_at_the_step_end_and_the_rerun_resumes(nsr_run, tmp_path):
    """SIGUSR1 during RL step 3 (after its rollout, before its updates): the run finishes step 3, saves a checkpoint
    there although none is due (checkpoint_every=2), records cancelled; the rerun resumes from step 3, not 2, and ends
    with the uninterrupted run's rows. The same signal during the last step lets the run end done."""

    def signal_at(at):
        def hook(step, trainer):
            if step == at:
                os.kill(os.getpid(), signal.SIGUSR1)

        return hook

    cfg, out = config("loss.rule=nsr"), tmp_path / "run"
    with pytest.raises(Cancelled, match="after RL step 3 of 4"):
        run(cfg, out, progress=False, before_step=signal_at(3))
    rd = RunDir(out)
    assert rd.state() == "cancelled" and "SIGUSR1" in rd.status()["error"]
    assert [r["step"] for r in read_jsonl(rd.metrics_path)] == [1, 2, 3]
    assert latest_checkpoint(rd).name == "checkpoint-12"  # RL step 3 x 4 optimizer steps; step 2's was rotated out
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handler lives only while the run trains
    run(cfg, out, progress=False, before_step=signal_at(4))
    assert rd.state() == "done"
    assert _rows(rd) == _rows(nsr_run)
    assert read_jsonl(rd.eval_path) == read_jsonl(nsr_run.eval_path)
    assert read_jsonl(rd.log_path("ratio_bins.jsonl")) == read_jsonl(nsr_run.log_path("ratio_bins.jsonl"))


def test_sigusr1_while_the_attempt_starts_is_kept_for_its_first_step_end(nsr_run, tmp_path, monkeypatch):
    """slurm.stop signals a folder's holder: the signal can come after the attempt locks the folder and before it
    writes its status. The handler is installed before the lock, so the request is kept: the run stops at the end of
    RL step 1 with a checkpoint, and the rerun ends with the uninterrupted run's rows."""
    import experiments.run as run_module

    real = run_module.check_folder

    def check_then_signal(rd, cfg, force):
        assert rd.locked() and rd.holder_pid() == os.getpid()  # the folder is held: slurm.stop may signal now
        os.kill(os.getpid(), signal.SIGUSR1)
        real(rd, cfg, force)

    cfg, out = config("loss.rule=nsr"), tmp_path / "run"
    monkeypatch.setattr(run_module, "check_folder", check_then_signal)
    with pytest.raises(Cancelled, match="after RL step 1 of 4"):
        run(cfg, out, progress=False)
    monkeypatch.setattr(run_module, "check_folder", real)
    rd = RunDir(out)
    assert rd.state() == "cancelled" and [r["step"] for r in read_jsonl(rd.metrics_path)] == [1]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    run(cfg, out, progress=False)
    assert rd.state() == "done" and _rows(rd) == _rows(nsr_run)


@pytest.mark.parametrize("agg, loss_type", [("token-mean", "dapo"), ("seq-mean-token-mean", "grpo")])
def test_hard_equals_trls_own_loss(run_env, tmp_path, agg, loss_type):
    """After one RL step, on each buffered minibatch (old log-probs from before the updates, so ratios are off 1):
    rule hard through NSRGRPOTrainer gives TRL's own loss (loss_type dapo / grpo, epsilon / epsilon_high) and
    gradient."""
    cfg = config("loss.rule=hard", "train.steps=1", f"train.agg_mode={agg}", "eval.n_prompts=0")
    trainer, _ = build_trainer(cfg, RunDir(tmp_path))
    assert trainer.args.loss_type == loss_type
    trainer.train()
    model = trainer.model.train()
    clipped = 0.0
    for inputs in trainer._buffered_inputs:
        grads = []
        for compute in (GRPOTrainer._compute_loss, NSRGRPOTrainer._compute_loss):
            model.zero_grad()
            loss = compute(trainer, model, inputs)
            loss.backward()
            grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        clipped += trainer._metrics["train"]["nsr/clip_frac"][-1]
        (ref, ref_g), (got, got_g) = grads
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
        for a, b in zip(got_g, ref_g):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert clipped > 0


def test_advantages_are_nsrs(run_env, tmp_path):
    """positive_only replaces TRL's advantage: zero for below-mean responses, (R - mean) / (std + 1e-9) above."""
    cfg = config("loss.rule=nsr", "train.steps=1", "advantages.kind=positive_only", "eval.n_prompts=0")
    trainer, _ = build_trainer(cfg, RunDir(tmp_path))
    trainer.train()
    adv = torch.cat([b["advantages"] for b in trainer._buffered_inputs])
    rewards = trainer._rewards_per_func[:, 0]
    groups = torch.arange(len(rewards)) // cfg.rollout.samples_per_prompt
    want = nsr.compute_advantages(rewards, groups, cfg.advantages)
    assert (adv >= 0).all() and (adv > 0).any()
    torch.testing.assert_close(adv.sort().values, want.sort().values)  # TRL shuffles the batch before splitting


def test_bad_settings_fail_before_work(run_env, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.name='tiny-gpt2' is not valid; allowed: tiny-qwen2"):
        config("model.name=tiny-gpt2")
    with pytest.raises(ConfigError, match=r"trl\.micro_batch_size=7 is not valid"):
        config("trl.micro_batch_size=7")
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens=4 is not valid"):
        config("rollout.max_new_tokens=4")
    args = GRPOConfig(output_dir=str(tmp_path), loss_type="bnpo", use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"GRPOConfig\.loss_type='bnpo' is not valid with NSRGRPOTrainer"):
        NSRGRPOTrainer(model=None, reward_funcs=[], args=args, loss=nsr.LossConfig())
    args = GRPOConfig(output_dir=str(tmp_path), epsilon=0.1, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"loss\.eps_low=0\.2 and GRPOConfig\.epsilon=0\.1 set the trust region twice"):
        NSRGRPOTrainer(model=None, reward_funcs=[], args=args, loss=nsr.LossConfig(eps_low=0.2))


def test_no_stale_update_is_refused_naming_both_fields(tmp_path):
    """TRL's default schedule (num_iterations 1, steps_per_generation = gradient_accumulation_steps): every ratio is 1,
    so a rule that needs stale ratios is refused before any model work (model=None), naming both fields; hard and
    clip_cov are not, nor a schedule with a stale update, nor allow_on_policy=True."""
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", gradient_accumulation_steps=2)
    for rule in ("nsr", "soft", "cispo", "kl_cov"):
        with pytest.raises(ValueError, match=r"GRPOConfig\.num_iterations=1 with GRPOConfig\.steps_per_generation=2"):
            NSRGRPOTrainer(model=None, reward_funcs=[], args=args, loss=nsr.LossConfig(rule=rule))
    nsr_loss = nsr.LossConfig(rule="nsr")
    for ok, allow in [(dict(), True), (dict(num_iterations=2), False), (dict(steps_per_generation=4), False)]:
        ok_args = GRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, report_to="none", gradient_accumulation_steps=2, **ok
        )
        with pytest.raises(AttributeError):  # past every check of the arguments: TRL then reads the model (None)
            NSRGRPOTrainer(model=None, reward_funcs=[], args=ok_args, loss=nsr_loss, allow_on_policy=allow)
    for rule in ("hard", "clip_cov"):
        with pytest.raises(AttributeError):
            NSRGRPOTrainer(model=None, reward_funcs=[], args=args, loss=nsr.LossConfig(rule=rule))


def test_trl_default_clip_range_is_the_trust_region(tmp_path):
    """GRPOConfig's defaults but num_iterations (epsilon 0.2, epsilon_high None = 0.2) and LossConfig(rule="nsr"): the
    trainer trains with TRL's range, set once; the premise meter uses it too; an epsilon TRL accepts that no rule
    can use is refused under TRL's name."""
    import trl_tiny

    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", num_iterations=2, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=6, max_steps=2, logging_steps=1, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = NSRGRPOTrainer(
        model=trl_tiny.dense_lm(), reward_funcs=lambda completions, **kw: [float(len(c) % 2) for c in completions],
        args=args, train_dataset=trl_tiny.zen()["train"], processing_class=trl_tiny.char_tokenizer(),
        loss=nsr.LossConfig(rule="nsr"),
    )  # fmt: skip
    assert (trainer.nsr_loss.eps_low, trainer.nsr_loss.eps_high, trainer.nsr_loss.delta) == (0.2, 0.2, 0.2)
    assert trainer.premise.cfg == trainer.nsr_loss
    trainer.train()
    logged = [h for h in trainer.state.log_history if "nsr/clip_frac" in h]
    assert len(logged) == 2 and all(h["premise/pos_clipped_zone"] >= 0 for h in logged)
    with pytest.raises(ValueError, match=r"GRPOConfig\.epsilon=1\.0 is not valid"):
        NSRGRPOTrainer(model=None, reward_funcs=[], args=GRPOConfig(output_dir=str(tmp_path), epsilon=1.0,
                       num_iterations=2, use_cpu=True, report_to="none"), loss=nsr.LossConfig(rule="nsr"))  # fmt: skip


def test_math_path_with_a_local_hf_model(run_env, tmp_path):
    """The 1-GPU preset's path on CPU: a HF model from a local folder (the tiny Qwen2 saved by save_pretrained),
    prompt and benchmark JSONL files as experiments.openrlhf.data writes them, the math-verify reward, and
    eval.jsonl rows per benchmark problem and sample."""
    import json

    from experiments.config import ModelConfig
    from experiments.models.qwen2 import char_tokenizer, tiny_qwen2

    model = tiny_qwen2(ModelConfig(name="tiny-qwen2"), torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path / "model")
    char_tokenizer().save_pretrained(tmp_path / "model")
    rows = [{"prompt": f"{i}+{i}=", "label": str(2 * i), "problem_id": str(i)} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    overrides = [
        f"model.name={tmp_path / 'model'}",
        f"task.train_data={tmp_path / 'train.jsonl'}",
        "task.eval_benchmarks=[tiny]", "task.chat_template=false", "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=6", "train.steps=2", "eval.every=0", "eval.n_prompts=4", "eval.n_samples=2",
        "trl.use_vllm=false", "loss.rule=nsr",
    ]  # fmt: skip
    cfg = load_config(REPO_ROOT / "sweeps" / "presets" / "trl-qwen2.5-math-1.5b.yaml", overrides)
    run(cfg, tmp_path / "run", progress=False)
    rd = RunDir(tmp_path / "run")
    assert rd.state() == "done" and [r["step"] for r in read_jsonl(rd.metrics_path)] == [1, 2]
    evals = read_jsonl(rd.eval_path)
    assert len(evals) == 2 * 4 * (1 + 2)  # steps 0 and 2; 4 problems; greedy + 2 samples
    assert {(r["benchmark"], r["decoding"]) for r in evals} == {("tiny", "greedy"), ("tiny", "sampled")}
    assert {r["problem_id"] for r in evals} == {"0", "1", "2", "3"} and {r["correct"] for r in evals} <= {0, 1}


def test_sweeps_run_on_the_trl_preset():
    """--preset trl-tiny turns a sweep's grid into trl runs, as --preset tiny does for the testbed."""
    from experiments.sweep import expand

    runs = expand(REPO_ROOT / "sweeps" / "delta.yaml", preset="trl-tiny")
    assert len(runs) > 5 and {r.config.backend for r in runs} == {"trl"}
    assert {r.config.model.name for r in runs} == {"tiny-qwen2"} and len({r.config.loss for r in runs}) > 5
