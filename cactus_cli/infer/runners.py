"""Model runners: a causal LM and its KV cache behind one interface, ``Runner``: ``forward`` new
tokens and read logits, ``crop`` back after a rejection, ``prefill`` a prompt, ``reserve`` room
for a request. The engine and the drafters only ever call these.

Implementations (factory.py picks one):
- ``CachedLM`` (here): eager calls with transformers' dynamic cache (grows and shrinks as needed).
- ``CompiledLM`` (compiled.py): a static cache and fixed-shape compiled steps (CUDA graphs on CUDA).
- ``ShardedRunner`` (tp/sharded.py): wraps a runner of one tensor-parallel shard and announces
  every call to the other ranks first.
"""

from __future__ import annotations

import inspect
from typing import Callable, Protocol

import torch

from cactus_cli.infer.models import LoadedModel


class Runner(Protocol):
    """Everything the engine and the drafters use of a model runner."""

    lm: LoadedModel  # the model, its device and dtype
    vocab_size: int  # logits are cut to this many columns
    compiled: bool
    forward_passes: int  # model calls so far (prefills included)
    compile_seconds: float  # spent compiling (0 for an eager runner); excluded from tokens/s

    @property
    def cache_len(self) -> int:
        """Tokens in the KV cache."""

    def forward(self, ids: torch.Tensor | list[int], keep: int) -> torch.Tensor:
        """Append ``ids`` [L] to the cache; return the last ``keep`` logits rows [keep, V]."""

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached tokens."""

    def reset(self) -> None:
        """Forget the cache."""

    def prefill(self, prompt: list[int], previous: list[int], reuse: bool) -> int:
        """Make the cache hold ``prompt[:-1]``, keeping a prefix shared with ``previous`` when
        ``reuse``; return the number of tokens kept."""

    def reserve(self, tokens: int, widths: tuple[int, ...] = (), report: Callable[[str], None] | None = None,
                exact: bool = True) -> None:
        """Room for ``tokens`` cached tokens and steps of these widths (compiling them, if compiled)."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def to_device(ids: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    """Token ids as an int64 tensor on ``device``. A host list is copied without blocking: a
    blocking host-to-device copy waits for every kernel queued before it, a sync per call."""
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.int64)
    host = torch.tensor(ids, dtype=torch.int64)
    return host.to(device, non_blocking=True) if device.type == "cuda" else host


def sync(device: torch.device) -> None:
    """Wait for the device, so a timer reads finished work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(runner: Runner, prompt: list[int], previous: list[int], reuse: bool) -> int:
    """``Runner.prefill`` in terms of the runner's own forward / crop / reset (so a wrapper that
    announces those calls announces a prefill too). With ``reuse``, the longest prefix ``prompt``
    shares with ``previous`` (the sequence the cache was built from) is kept."""
    keep = min(common_prefix(previous[: runner.cache_len], prompt), len(prompt) - 1) if reuse else 0
    if keep:
        runner.crop(keep)
        keep = runner.cache_len  # (0 when a sliding window could not go back that far)
    else:
        runner.reset()
    if len(prompt) - 1 > keep:
        runner.forward(prompt[keep:-1], keep=1)
    return keep


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

    def reserve(self, tokens: int, widths: tuple[int, ...] = (), report: Callable[[str], None] | None = None,
                exact: bool = True) -> None:
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
        windows = [int(layer.sliding_window) for layer in getattr(self.cache, "layers", ())
                   if getattr(layer, "is_sliding", False) and getattr(layer, "sliding_window", None)]
        if not windows or not hasattr(self.cache, "activate_past_recording"):
            return
        self._window = min(windows)
        self.cache.activate_past_recording()
        first = self.cache_len
        self._floor = first if first >= self._window - 1 else 0  # (that first forward was not recorded)
