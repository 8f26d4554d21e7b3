"""What runs a model: one ``Backend`` object per backend, the only code that knows what it can do
and how. It says which sources it runs and which settings it honours, makes the files it loads,
decides its part of a load plan (dtype, quantization, threads, tensor parallelism, each with its
reason), loads a model, builds its runner, and adds to a cost key and a run's environment what
its speed depends on. Nothing outside backends/ compares a backend's name (tests/test_layout.py
checks), so a new backend (a server client, MLX, a CUDA-graph runner) is one folder beside torch/,
llama_cpp/ and vllm/, importing none of them, and one line in registry.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cactus_cli.infer.load.sources import LoadedModel, Source
from cactus_cli.infer.runner import Runner


@dataclass(frozen=True, kw_only=True)
class Decided:
    """A backend's part of a load plan: the files, dtype, quantization and threads, each with why."""

    files: tuple[Source, Source]  # (weights, tokenizer) as it loads them
    dtype: torch.dtype
    dtype_reason: str
    quantize: str
    quantize_reason: str
    gate: float | None = None  # a quality gate applied at the first quantization (torch's w8a8)
    fallback: str | None = None  # what the quantization becomes if that gate fails
    threads: int | None = None
    threads_reason: str = ""
    tp_load: dict[str, Any] | None = None  # what every tensor-parallel rank loads


class Backend:
    name: str = ""
    summary: str = ""  # for --help: what it runs, and how
    quantizations: tuple[str, ...] = ()  # the --quantize methods it runs, besides auto and none
    compiles: bool = False  # --compile on can apply
    tensor_parallel: bool = False  # --tp can apply
    transformers: bool = False  # its models are transformers models (transformers' own generate runs them)
    preferred_for: str = ""  # why --backend auto takes it first where it can ("GGUF files on a CPU")
    drives: bool = False  # runs the whole decode loop itself (vLLM): no runner; auto never takes it
    commands: tuple[str, ...] = ()  # where it drives, the commands that hand it their requests

    def unavailable(self) -> str | None:
        """Why it cannot run on this machine (one line), or None."""
        return None

    def runs(self, src: Source) -> bool:
        """Whether it can load this kind of source."""
        raise NotImplementedError

    def refuses(self, request: Any, device: torch.device) -> str | None:
        """The first setting of ``request`` it cannot honour, as the flag reads (``--tp 2``), or None."""
        raise NotImplementedError

    def files(self, src: Source, reporter=None) -> tuple[Source, Source]:
        """(what it loads for ``src``, where the tokenizer is), made once where they must be."""
        raise NotImplementedError

    def decide(self, request: Any, src: Source, files: tuple[Source, Source], device: torch.device, reporter=None):
        """Its part of the plan (a ``Decided``)."""
        raise NotImplementedError

    def load(self, name: str, src: Source, plan: Any, tokenizer: Any, role: str, reporter=None) -> LoadedModel:
        """Load a model as ``plan`` says (``role``: verifier or draft)."""
        raise NotImplementedError

    def runner(
        self, lm: LoadedModel, vocab_size: int, compiled: bool, context_length: int, role: str, sequences: int = 1
    ) -> Runner:
        """The runner of sequence 0 of ``lm`` (``sequences``: how many its cache holds; the others
        are ``Runner.sequence(i)``)."""
        raise NotImplementedError

    def kv_bytes_per_token(self, lm: LoadedModel) -> int:
        """Bytes one cached token of ``lm`` takes (keys and values of every layer): what one more
        sequence costs (serve --parallel)."""
        raise NotImplementedError

    def cost_key(self, threads: int | None) -> dict[str, Any]:
        """What a step's cost depends on besides the models, device, dtype and torch."""
        return {}

    def environment(self, lm: LoadedModel) -> dict[str, Any]:
        """What a benchmark report says about it."""
        return {}

    def dtype_reason(self, plan: Any, lm: LoadedModel) -> str:
        """Why the verifier computes in its dtype, as the plan and the loaded model say it."""
        return plan.dtype_reason

    def chat_context(self, compiled: bool, device: torch.device) -> str:
        """How a chat sizes its caches up front: "whole" (the whole context window: growing a
        compiled cache re-records every graph), "chat" (CHAT_CONTEXT tokens: growing replays the
        conversation) or "request" (as each request needs)."""
        return "request"
