"""``CachedLM``: one sequence of a transformers causal LM called eagerly, with its own dynamic KV
cache (grows and shrinks as needed). Several sequences of one model decode in one forward
(``forward_rows``): their caches padded to one batch, a mask per row hiding the padding, each row's
cache cut back out of the result."""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from cactus_cli.infer.load.sources import LoadedModel
from cactus_cli.infer.runner import Row, one_by_one, prefill, to_device


def cache_argument(model) -> str:
    """transformers 5 renamed past_key_values to cache (argument and output alike)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class CachedLM:
    """A causal LM and its dynamic KV cache, called eagerly. The one place a model is called
    (with ``CompiledLM``), so forward passes are counted here."""

    compiled = False
    step_block = 1

    def __init__(self, lm: LoadedModel, vocab_size: int, sequences: int = 1):
        self.lm = lm
        self.vocab_size = vocab_size
        self.cache = None
        self._window = self._floor = 0  # sliding-window layers: see _watch_window
        self.forward_passes = 0
        self.compile_seconds = 0.0
        self._cache_arg = cache_argument(lm.model)
        self.sequences = sequences
        self._siblings: dict[int, CachedLM] = {0: self}

    def sequence(self, seq: int) -> CachedLM:
        if not 0 <= seq < self.sequences:
            raise ValueError(f"sequence {seq}: this model holds {self.sequences}")
        if seq not in self._siblings:
            other = CachedLM(self.lm, self.vocab_size, self.sequences)
            other._siblings = self._siblings
            self._siblings[seq] = other
        return self._siblings[seq]

    def adopt(self, donor: CachedLM, length: int) -> int:
        """A copy of the first ``length`` tokens ``donor`` caches (not where a sliding window
        may have dropped some)."""
        length = min(length, donor.cache_len)
        if donor is self or donor.cache is None or donor._window or not length:
            return 0
        layers = [
            (layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone()) for layer in donor.cache.layers
        ]
        self.reset()
        from transformers import DynamicCache

        self.cache = DynamicCache(ddp_cache_data=layers)
        return self.cache_len

    def forward_rows(self, rows: list[Row]) -> list[torch.Tensor]:
        """One forward over every row (sequences of this model); a model with sliding-window
        layers (whose caches are not plain) decodes row by row."""
        if len(rows) == 1:
            runner, ids, keep = rows[0]
            logits = runner.forward(ids, max(keep, 1))
            return [logits if keep else logits[:0]]
        if _sliding(self.lm.model.config) or any(
            r.cache is not None and any(type(layer).__name__ != "DynamicLayer" for layer in r.cache.layers)
            for r, _, _ in rows
        ):
            return one_by_one(rows)
        return self._padded(rows)

    @torch.inference_mode()
    def _padded(self, rows: list[Row]) -> list[torch.Tensor]:
        """Rows of different cache lengths L_b and widths w_b as one batch: caches right-padded to
        max L, new tokens to max W, and an additive mask [B, 1, W, L + W] that lets row b's query
        i see its own L_b cached tokens and its own new tokens up to i."""
        from transformers import DynamicCache

        dev, dtype = self.lm.device, self.lm.dtype
        ids = [to_device(x, dev).view(-1) for _, x, _ in rows]
        lens = [r.cache_len for r, _, _ in rows]
        widths = [len(x) for x in ids]
        B, L, W = len(rows), max(lens), max(widths)
        batch_ids = torch.zeros(B, W, dtype=torch.int64, device=dev)  # [B, W]
        for b, x in enumerate(ids):
            batch_ids[b, : len(x)] = x
        length = to_device(lens, dev)  # [B] (copied without a sync)
        pos = length.view(B, 1) + torch.arange(W, device=dev).view(1, W)  # [B, W]
        past = torch.arange(L, device=dev).view(1, 1, L) < length.view(B, 1, 1)  # [B, 1, L]
        causal = torch.arange(W, device=dev).view(1, 1, W) <= torch.arange(W, device=dev).view(1, W, 1)  # [1, W, W]
        allowed = torch.cat([past.expand(B, W, L), causal.expand(B, W, W)], -1)  # [B, W, L + W]
        mask = torch.zeros(B, 1, W, L + W, dtype=dtype, device=dev)
        mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)
        cache = DynamicCache()
        if L:
            like = next(r.cache for r, _, _ in rows if r.cache is not None)
            layers = []
            for i, layer in enumerate(like.layers):
                kv = []
                for name in ("keys", "values"):
                    ref = getattr(layer, name)  # [1, H, L_b, D]
                    padded = ref.new_zeros(B, ref.shape[1], L, ref.shape[3])  # [B, H, L, D]
                    for b, (r, _, _) in enumerate(rows):
                        if r.cache is not None and lens[b]:
                            padded[b, :, : lens[b]] = getattr(r.cache.layers[i], name)[0]
                    kv.append(padded)
                layers.append(tuple(kv))
            cache = DynamicCache(ddp_cache_data=layers)
        out = self._body(batch_ids, W, cache, position_ids=pos, attention_mask=mask)
        grown = out[self._cache_arg]
        result = []
        for b, (r, _, keep) in enumerate(rows):
            kept = [
                tuple(
                    torch.cat([t[b : b + 1, :, : lens[b]], t[b : b + 1, :, L : L + widths[b]]], 2)
                    for t in (layer.keys, layer.values)
                )
                for layer in grown.layers
            ]
            r.cache = DynamicCache(ddp_cache_data=kept)
            r.forward_passes += 1
            result.append(out.logits[b, widths[b] - keep : widths[b], : self.vocab_size])
        return result

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

    def _body(self, ids: torch.Tensor, keep: int, cache, **inputs):
        """One call of the model with ``cache`` (under the name this transformers takes), keeping
        the last ``keep`` positions' logits; ``inputs``: positions and mask where the caller makes them."""
        return self.lm.model(input_ids=ids, use_cache=True, logits_to_keep=keep, **inputs, **{self._cache_arg: cache})

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor | list[int], keep: int) -> torch.Tensor:
        """Append ``ids`` [L] to the cache; return the last ``keep`` logits rows [keep, V]."""
        ids = to_device(ids, self.lm.device).view(1, -1)
        out = self._body(ids, keep, self.cache)
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

    def close(self) -> None:
        self.cache = None

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


def _sliding(config) -> bool:
    """Whether the model has sliding-window attention layers (their masks are its own)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any("sliding" in str(t) for t in (getattr(cfg, "layer_types", None) or ()))
