"""NSRGRPOTrainer against TRL 1.16.0's own GRPOTrainer on the same inputs and seeds (issue 27): evaluation before
the first step, a mixture-of-experts policy's router loss, the bias-corrected KL, TRL's metric names and values, the
refusals of TRL options the kit replaces, and the log-ratio clamp at |log r| = 50. Tiny local models
(tests/trl_tiny.py), no hub."""

import math

import pytest
import torch

pytest.importorskip("trl", reason="trl is installed by `make venv` (trl==1.16.0)")

import trl_tiny  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import nsr  # noqa: E402
from nsr.trl import NSRGRPOTrainer  # noqa: E402

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    with trl_tiny.one_thread_frozen_gc():
        yield trl_tiny.save_models(tmp_path_factory.mktemp("trl-tiny-models"))


def grpo_args(tmp_path, **kw) -> GRPOConfig:
    base = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
        learning_rate=0.1, per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
        logging_steps=1, max_steps=1, save_strategy="no",
    )  # fmt: skip
    return GRPOConfig(**(base | kw))


def loss_of(args: GRPOConfig, rule: str = "hard") -> nsr.LossConfig:
    """The nsr.LossConfig that agrees with a GRPOConfig's trust region and importance-sampling level."""
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    return nsr.LossConfig(rule=rule, eps_low=args.epsilon, eps_high=eps_high, level=args.importance_sampling_level)


def trainers(models, tmp_path, policy="dense", reward=None, n_test=3, **kw):
    """(TRL's GRPOTrainer, NSRGRPOTrainer) on the same model files, data, reward and GRPOConfig."""
    data = trl_tiny.zen(n_test=n_test)
    out = []
    for cls in (GRPOTrainer, NSRGRPOTrainer):
        args = grpo_args(tmp_path / cls.__name__, **kw)
        extra = {} if cls is GRPOTrainer else {"loss": loss_of(args)}
        out.append(
            cls(
                model=models[policy],
                reward_funcs=reward or models["reward"],
                args=args,
                train_dataset=data["train"],
                eval_dataset=data["test"],
                **extra,
            )  # fmt: skip
        )
    return out


def same_inputs(trainer: NSRGRPOTrainer, metrics=("kl", "entropy", "aux_loss", "policy_loss")):
    """After ``trainer.train()``: on each buffered minibatch (old log-probs from before the updates, so ratios are
    off 1), TRL's _compute_loss and the kit's on the same trainer and inputs: (loss, grads, {metric: value}) pairs."""
    model = trainer.model.train()
    pairs = []
    for inputs in trainer._buffered_inputs:
        got = []
        for compute in (GRPOTrainer._compute_loss, NSRGRPOTrainer._compute_loss):
            trainer._metrics["train"].clear()
            model.zero_grad()
            loss = compute(trainer, model, inputs)
            loss.backward()
            grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
            logged = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
            got.append((loss.detach(), grads, logged))
        pairs.append(got)
    return pairs


def assert_same(pairs, rtol=1e-5, atol=1e-6, keys=()):
    for (ref, ref_g, ref_m), (got, got_g, got_m) in pairs:
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
        for a, b in zip(got_g, ref_g):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        for k in keys:
            assert got_m[k] == pytest.approx(ref_m[k], rel=rtol, abs=atol), k


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_moe_router_loss_is_added_and_logged_as_trl(models, tmp_path, loss_type):
    """A tiny Qwen3-MoE: TRL adds router_aux_loss_coef x the load-balancing loss and logs aux_loss; so does the kit
    (same loss, gradient, aux_loss) after one RL step of two passes, and its log has aux_loss beside nsr/*."""
    _, kit = trainers(models, tmp_path, "moe", loss_type=loss_type, num_iterations=2, max_steps=2)
    assert kit.aux_loss_enabled and kit.router_aux_loss_coef == pytest.approx(0.001)
    kit.train()
    assert "aux_loss" in kit.state.log_history[0] and "nsr/clip_frac" in kit.state.log_history[0]
    pairs = same_inputs(kit)
    assert_same(pairs, keys=("aux_loss", "entropy"))
    assert all(p[1][2]["aux_loss"] > 0 for p in pairs)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_as_trl(models, tmp_path, level):
    """use_bias_correction_kl=True weights TRL's k3 KL by the importance ratio (token or sequence level): the kit's
    loss, gradient and kl metric equal TRL's, and differ from the uncorrected KL (the option is not ignored)."""
    loss_type = "grpo" if level == "sequence" else "dapo"
    kw = dict(beta=0.1, use_bias_correction_kl=True, num_iterations=2, max_steps=2, importance_sampling_level=level)
    _, kit = trainers(models, tmp_path, loss_type=loss_type, **kw)
    kit.train()
    pairs = same_inputs(kit)
    assert_same(pairs, keys=("kl",))
    kit.args.use_bias_correction_kl = False
    plain = same_inputs(kit)
    assert any(abs(float(p[1][0]) - float(q[1][0])) > 1e-6 for p, q in zip(pairs, plain))


