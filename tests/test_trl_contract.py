"""Contract with TRL: fails loudly when the TRL release, or the GRPOTrainer internals NSRGRPOTrainer overrides or
reproduces (loss aggregation, advantage formula, method signatures, GRPOConfig fields), change."""

import inspect

import pytest

pytest.importorskip("trl", reason="trl is installed by `make venv` (trl==1.16.0)")

import trl  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from experiments.config import load_config  # noqa: E402
from experiments.rundir import REPO_ROOT  # noqa: E402
from experiments.trl.train import grpo_config  # noqa: E402
from nsr.trl import TRL_VERSION, NSRGRPOTrainer  # noqa: E402


def test_pinned_release():
    assert trl.__version__ == TRL_VERSION


@pytest.mark.parametrize(
    "name, params",
    [
        ("_compute_loss", ["self", "model", "inputs"]),
        ("_calculate_rewards", ["self", "inputs", "prompts", "completions", "completion_ids_list"]),
        ("_generate_and_score_completions", ["self", "inputs"]),
    ],
)
def test_overridden_methods_keep_their_signature(name, params):
    assert list(inspect.signature(getattr(GRPOTrainer, name)).parameters) == params
    assert getattr(NSRGRPOTrainer, name) is not getattr(GRPOTrainer, name)
    logps = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    assert list(logps)[1:5] == ["model", "input_ids", "attention_mask", "logits_to_keep"] and "compute_entropy" in logps


def test_reproduced_formulas_are_trls():
    """NSRGRPOTrainer._aggregate copies these lines of TRL's _compute_loss; its advantage replaces TRL's."""
    loss_src = inspect.getsource(GRPOTrainer._compute_loss)
    for line in (
        'elif self.loss_type in ["cispo", "dapo", "vespo"]:',
        'normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes',
        "normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation",
        "loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()",
        "per_token_loss = -torch.min(per_token_loss1, per_token_loss2)",
        "torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1",
    ):
        assert line in loss_src, line
    gen_src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "advantages = advantages / (std_rewards + 1e-4)" in gen_src
    for key in (
        '"advantages": advantages',
        '"num_items_in_batch": num_items_in_batch',
        'output["old_per_token_logps"]',
    ):
        assert key in gen_src, key


@pytest.mark.parametrize("preset", ["trl-tiny", "trl-qwen2.5-math-1.5b"])
def test_presets_make_a_valid_grpo_config(preset, tmp_path):
    """Every GRPOConfig field the runner sets exists and passes TRL's own checks; one RL step's arithmetic holds."""
    cfg = load_config(REPO_ROOT / "sweeps" / "presets" / f"{preset}.yaml")
    args = grpo_config(cfg, tmp_path)
    samples = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    assert args.generation_batch_size == samples and args.num_generations == cfg.rollout.samples_per_prompt
    assert args.steps_per_generation // args.gradient_accumulation_steps == cfg.train.minibatches
    assert args.max_steps == cfg.train.steps * cfg.train.minibatches * cfg.train.epochs
    assert (args.epsilon, args.epsilon_high, args.loss_type) == (cfg.loss.eps_low, cfg.loss.eps_high, "dapo")
