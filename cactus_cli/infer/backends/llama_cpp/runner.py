"""``LlamaCppRunner``: one sequence of a GGUF model on llama.cpp's CPU kernels (the model itself:
gguf.py beside it). The model's sequences share one llama.cpp context (``Context``: ``n_seq_max``
sequences in one unified KV cache), each runner addressing its own ``seq_id``.

``forward`` is one ``llama_decode`` of the new tokens (split in batches of ``n_batch`` only for a
long prefill) with logits asked for the last ``keep`` positions, returned as a view of llama.cpp's
own output buffer (no copy: valid until the model's next call, as the ``Runner`` protocol says);
``forward_rows`` puts several sequences' tokens in that one ``llama_batch`` (a ``seq_id`` per
token); ``crop`` is ``llama_memory_seq_rm``; ``reset`` forgets the sequence; ``adopt`` is
``llama_memory_seq_cp``. The context is made for the room ``reserve`` asks for and grown
(replaying every sequence's cached tokens) when a call needs more.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from typing import Callable

import torch

from cactus_cli.core.conditions import Watch
from cactus_cli.core.errors import ContextLimitError, ModelError
from cactus_cli.infer.backends.llama_cpp.gguf import GGUFModel, bindings, last_log
from cactus_cli.infer.load.sources import LoadedModel
from cactus_cli.infer.runner import MAX_STEP_WIDTH, Row, prefill

FIRST_CONTEXT = 512  # tokens of KV cache made at least, when no reserve() said more; grown to what a request needs
MAX_BATCH = 512  # tokens per llama_decode call (a longer prefill is split)
PADDED_WIDTHS = (2, 3)  # calls of these many tokens run as 4 where 4 measured cheaper (padding)
MAX_OUTPUTS = 17  # logits rows a call may ask for at least (the default k_max + 1); grown when asked for more


class Context:
    """The llama.cpp context every sequence of one model shares, and what each sequence holds."""

    def __init__(self, model: GGUFModel, limit: int, sequences: int):
        self.model = model
        self.limit = limit  # positions one sequence may reach (the model's window)
        self.sequences = sequences
        self.ctx = None
        self.n_ctx = self.n_outputs = self.n_batch = 0
        self.ids: list[list[int]] = [[] for _ in range(sequences)]  # what each sequence holds (replayed when grown)
        self.need = [0] * sequences  # the room each sequence's request reserved
        self.forward_passes = 0
        self.watch: Watch | None = None  # told the seconds of each call whose every token is an output
        self.pad: dict[int, int] = {}  # a call of n tokens is padded to pad[n] (PADDED_WIDTHS, measured cheaper)

    def make(self, n_ctx: int, n_outputs: int) -> None:
        ll = bindings()
        self.close()
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        # (one call holds every row of a step: its tokens and its outputs)
        params.n_batch = params.n_ubatch = max(min(MAX_BATCH, n_ctx), n_outputs)
        params.n_seq_max = self.sequences + 1  # (the last: padding rows, emptied after each call)
        params.kv_unified = True  # one pool of cells: a long sequence beside short ones, and seq_cp without a copy
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
        cached, self.ids = self.ids, [[] for _ in range(self.sequences)]
        for seq, ids in enumerate(cached):  # a grown context: the same caches, replayed
            if ids:
                self.decode([(seq, ids, 0)])

    def close(self) -> None:
        if self.ctx:
            ll = bindings()
            ll.llama_batch_free(self.batch)
            ll.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def room(self, seq: int, tokens: int, outputs: int, reserving: bool = False) -> None:
        """A context where sequence ``seq`` holds ``tokens`` (the others what they hold or
        reserved) and one call gives ``outputs`` logits rows; ``reserving``: what its next
        request will need (it replaces what the last one reserved)."""
        if tokens > self.limit:
            raise ContextLimitError(
                f"{tokens} tokens do not fit the model's context window of {self.limit}; "
                "shorten the prompt or --max-tokens"
            )
        self.need[seq] = tokens if reserving else max(self.need[seq], tokens)
        total = sum(max(n, len(ids)) for n, ids in zip(self.need, self.ids))
        cells = min(self.limit * self.sequences, max(total, FIRST_CONTEXT))
        if self.ctx is None:
            self.make(cells, max(outputs, MAX_OUTPUTS))
        elif total > self.n_ctx or outputs > self.n_outputs:
            grown = max(cells, 2 * self.n_ctx) if total > self.n_ctx else self.n_ctx
            self.make(min(grown, self.limit * self.sequences), max(outputs, self.n_outputs))

    def decode(self, rows: list[tuple[int, list[int], int]]) -> torch.Tensor | None:
        """Decode each row's ids (sequence, ids, keep) after what its sequence holds, in one call
        when they fit a batch. When they do not, a row's head goes first, alone, in batches that
        end where a single sequence's always did (the last one full), and the final call holds
        every row's last ``keep`` tokens: every output comes from that one call. Returns the
        outputs [sum keep, V] in row order, a view of llama.cpp's buffer."""
        ll = bindings()
        rows = [(seq, ids, keep) for seq, ids, keep in rows if ids]
        if sum(len(ids) for _, ids, _ in rows) > self.n_batch:
            final = []
            for seq, ids, keep in rows:
                tail = min(len(ids), self.n_batch) if len(rows) == 1 else keep
                head = ids[: len(ids) - tail]
                begin = 0
                for end in list(range(len(head), 0, -self.n_batch))[::-1]:
                    self._call([(seq, head[begin:end], 0)])
                    begin = end
                if tail:
                    final.append((seq, ids[len(head) :], keep))
            rows = final
            if sum(len(ids) for _, ids, _ in rows) > self.n_batch:
                raise ModelError(
                    f"internal error: {sum(k for _, _, k in rows)} logits rows do not fit one llama.cpp batch of "
                    f"{self.n_batch}; reserve() the widths first"
                )
        self._call(rows)
        total = sum(keep for _, _, keep in rows)
        if not total:
            return None
        width = self.model.n_vocab
        buf = (ctypes.c_float * (total * width)).from_address(ctypes.addressof(ll.llama_get_logits(self.ctx).contents))
        return torch.frombuffer(buf, dtype=torch.float32).view(total, width)

    def _call(self, rows: list[tuple[int, list[int], int]]) -> None:
        ll = bindings()
        b = self.batch
        i = 0
        for seq, ids, keep in rows:
            start = len(self.ids[seq])
            for j, token in enumerate(ids):
                b.token[i] = token
                b.pos[i] = start + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = j >= len(ids) - keep
                i += 1
        scratch = self.sequences
        for j in range(self.pad.get(i, i) - i):  # (rows of a sequence no slot has; their cells freed below)
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = 0, j, 1, scratch, False
            i += 1
        b.n_tokens = i
        t0 = time.perf_counter()
        code = ll.llama_decode(self.ctx, b)
        if i > sum(len(ids) for _, ids, _ in rows):
            ll.llama_memory_seq_rm(self.memory, scratch, -1, -1)
        if self.watch is not None and code == 0 and all(keep == len(ids) for _, ids, keep in rows):
            self.watch.add(i, time.perf_counter() - t0)  # (a verify: a prefill has tokens without outputs)
        if code != 0:
            for seq, ids, _ in rows:  # (what this call may have written is dropped: the caches stay as they were)
                ll.llama_memory_seq_rm(self.memory, seq, len(self.ids[seq]), -1)
            raise ModelError(
                f"llama.cpp could not decode {i} tokens (llama_decode returned {code}"
                f"{': ' + last_log() if last_log() else ''})"
            )
        for seq, ids, _ in rows:
            self.ids[seq].extend(ids)
        self.forward_passes += 1


