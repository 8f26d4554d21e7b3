"""``LlamaCppRunner``: a GGUF file on llama.cpp's CPU kernels (the model itself: infer/gguf.py).

``forward`` is one ``llama_decode`` of the new tokens (split in batches of ``n_batch`` only for a
long prefill) with logits asked for the last ``keep`` positions, returned as a view of llama.cpp's
own output buffer (no copy: valid until this runner's next call, as the ``Runner`` protocol says);
``crop`` is ``llama_memory_seq_rm``; ``reset`` is ``llama_memory_clear``. The context is made
for the room ``reserve`` asks for and grown (replaying the cached tokens) when a call needs more.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Callable

import torch

from cactus_cli.core.errors import ContextLimitError, ModelError
from cactus_cli.infer.gguf import GGUFModel, bindings, last_log
from cactus_cli.infer.runners.base import prefill
from cactus_cli.infer.sources import LoadedModel

FIRST_CONTEXT = 512  # tokens of KV cache made at least, when no reserve() said more; grown to what a request needs
MAX_BATCH = 512  # tokens per llama_decode call (a longer prefill is split)
MAX_OUTPUTS = 17  # logits rows a call may ask for at least (the default k_max + 1); grown when asked for more


class LlamaCppRunner:
    """A ``Runner`` over one llama.cpp context (one sequence) of a ``GGUFModel``."""

    compiled = False

    def __init__(self, lm: LoadedModel, vocab_size: int, context_length: int):
        self.lm = lm
        self.vocab_size = vocab_size
        self.model: GGUFModel = lm.model
        self.limit = min(context_length, self.model.n_ctx_train)
        self.forward_passes = 0
        self.compile_seconds = 0.0
        self.ctx = None
        self.n_ctx = self.n_outputs = 0
        self._ids: list[int] = []  # what the cache holds (replayed into a larger context)
        # (the context is made at the first reserve() or forward(), the size the request needs: its
        # KV cache and logits rows are the process's memory, and a 4096-token context for a
        # 300-token request was a tenth of the run's peak)

    # ------------------------------------------------------------------ the context

    def _make_context(self, n_ctx: int, n_outputs: int) -> None:
        ll = bindings()
        self.close()
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = max(min(MAX_BATCH, n_ctx), n_outputs)  # (the last batch holds every output)
        params.n_seq_max = 1
        params.n_outputs_max = n_outputs
        params.n_threads = params.n_threads_batch = self.model.threads  # (the bindings' default: half the CPUs)
        params.no_perf = True
        params.swa_full = True  # sliding-window layers keep every position, so a crop can go back anywhere
        ctx = ll.llama_init_from_model(self.model.handle, params)
        if not ctx:
            raise ModelError(
                f"llama.cpp could not make a {n_ctx}-token context for {self.model.path} "
                f"({last_log() or 'out of memory?'})"
            )
        self.ctx, self.n_ctx, self.n_outputs = ctx, int(ll.llama_n_ctx(ctx)), n_outputs
        self.n_batch = int(params.n_batch)
        self.memory = ll.llama_get_memory(ctx)
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)
        cached, self._ids = self._ids, []
        if cached:  # a grown context: the same cache, replayed
            self._decode(cached, 0)

    def close(self) -> None:
        if self.ctx:
            ll = bindings()
            ll.llama_batch_free(self.batch)
            ll.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _room(self, tokens: int, outputs: int) -> None:
        """A context that holds ``tokens`` cached tokens and gives ``outputs`` logits rows."""
        if tokens > self.limit:
            raise ContextLimitError(
                f"{tokens} tokens do not fit the model's context window of {self.limit}; "
                "shorten the prompt or --max-tokens"
            )
        if self.ctx is None:
            self._make_context(min(self.limit, max(tokens, FIRST_CONTEXT)), max(outputs, MAX_OUTPUTS))
        elif tokens > self.n_ctx or outputs > self.n_outputs:
            grown = min(self.limit, max(tokens, 2 * self.n_ctx if tokens > self.n_ctx else self.n_ctx))
            self._make_context(grown, max(outputs, self.n_outputs))

    # ------------------------------------------------------------------ the Runner protocol

    @property
    def cache_len(self) -> int:
        return len(self._ids)

    def reserve(
        self, tokens: int, widths: tuple[int, ...] = (), report: Callable[[str], None] | None = None, exact: bool = True
    ) -> None:
        """Room for ``tokens`` cached tokens and steps of these widths (a larger context if needed)."""
        self._room(min(tokens, self.limit), max(widths, default=1))

    def forward(self, ids: torch.Tensor | list[int], keep: int) -> torch.Tensor:
        """Append ``ids`` [L] to the cache; return the last ``keep`` logits rows [keep, V], a view
        of llama.cpp's buffer valid until this runner's next call."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if not 1 <= keep <= len(ids):
            raise ValueError(f"keep={keep} for {len(ids)} tokens")
        self._room(len(self._ids) + len(ids), keep)
        rows = self._decode(ids, keep)
        self.forward_passes += 1
        return rows[:, : self.vocab_size]

    def _decode(self, ids: list[int], keep: int) -> torch.Tensor | None:
        """Decode ``ids`` after the cache, in batches whose last one holds the ``keep`` outputs."""
        ll = bindings()
        start = len(self._ids)
        ends = list(range(len(ids), 0, -self.n_batch))[::-1]  # the last batch is a full one, so it holds keep
        begin = 0
        for end in ends:
            chunk = ids[begin:end]
            b = self.batch
            for i, token in enumerate(chunk):
                b.token[i] = token
                b.pos[i] = start + begin + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = end == len(ids) and i >= len(chunk) - keep
            b.n_tokens = len(chunk)
            code = ll.llama_decode(self.ctx, b)
            if code != 0:
                self._ids = self._ids[: start + begin]
                ll.llama_memory_seq_rm(self.memory, 0, start + begin, -1)
                raise ModelError(
                    f"llama.cpp could not decode {len(chunk)} tokens at position {start + begin} "
                    f"(llama_decode returned {code}{': ' + last_log() if last_log() else ''})"
                )
            self._ids.extend(chunk)
            begin = end
        if not keep:
            return None
        width = self.model.n_vocab
        buf = (ctypes.c_float * (keep * width)).from_address(ctypes.addressof(ll.llama_get_logits(self.ctx).contents))
        return torch.frombuffer(buf, dtype=torch.float32).view(keep, width)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached tokens."""
        if length >= len(self._ids) or self.ctx is None:
            return
        if not bindings().llama_memory_seq_rm(self.memory, 0, length, -1):
            self.reset()  # (a cache that cannot go back: callers feed again from 0)
            return
        del self._ids[length:]

    def reset(self) -> None:
        if self.ctx is not None:
            bindings().llama_memory_clear(self.memory, True)
        self._ids = []

    def prefill(self, prompt: list[int], previous: list[int], reuse: bool) -> int:
        return prefill(self, prompt, previous, reuse)
