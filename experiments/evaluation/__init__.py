"""Evaluation shared by the backends: testbed (the CPU testbed's held-out eval), math (boxed answers of checkpoints
on benchmarks) and spread (a chat model's pass-rate spread on the arithmetic task)."""
