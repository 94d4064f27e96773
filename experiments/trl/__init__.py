"""The ``trl`` backend: TRL 1.16.0's real GRPOTrainer loop with any ``nsr`` rule (nsr.trl.NSRGRPOTrainer).

    python -m experiments.run sweeps/presets/trl-tiny.yaml loss.rule=nsr --out /tmp/trl-nsr   # CPU, minutes
    python -m experiments.run sweeps/presets/trl-qwen2.5-math-1.5b.yaml loss.rule=nsr          # one GPU

Modules: model (tiny Qwen2, character tokenizer, Countdown-3 dataset and reward), train (RunConfig -> GRPOConfig,
the run folder written from TRL's log, resume from TRL's checkpoints).
"""
