"""GGUF files on llama.cpp: llama-cpp-python's low-level bindings (imported only when this backend
runs), a loaded model (``GGUFModel``: weights memory-mapped, its vocabulary, llama.cpp's own
tokenizer for the check that both sides agree on token ids) and what this machine's build can
do. The runner over it is runners/llama_cpp.py."""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from cactus_cli.core.errors import ModelError

INSTALL_HINT = 'install it with: pip install -e ".[demo]" (it builds llama.cpp with cmake and a C++ compiler)'


def bindings():
    """llama-cpp-python's low-level module, or a ModelError saying how to get it."""
    try:
        import llama_cpp.llama_cpp as ll
    except (ImportError, OSError) as err:  # not installed, or its shared library failed to load
        raise ModelError(
            f"the llama.cpp backend needs llama-cpp-python ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:160]}); {INSTALL_HINT}"
        ) from None
    _init(ll)
    return ll


def available() -> str | None:
    """None when the llama.cpp backend can run here, else why not (one line)."""
    try:
        bindings()
    except ModelError as err:
        return str(err)
    return None


_log: deque[str] = deque(maxlen=40)  # llama.cpp's last log lines: the reason when a load fails
_ready = threading.Lock()


def last_log() -> str:
    """llama.cpp's last warning or error line ("" if none)."""
    return _log[-1] if _log else ""


_callback = None


def _init(ll) -> None:
    global _callback
    with _ready:
        if _callback is not None:
            return

        @ll.llama_log_callback
        def keep_quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            line = text.decode("utf-8", "replace").strip()
            if line and level in (2, 3):  # warnings and errors, kept for the message if a load fails
                _log.append(line)

        _callback = keep_quiet  # (a reference, or ctypes frees the callback under llama.cpp)
        ll.llama_log_set(_callback, ctypes.c_void_p(0))
        ll.llama_backend_init()


def amx_in_use() -> bool:
    """Whether this llama.cpp build would put weights in its AMX buffers (built with AMX, on a CPU
    that has it). Its AMX matmul crashes on any batch wider than one token (llama.cpp issue 20824,
    open; measured here: llama-bench -p 2 segfaults, -p 0 does not), and a verify is a batch, so
    on such a machine the extra buffer types (AMX, and with it the repacked layouts) stay off."""
    return b"AMX_INT8 = 1" in (bindings().llama_print_system_info() or b"")


def default_threads() -> int:
    """The CPUs this process may use (its affinity mask, as a container or taskset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class GGUFModel:
    """A GGUF file loaded by llama.cpp (weights memory-mapped, shared by every context)."""

    path: str
    handle: Any  # llama_model *
    vocab: Any  # const llama_vocab *
    n_vocab: int
    n_ctx_train: int
    threads: int
    description: str  # e.g. "qwen2 1.5B Q4_K - Medium"
    eos_token_ids: tuple[int, ...]
    plain_buffers: bool  # weights in plain CPU buffers: no AMX or repacked layouts (amx_in_use)

    @classmethod
    def load(cls, path: str, threads: int) -> "GGUFModel":
        ll = bindings()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0  # this backend is the CPU's
        plain = amx_in_use()
        params.use_extra_bufts = not plain
        # Repacked weights are copies: with the file mapped too, both stay resident (1.8x the file
        # in the process's memory, measured); read into buffers instead (1.0x). Plain buffers map it.
        params.load_mode = ll.LLAMA_LOAD_MODE_MMAP if plain else ll.LLAMA_LOAD_MODE_NONE
        _log.clear()
        handle = ll.llama_model_load_from_file(path.encode(), params)
        if not handle:
            why = next(
                (line for line in reversed(_log) if "error" in line.lower() or "failed" in line.lower()),
                _log[-1] if _log else "no reason given",
            )
            raise ModelError(f"llama.cpp could not load {path}: {why}")
        vocab = ll.llama_model_get_vocab(handle)
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(handle, buf, len(buf))
        eos = [t for t in (ll.llama_vocab_eos(vocab), ll.llama_vocab_eot(vocab)) if t >= 0]
        return cls(
            path,
            handle,
            vocab,
            int(ll.llama_vocab_n_tokens(vocab)),
            int(ll.llama_model_n_ctx_train(handle)),
            threads,
            buf.value.decode("utf-8", "replace"),
            tuple(dict.fromkeys(eos)),
            plain,
        )

    def close(self) -> None:
        """Free the weights (a model loaded only to be timed: gguf_layout.measure)."""
        if self.handle:
            bindings().llama_model_free(self.handle)
            self.handle = None

    @property
    def generation_config(self) -> Any:
        """The end-of-generation ids the GGUF names (sources.eos_ids reads them as from transformers)."""
        return _Eos(list(self.eos_token_ids))

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own tokenization of ``text``, special tokens parsed, none added."""
        ll = bindings()
        data = text.encode("utf-8")
        n = len(data) + 8
        out = (ll.llama_token * n)()
        got = ll.llama_tokenize(self.vocab, data, len(data), out, n, False, True)
        if got < 0:
            out = (ll.llama_token * -got)()
            got = ll.llama_tokenize(self.vocab, data, len(data), out, -got, False, True)
        return list(out[:got])


@dataclass
class _Eos:
    eos_token_id: list[int]
