"""``CachedLM``: a transformers causal LM called eagerly, with its dynamic KV cache (grows and
shrinks as needed)."""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from cactus_cli.infer.runners.base import prefill, to_device
from cactus_cli.infer.sources import LoadedModel


def cache_argument(model) -> str:
    """transformers 5 renamed past_key_values to cache (argument and output alike)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class CachedLM:
    """A causal LM and its dynamic KV cache, called eagerly. The one place a model is called
    (with ``CompiledLM``), so forward passes are counted here."""

    compiled = False

    def __init__(self, lm: LoadedModel, vocab_size: int):
        self.lm = lm
        self.vocab_size = vocab_size
        self.cache = None
        self._window = self._floor = 0  # sliding-window layers: see _watch_window
        self.forward_passes = 0
        self.compile_seconds = 0.0
        self._cache_arg = cache_argument(lm.model)

    def reset(self) -> None:
        self.cache = None
        self._window = self._floor = 0

    @property
    def cache_len(self) -> int:
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def reserve(
        self, tokens: int, widths: tuple[int, ...] = (), report: Callable[[str], None] | None = None, exact: bool = True
    ) -> None:
        """Room for ``tokens`` cached tokens and steps of these widths: nothing to do for a dynamic cache."""

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor | list[int], keep: int) -> torch.Tensor:
        """Append ``ids`` [L] to the cache; return the last ``keep`` logits rows [keep, V]."""
        ids = to_device(ids, self.lm.device).view(1, -1)
        out = self.lm.model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{self._cache_arg: self.cache})
        fresh, self.cache = self.cache is None, out[self._cache_arg]
        if fresh:
            self._watch_window()
        self.forward_passes += 1
        return out.logits[0, -keep:, : self.vocab_size]  # padded embedding rows are never tokens

    def prefill(self, prompt: list[int], previous: list[int], reuse: bool) -> int:
        return prefill(self, prompt, previous, reuse)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens; with sliding-window layers, forget all (``cache_len``
        0: callers feed again from there) when what the window dropped would be needed back."""
        before = self.cache_len
        if before <= length:
            return
        if self._window and length < self._floor:
            self.reset()
            return
        self.cache.crop(length - before)  # negative: remove from the end (transformers 4.x and 5.x alike)
        if self._window and before >= self._window:
            self._floor = length  # the window was cut back to its last W - 1 tokens before ``length``

    def _watch_window(self) -> None:
        """Sliding-window layers (Gemma 2/3, Mistral-style configs) keep only their last W - 1
        tokens, and transformers refuses to crop them once full. Recording the past keeps what
        is appended until the next crop, which cuts the window back: below that point (the
        floor) nothing can be restored, so a crop there forgets the cache instead."""
        windows = [
            int(layer.sliding_window)
            for layer in getattr(self.cache, "layers", ())
            if getattr(layer, "is_sliding", False) and getattr(layer, "sliding_window", None)
        ]
        if not windows or not hasattr(self.cache, "activate_past_recording"):
            return
        self._window = min(windows)
        self.cache.activate_past_recording()
        first = self.cache_len
        self._floor = first if first >= self._window - 1 else 0  # (that first forward was not recorded)
