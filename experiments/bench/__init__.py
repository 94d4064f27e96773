"""Benchmarks of the harness: batch (the batched testbed's runs per core-hour), gpu (the batched trainer and the loss
on a GPU), loss (one step of loss work per rule, and the testbed's RL step)."""
