"""The one place that picks a runner implementation for a loaded model: llama.cpp for a GGUF it
loaded, else eager or compiled transformers, or rank 0's shard announcing its calls under --tp.
All are ``Runner``s."""

from __future__ import annotations

from cactus_cli.infer.runners.base import Runner
from cactus_cli.infer.runners.compiled import CompiledLM
from cactus_cli.infer.runners.eager import CachedLM
from cactus_cli.infer.runners.llama_cpp import LlamaCppRunner
from cactus_cli.infer.runners.sharded import ShardedRunner
from cactus_cli.infer.sources import LoadedModel


def make_runner(lm: LoadedModel, vocab_size: int, compiled: bool, context_length: int, role: str) -> Runner:
    if lm.backend == "llama.cpp":  # (compiled is never asked of it: --compile on chooses torch)
        return LlamaCppRunner(lm, vocab_size, context_length)
    if lm.tp > 1:  # a sharded verifier: its calls are announced to the other ranks (eager only)
        return ShardedRunner(CachedLM(lm, vocab_size))
    return CompiledLM(lm, vocab_size, context_length, role) if compiled else CachedLM(lm, vocab_size)
