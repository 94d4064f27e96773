"""nsr.openrlhf.metrics and experiments.openrlhf.tensorboard: OpenRLHF's logged train/* names -> metrics.jsonl rows.

Event files are written by OpenRLHF 0.11.2's own TensorboardLogger (loaded from the installed package by file
path), so a change in its tag layout fails here.
"""

import math
from types import SimpleNamespace

import pytest
import torch

import nsr
from experiments.openrlhf.tensorboard import ratio_bins_from_tensorboard, rows_from_tensorboard
from nsr.openrlhf.metrics import METRIC_KEYS, REQUIRED, premise_logs, premise_row_from_logs, row_from_logs
from nsr.openrlhf.reference import load_openrlhf_file
from nsr.premise import counts_row


def _tb_logger_cls():
    return load_openrlhf_file("utils/logging_utils.py", "_openrlhf_logging_utils").TensorboardLogger


def _step_logs(step: int) -> dict:
    """A log dict shaped like PPOTrainer.fit's ``status`` (actor metrics + rollout/* + timing/* + sample text)."""
    return {
        "policy_loss": 0.01 * step,
        "entropy_loss": 0.5 + step,
        "actor_lr": 1e-6,
        "actor_grad_norm": 0.3 * step,
        "ppo_clip_ratio": 0.05,
        "ppo_kl": -0.001 * step,
        "reward": 0.4,
        "response_length": 100.0 + step,
        "nsr_clip_frac_low": 0.02,
        "nsr_clip_frac_high": 0.03,
        "nsr_clip_frac": 0.05,
        "nsr_rescue_frac": 0.01 * step,
        "nsr_pushout_frac": 0.0,
        "nsr_ratio_max": 1.7,
        "rollout/reward_mean": 0.25 * step,
        "rollout/response_length_mean": 120.0 + step,
        "rollout/truncated_rate": 0.1,
        "timing/step_total": 30.0 + step,
        "generated_samples": ["some text", 1.0],
    }


def test_row_from_logs_maps_every_required_key():
    row = row_from_logs(2, _step_logs(2))
    assert list(row)[: len(METRIC_KEYS)] == list(METRIC_KEYS)
    assert row["step"] == 2
    assert row["reward_mean"] == 0.5  # rollout/reward_mean wins over the per-micro-batch reward
    assert row["response_len"] == 122.0
    assert row["entropy"] == 2.5
    assert row["grad_norm"] == pytest.approx(0.6)
    assert row["ppo_kl"] == pytest.approx(-0.002)
    assert row["rescue_frac"] == pytest.approx(0.02)
    assert row["clip_frac_low"] == 0.02 and row["clip_frac_high"] == 0.03
    assert row["wall_s"] == 32.0
    assert row["clip_frac"] == 0.05 and row["ratio_max"] == 1.7 and row["truncated_frac"] == 0.1
    assert all(row[k] is not None for k in REQUIRED)


def test_row_from_logs_fallbacks_and_missing_keys():
    logs = {"train/reward": 0.75, "train/response_length": 9, "ppo_clip_ratio": 0.2, "policy_loss": float("nan")}
    row = row_from_logs(1, logs)
    assert row["reward_mean"] == 0.75 and row["response_len"] == 9.0 and row["clip_frac"] == 0.2
    assert row["entropy"] is None and row["clip_frac_low"] is None  # not logged: None, not 0
    assert row["policy_loss"] is None  # a NaN never reaches JSON
    # without --actor.entropy_coef (the cluster presets) the entropy is NSRPolicyLoss's Monte-Carlo estimate
    assert row_from_logs(1, {"nsr_entropy_mc": 1.25})["entropy"] == 1.25
    assert row_from_logs(1, {"nsr_entropy_mc": 1.25, "entropy_loss": 1.5})["entropy"] == 1.5


def test_rows_from_tensorboard_of_openrlhfs_own_logger(tmp_path):
    TensorboardLogger = _tb_logger_cls()
    args = SimpleNamespace(logger=SimpleNamespace(tensorboard_dir=str(tmp_path / "tb"), wandb=SimpleNamespace()))
    args.logger.wandb.run_name = "run-a"
    tb = TensorboardLogger(args)
    for step in (1, 2, 3):
        tb.log_train(step, _step_logs(step))
    tb.log_eval(3, {"eval_aime24_pass1": 0.3})
    tb.close()
    rows = rows_from_tensorboard(tmp_path / "tb")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        want = row_from_logs(r["step"], _step_logs(r["step"]))
        for k, v in want.items():
            assert r[k] == pytest.approx(v, rel=1e-6), k  # TensorBoard stores float32
        assert math.isfinite(r["wall_time"])


def test_rows_from_tensorboard_resumed_run_keeps_latest_values(tmp_path):
    TensorboardLogger = _tb_logger_cls()
    args = SimpleNamespace(logger=SimpleNamespace(tensorboard_dir=str(tmp_path), wandb=SimpleNamespace(run_name="r")))
    first = TensorboardLogger(args)
    for step in (1, 2, 3):
        first.log_train(step, {"policy_loss": 1.0, "timing/step_total": 1.0})
    first.close()
    resumed = TensorboardLogger(args)
    for step in (3, 4):  # resumed from the step-2 checkpoint: step 3 is logged again
        resumed.log_train(step, {"policy_loss": 2.0, "timing/step_total": 1.0})
    resumed.close()
    rows = rows_from_tensorboard(tmp_path)
    assert [(r["step"], r["policy_loss"]) for r in rows] == [(1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0)]


def test_rows_from_tensorboard_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such TensorBoard log folder"):
        rows_from_tensorboard(tmp_path / "nope")


def _counts(step: int) -> torch.Tensor:
    """Premise-meter counts of a step: integer counts and weights that float32 (TensorBoard) keeps exactly."""
    counts = torch.arange(66, dtype=torch.float64).reshape(2, 3, 11) + step
    counts[:, 2] = counts[:, 1] * 0.75
    return counts


def test_premise_counts_travel_through_openrlhfs_log_and_tensorboard(tmp_path):
    """The actor's premise scalars -> OpenRLHF's log dict -> the ratio_bins.jsonl row, directly and through the event
    files OpenRLHF's own TensorboardLogger writes; a step without them (a plain run) gives no row."""
    loss = nsr.LossConfig(rule="nsr", delta=0.3, executor="clean")
    TensorboardLogger = _tb_logger_cls()
    args = SimpleNamespace(logger=SimpleNamespace(tensorboard_dir=str(tmp_path), wandb=SimpleNamespace(run_name="r")))
    tb = TensorboardLogger(args)
    for step in (1, 2):
        logs = {**_step_logs(step), **premise_logs(_counts(step).tolist(), 1000.0 + step)}
        assert premise_row_from_logs(step, logs, loss) == counts_row(_counts(step), step, loss, 1000 + step)
        assert logs["nsr_premise_tokens"] == 1000.0 + step and len([k for k in logs if "premise" in k]) == 67
        tb.log_train(step, logs)
    tb.log_train(3, _step_logs(3))
    tb.close()
    assert premise_row_from_logs(3, _step_logs(3), loss) is None
    assert ratio_bins_from_tensorboard(tmp_path, loss) == [counts_row(_counts(s), s, loss, 1000 + s) for s in (1, 2)]
