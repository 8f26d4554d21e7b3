"""Tensor parallelism: the process group (group.py); rank 0's sharded runner is infer/runners/sharded.py."""
