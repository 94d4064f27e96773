"""The CPU testbed backend: a tiny GPT-2 learns Countdown-3 by SFT, then GRPO with any ``nsr`` objective.

    python -m experiments.run sweeps/presets/tiny-smoke.yaml            # CI-sized run, < 1 minute
    python -m experiments.run sweeps/presets/tiny.yaml loss.rule=nsr     # the demo / grid default

Modules: train (the GRPO loop behind ``experiments.run``), batched (many seeds as one batched model), rewards
(label-free rewards), checks (this backend's config checks), samples (decoded samples of a run). What other backends
share lives above this folder: the task (experiments/tasks/countdown.py), the model (experiments/models/tiny.py), the
cached warm start (experiments/sft.py), the evaluation (experiments/evaluation/testbed.py) and the thread setting
(experiments/threads.py, ``NSR_THREADS``).
"""
