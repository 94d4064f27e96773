"""Evaluation shared by the backends: testbed (the CPU testbed's held-out eval) and math (boxed answers of
checkpoints on benchmarks)."""