def padding(curve: dict[int, float]) -> dict[int, int]:
    """The widths to pad, from a measured verify curve (width -> seconds): a matmul kernel that
    works on blocks of 4 rows (llama.cpp's CPU repack) does the rest of a call one row at a time,
    so on some CPUs 2 or 3 tokens cost more than 4 (the AMX Xeon: 3 tokens 146 ms, 4 tokens 97).
    Such a call gets rows of a sequence no slot uses, dropped after it; the outputs are the same
    rows' (up to the kernels' rounding)."""
    four = curve.get(4)
    return {w: 4 for w in PADDED_WIDTHS if four is not None and w in curve and four < curve[w]}


class LlamaCppRunner:
    """A ``Runner`` over sequence ``seq`` of a ``Context`` of a ``GGUFModel``."""

    compiled = False
    # ggml's CPU flash attention reads 64 queries at a time on its fast path and the rest one by one:
    # at 2,600 cached tokens (AVX-512 EPYC, the embedded verifier) 64 tokens cost 17.4 ms each, 63 cost 24.5
    step_block = 64

    def __init__(self, lm: LoadedModel, vocab_size: int, context_length: int, sequences: int = 1, seq: int = 0):
        self.lm = lm
        self.vocab_size = vocab_size
        self.model: GGUFModel = lm.model
        self.seq = seq
        self.shared = Context(self.model, min(context_length, self.model.n_ctx_train), sequences)
        self._siblings: dict[int, LlamaCppRunner] = {seq: self}
        self.forward_passes = 0
        self.compile_seconds = 0.0
        # (the context is made at the first reserve() or forward(), the size the requests need: its
        # KV cache and logits rows are the process's memory, and a 4096-token context for a
        # 300-token request was a tenth of the run's peak)

    @property
    def limit(self) -> int:
        return self.shared.limit

    @property
    def n_ctx(self) -> int:
        return self.shared.n_ctx

    @property
    def _ids(self) -> list[int]:
        return self.shared.ids[self.seq]

    # ------------------------------------------------------------------ the Runner protocol

    @property
    def cache_len(self) -> int:
        return len(self._ids)

    def reserve(
        self, tokens: int, widths: tuple[int, ...] = (), report: Callable[[str], None] | None = None, exact: bool = True
    ) -> None:
        """Room for ``tokens`` cached tokens and steps of these widths (a larger context if needed:
        every sequence may step at once, within MAX_STEP_WIDTH rows in all)."""
        widest = max(widths, default=1)
        rows = max(widest, min(self.shared.sequences * widest, MAX_STEP_WIDTH))
        self.shared.room(self.seq, min(tokens, self.limit), rows, True)

    def sequence(self, seq: int) -> LlamaCppRunner:
        if not 0 <= seq < self.shared.sequences:
            raise ValueError(f"sequence {seq}: this model holds {self.shared.sequences}")
        if seq not in self._siblings:
            other = LlamaCppRunner.__new__(LlamaCppRunner)
            other.__dict__.update(self.__dict__)
            other.seq, other.forward_passes = seq, 0
            self._siblings[seq] = other
        return self._siblings[seq]

    def forward(self, ids: torch.Tensor | list[int], keep: int) -> torch.Tensor:
        """Append ``ids`` [L] to the cache; return the last ``keep`` logits rows [keep, V], a view
        of llama.cpp's buffer valid until this model's next call."""
        return self.forward_rows([(self, ids, keep)])[0]

    def forward_rows(self, rows: list[Row]) -> list[torch.Tensor]:
        plain = []
        for runner, ids, keep in rows:
            if runner.shared is not self.shared:
                raise ValueError("forward_rows: every row must be a sequence of this model")
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            if not 0 <= keep <= len(ids) or not ids:
                raise ValueError(f"keep={keep} for {len(ids)} tokens")
            plain.append((runner.seq, ids, keep))
        outputs = sum(keep for _, _, keep in plain)
        for seq, ids, _ in plain:
            self.shared.room(seq, len(self.shared.ids[seq]) + len(ids), outputs)
        logits = self.shared.decode(plain)
        out, at = [], 0
        for (runner, _, _), (_, _, keep) in zip(rows, plain):
            runner.forward_passes += 1
            out.append(logits[at : at + keep, : self.vocab_size] if keep else torch.empty(0, self.vocab_size))
            at += keep
        return out

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached tokens."""
        if length >= len(self._ids) or self.shared.ctx is None:
            return
        if not bindings().llama_memory_seq_rm(self.shared.memory, self.seq, length, -1):
            self.reset()  # (a cache that cannot go back: callers feed again from 0)
            return
        del self._ids[length:]

    def reset(self) -> None:
        if self.shared.ctx is not None and self._ids:
            bindings().llama_memory_seq_rm(self.shared.memory, self.seq, 0, -1)
        self._ids.clear()
        self.shared.need[self.seq] = 0

    def prefill(self, prompt: list[int], previous: list[int], reuse: bool) -> int:
        return prefill(self, prompt, previous, reuse)

    def adopt(self, donor: LlamaCppRunner, length: int) -> int:
        """This sequence holds the first ``length`` tokens of ``donor``'s (unified KV cells are
        shared, not copied)."""
        if donor.shared is not self.shared or donor.seq == self.seq or self.shared.ctx is None:
            return 0
        length = min(length, donor.cache_len)
        self.reset()
        ll = bindings()
        ll.llama_memory_seq_cp(self.shared.memory, donor.seq, self.seq, 0, length)
        self._ids.extend(donor._ids[:length])
        return length

    def close(self) -> None:
        self.shared.close()
