"""NSR for TRL users: ``NSRGRPOTrainer``, TRL 1.16.0's ``GRPOTrainer`` with any ``nsr`` rule and advantage.

    from nsr.trl import NSRGRPOTrainer
    trainer = NSRGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., num_iterations=2),
                             train_dataset=..., loss=nsr.LossConfig(rule="nsr", delta=0.2))

The repo's ``trl`` backend (``python -m experiments.run sweeps/presets/trl-tiny.yaml``) runs it end to end.
"""

from nsr.trl.trainer import AGG_MODE_OF_LOSS_TYPE, LOSS_TYPES, TRL_VERSION, NSRGRPOTrainer

__all__ = ["AGG_MODE_OF_LOSS_TYPE", "LOSS_TYPES", "TRL_VERSION", "NSRGRPOTrainer"]