def test_trls_metric_names_and_values(models, tmp_path):
    """Every key TRL's GRPOTrainer logs is in the kit's log too (same config and seed: entropy bonus, KL, MoE), next to
    the nsr/* metrics; on the same inputs the values of TRL's loss metrics equal TRL's (rule hard)."""
    kw = dict(entropy_coef=0.1, beta=0.1, num_iterations=2, max_steps=2, loss_type="dapo")
    trl_trainer, kit = trainers(models, tmp_path, "moe", **kw)
    for trainer in (trl_trainer, kit):
        torch.manual_seed(0)
        trainer.train()
    for ref, got in zip(trl_trainer.state.log_history, kit.state.log_history):
        assert set(ref) <= set(got), set(ref) - set(got)
        assert {f"nsr/{k}" for k in nsr.METRIC_KEYS} <= set(got) or "train_runtime" in got
    assert {"policy_loss", "entropy_coef", "aux_loss", "kl", "clip_ratio/low_min", "clip_ratio/high_max"} <= set(
        kit.state.log_history[0]
    )
    pairs = same_inputs(kit)
    keys = ("kl", "entropy", "aux_loss", "policy_loss", "entropy_coef", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")  # fmt: skip
    assert_same(pairs, keys=keys)
    clipped = sum(p[1][2]["clip_ratio/region_mean"] for p in pairs)
    assert clipped > 0  # the trust region fired, so the clip metrics compare something


def test_metric_window_reduction_is_declared_once(models, tmp_path):
    """Over a logging window of several optimizer steps, nsr/ratio_min is the window's min and nsr/ratio_max its max
    (nsr.METRIC_REDUCE), every other metric the mean, as TRL averages its own."""
    _, kit = trainers(models, tmp_path, num_iterations=2, max_steps=2, logging_steps=2, loss_type="dapo")
    seen = []
    original = NSRGRPOTrainer._compute_loss

    def spy(self, model, inputs):
        out = original(self, model, inputs)
        seen.append({k: v[-1] for k, v in self._metrics["train"].items() if k.startswith("nsr/ratio")})
        return out

    NSRGRPOTrainer._compute_loss = spy
    try:
        kit.train()
    finally:
        NSRGRPOTrainer._compute_loss = original
    log = kit.state.log_history[0]
    assert log["nsr/ratio_min"] == pytest.approx(min(s["nsr/ratio_min"] for s in seen))
    assert log["nsr/ratio_max"] == pytest.approx(max(s["nsr/ratio_max"] for s in seen))
    assert log["nsr/ratio_mean"] == pytest.approx(sum(s["nsr/ratio_mean"] for s in seen) / len(seen))
    assert log["nsr/ratio_min"] < 1 < log["nsr/ratio_max"]


def test_eval_on_start_as_trl(models, tmp_path):
    """GRPOConfig(eval_strategy="steps", eval_on_start=True) with loss_type grpo (TRL's regression test): evaluation
    before the first step runs, and its loss and metrics equal TRL's (same seed: same completions and advantages)."""
    kw = dict(loss_type="grpo", eval_strategy="steps", eval_steps=1, eval_on_start=True, per_device_eval_batch_size=3)
    trl_trainer, kit = trainers(models, tmp_path, n_test=1, **kw)
    for trainer in (trl_trainer, kit):
        torch.manual_seed(0)  # the completions are sampled from torch's global RNG
        trainer.train()
    ref = [h for h in trl_trainer.state.log_history if "eval_loss" in h]
    got = [h for h in kit.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in got] == [h["step"] for h in ref] == [0, 1]
    for key in ("eval_loss", "eval_reward", "eval_reward_std", "eval_entropy", "eval_clip_ratio/region_mean"):
        assert got[0][key] == pytest.approx(ref[0][key], rel=1e-5, abs=1e-7), key
    assert "eval_nsr/clip_frac" in got[0]


@pytest.mark.parametrize("scale_rewards", ["none", "batch", False, "group"])
def test_scale_rewards_maps_onto_the_kits_advantages(models, tmp_path, scale_rewards):
    """TRL's scale_rewards is honoured through nsr.compute_advantages (nsr.trl.scaled_advantages): the advantages the
    trainer computes equal TRL's formula (grpo_trainer.py: R - group mean, then / (group std or batch std + eps)) with
    the kit's eps 1e-9 for TRL's 1e-4."""
    from nsr.trl.trainer import scaled_advantages

    args = grpo_args(tmp_path, scale_rewards=scale_rewards)
    kit = NSRGRPOTrainer(model=models["dense"], reward_funcs=models["reward"], args=args, loss=loss_of(args),
                         train_dataset=trl_trainer_data())  # fmt: skip
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.25])
    groups = torch.arange(9) // 3
    adv = nsr.compute_advantages(rewards, groups, kit.nsr_advantages)
    adv = adv / (rewards.std() + 1e-9) if kit.nsr_batch_scale else adv
    grouped = rewards.view(-1, 3)
    want = rewards - grouped.mean(1).repeat_interleave(3)
    if args.scale_rewards == "group":
        want = want / (grouped.std(1).repeat_interleave(3) + 1e-9)
    elif args.scale_rewards == "batch":
        want = want / (rewards.std() + 1e-9)
    assert torch.allclose(adv, want, atol=1e-6) and adv.abs().sum() > 0
    assert scaled_advantages(args.scale_rewards, nsr.AdvantageConfig()) == (kit.nsr_advantages, kit.nsr_batch_scale)


