# Copyright 2025 Bytedance Ltd. and/or its affiliates
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""verl 0.9.1's own policy-loss tests, adapted to run through this repo's loss modes ``nsr:<rule>`` (nsr.verl).

Adapted from verl 0.9.1's tests/trainer/ppo/test_rollout_corr_integration.py (the tests that call a policy loss):
each runs verl's ``vanilla`` mode as upstream and ``nsr:hard`` (verl's vanilla with its dual clip) through verl's
registry, and the two must agree. Changes: CPU only, seeded inputs, the loss looked up by name
(``core_algos.get_policy_loss_fn``) with the mode's config. tests/test_verl.py already covers vanilla = nsr:hard in
loss, gradient and metrics in every aggregation mode, and rollout-correction weights.

Left out, with the reason (:data:`LEFT_OUT`).
"""

import pytest
import torch

pytest.importorskip("verl", reason="verl is installed by `make venv` (pip install --no-deps verl==0.9.1)")

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402
from verl.workers.config.actor import ActorConfig, PolicyLossConfig  # noqa: E402

import nsr.verl  # noqa: E402

LEFT_OUT = {
    "test_dynamic_policy_losses_on_cpu.py::test_dro_matches_direct_formula_and_requires_positive_beta":
        "verl's dro mode is not an nsr rule; nsr.verl leaves verl's own modes untouched (tests/test_verl_contract.py)",
    "test_rollout_corr_integration.py::TestRolloutISIntegration::test_rollout_is_weights_computation":
        "tests verl's rollout-correction helper, not a policy loss (the plug-in only receives its weights)",
    "test_rollout_corr_integration.py::TestRolloutISIntegration::test_all_aggregation_levels":
        "tests verl's rollout-correction helper's IS / RS levels, not a policy loss",
    "test_rollout_corr_integration.py::TestRolloutISIntegration::test_both_bounding_modes":
        "tests verl's rollout-correction helper's truncate / mask modes, not a policy loss",
    "test_rollout_corr_integration.py::TestRolloutISIntegration::test_offpolicy_metrics":
        "tests verl's off-policy diagnostics, not a policy loss",
    "test_rollout_corr_integration.py::TestRolloutCorrectionConfigNormalization (4 tests)":
        "test verl's RolloutCorrectionConfig parsing, not a policy loss",
    "test_loss_aggregation_on_cpu.py (3 tests)":
        "test verl's agg_loss itself; every nsr mode reduces with that agg_loss, checked against vanilla in all five "
        "aggregation modes by tests/test_verl.py::test_hard_with_dual_clip_equals_verl_vanilla",
}  # fmt: skip
"""verl 0.9.1 CPU tests of tests/trainer/ppo/ that touch policy losses but are not adapted here."""

MODES = ["vanilla", "nsr:hard"]


@pytest.fixture
def sample_data():
    """Sample training data (seeded; upstream draws from the global RNG, on CUDA when present)."""
    g = torch.Generator().manual_seed(0)
    batch_size, seq_length = 4, 16
    return {
        "old_log_prob": torch.randn(batch_size, seq_length, generator=g),
        "log_prob": torch.randn(batch_size, seq_length, generator=g),
        "rollout_log_prob": torch.randn(batch_size, seq_length, generator=g),
        "advantages": torch.randn(batch_size, seq_length, generator=g),
        "response_mask": torch.ones(batch_size, seq_length),
    }


def config(mode: str) -> ActorConfig:
    """Upstream's config (clip_ratio 0.2), with the mode's policy-loss section."""
    policy_loss = PolicyLossConfig() if mode == "vanilla" else nsr.verl.NSRPolicyLossConfig(loss_mode=mode)
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, clip_ratio=0.2, policy_loss=policy_loss)


def policy_loss(mode, **kw):
    return core_algos.get_policy_loss_fn(mode)(loss_agg_mode="token-mean", config=config(mode), **kw)


def is_weights(sample_data):
    weights, _, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=sample_data["old_log_prob"],
        rollout_log_prob=sample_data["rollout_log_prob"],
        response_mask=sample_data["response_mask"],
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs=None,
    )
    return weights.batch["rollout_is_weights"], metrics


def loss_inputs(sample_data):
    return {k: sample_data[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask")}


@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_with_rollout_is(sample_data, mode):
    """Policy loss with rollout-correction weights computed centrally (as the trainer does): a finite scalar, and
    nsr:hard's equals vanilla's."""
    weights, _ = is_weights(sample_data)
    pg_loss, _ = policy_loss(mode, **loss_inputs(sample_data), rollout_is_weights=weights)
    assert isinstance(pg_loss, torch.Tensor)
    assert pg_loss.ndim == 0
    assert not torch.isnan(pg_loss)
    assert not torch.isinf(pg_loss)
    ref, _ = policy_loss("vanilla", **loss_inputs(sample_data), rollout_is_weights=weights)
    torch.testing.assert_close(pg_loss, ref)


@pytest.mark.parametrize("mode", MODES)
def test_metrics_only_mode(sample_data, mode):
    """Metrics-only mode: IS weights and metrics computed, not applied; applying them changes the loss."""
    weights, is_metrics = is_weights(sample_data)
    assert len(is_metrics) > 0
    assert "rollout_corr/rollout_is_mean" in is_metrics
    no_weights, _ = policy_loss(mode, **loss_inputs(sample_data), rollout_is_weights=None)
    with_weights, _ = policy_loss(mode, **loss_inputs(sample_data), rollout_is_weights=weights)
    assert not torch.allclose(no_weights, with_weights)
    torch.testing.assert_close(no_weights, policy_loss("vanilla", **loss_inputs(sample_data))[0])


@pytest.mark.parametrize("mode", MODES)
def test_exact_icepop_matches_filtered_weighted_ppo_loss(mode):
    """IcePop should match the local RL zero-weight semantics."""
    old_log_prob = torch.tensor([[-1.0, -1.0, -1.0]])
    log_prob = old_log_prob.clone()
    rollout_log_prob = torch.tensor([[-0.5, -3.5, -0.8]])
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    response_mask = torch.ones_like(old_log_prob)

    weights_proto, modified_response_mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_log_prob,
        rollout_log_prob=rollout_log_prob,
        response_mask=response_mask,
        rollout_is="token",
        rollout_is_threshold="0.5_5.0",
        rollout_rs=None,
    )
    rollout_is_weights = weights_proto.batch["rollout_is_weights"]
    expected_weights = torch.tensor([[0.60653067, 0.0, 0.81873075]])
    expected_loss = torch.mean(expected_weights * (-advantages))

    pg_loss, _ = policy_loss(
        mode, old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )  # fmt: skip

    assert torch.equal(modified_response_mask, response_mask)
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(1.0 / 3.0, abs=1e-6)
    torch.testing.assert_close(rollout_is_weights, expected_weights, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pg_loss, expected_loss, atol=1e-6, rtol=1e-6)
