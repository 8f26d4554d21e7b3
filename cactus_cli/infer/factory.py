"""The one place that picks a runner implementation for a model: eager (runners.py), compiled
(compiled.py), or rank 0's shard announcing its calls (tp/sharded.py). All are ``Runner``s."""

from __future__ import annotations

from cactus_cli.infer.compiled import CompiledLM
from cactus_cli.infer.models import LoadedModel
from cactus_cli.infer.runners import CachedLM, Runner
from cactus_cli.infer.tp.sharded import ShardedRunner


def make_runner(lm: LoadedModel, vocab_size: int, compiled: bool, context_length: int, role: str) -> Runner:
    if lm.tp > 1:  # a sharded verifier: its calls are announced to the other ranks (eager only)
        return ShardedRunner(CachedLM(lm, vocab_size))
    return CompiledLM(lm, vocab_size, context_length, role) if compiled else CachedLM(lm, vocab_size)