CONTRADICTIONS = [("none", "positive_only", 0.0), ("batch", "random_reward", 0.0), ("batch", "group_norm", 0.1)]


@pytest.mark.parametrize(("scale_rewards", "kind", "noise"), CONTRADICTIONS)
def test_scale_rewards_that_contradicts_the_advantages_is_refused(scale_rewards, kind, noise, tmp_path):
    """Before any model work, naming both options and what is allowed."""
    args = grpo_args(tmp_path, scale_rewards=scale_rewards)
    want = (
        rf"scale_rewards='{scale_rewards}' is not valid with advantages.kind='{kind}'.*allowed: scale_rewards='group'"
    )
    with pytest.raises(ValueError, match=want):
        NSRGRPOTrainer(model=None, reward_funcs=[], args=args, loss=loss_of(args),
                       advantages=nsr.AdvantageConfig(kind=kind, noise=noise))  # fmt: skip


def trl_trainer_data():
    return trl_tiny.zen()["train"]


def tiny_vlm():
    """A Qwen2-VL built in code (a vision tower and a two-layer text model of width 16)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(vocab_size=trl_tiny.VOCAB + 4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=32,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})  # fmt: skip
    vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2, patch_size=2, spatial_merge_size=1,
                  temporal_patch_size=1, in_chans=3)  # fmt: skip
    return Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision))


def test_multimodal_inputs_are_refused(models, tmp_path):
    """The kit's loss does not pass pixel_values and the like to the policy: image data, a processor or a
    vision-language model are refused before training, naming what is allowed."""
    from datasets import Dataset
    from PIL import Image

    args = grpo_args(tmp_path)
    images = Dataset.from_dict({"prompt": ["What is it?"], "image": [Image.new("RGB", (4, 4))]})
    want = r"NSRGRPOTrainer does not support multimodal policies \(a dataset with column\(s\) \['image'\]\)"
    with pytest.raises(ValueError, match=want + r".*allowed: a text-only causal LM"):
        NSRGRPOTrainer(model=models["dense"], reward_funcs=models["reward"], args=args, loss=loss_of(args),
                       train_dataset=images)  # fmt: skip
    with pytest.raises(ValueError, match=r"multimodal policies \(model Qwen2VLForConditionalGeneration has a vision"):
        NSRGRPOTrainer(model=tiny_vlm(), reward_funcs=models["reward"], args=args, loss=loss_of(args),
                       train_dataset=trl_trainer_data(), processing_class=trl_tiny.char_tokenizer())  # fmt: skip


@pytest.mark.parametrize("log_r", [50.0, -50.0])
def test_log_ratio_clamp_at_50(models, tmp_path, log_r):
    """|log r| = 50 on every token, rule hard: TRL does not clamp, the kit clamps log r at nsr.LOG_RATIO_CLAMP (20) as
    OpenRLHF and verl do. The kit's loss is TRL's at |log r| = 20 and its gradient is zero (every token is clipped or
    outside the clamp); TRL's own at log r = +50 is of order e^50 with a gradient of that order (A < 0 tokens)."""
    _, kit = trainers(models, tmp_path, loss_type="dapo", num_iterations=2, max_steps=2)
    kit.train()
    model = kit.model.train()
    inputs = dict(kit._buffered_inputs[0])
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = kit._get_per_token_logps_and_entropies(model, ids, att, inputs["completion_ids"].size(1))
    assert (inputs["advantages"] < 0).any() and (inputs["advantages"] > 0).any()

    def run(compute, shift):
        model.zero_grad()
        loss = compute(kit, model, inputs | {"old_per_token_logps": logps - shift})
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return float(loss), grad

    clamp = math.copysign(nsr.LOG_RATIO_CLAMP, log_r)
    kit_loss, kit_grad = run(NSRGRPOTrainer._compute_loss, log_r)
    trl_loss, trl_grad = run(GRPOTrainer._compute_loss, log_r)
    at_clamp, _ = run(GRPOTrainer._compute_loss, clamp)
    assert kit_loss == pytest.approx(at_clamp, rel=1e-5)
    assert kit_grad.abs().max() == 0
    if log_r > 0:  # A < 0 tokens: TRL's loss ~ e^50 |A| with a gradient of that size
        assert abs(trl_loss) > 1e18 and trl_grad.abs().max() > 1e18 and abs(kit_loss) < 1e10
    else:  # A > 0 tokens: TRL's -e^-50 A, a gradient of order e^-50 (the clipped A < 0 tokens give none)
        assert 0 < trl_grad.abs().max() < 1e-15
