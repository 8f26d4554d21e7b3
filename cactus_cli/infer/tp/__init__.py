"""Tensor parallelism: the process group (group.py) and rank 0's sharded runner (sharded.py)."""
