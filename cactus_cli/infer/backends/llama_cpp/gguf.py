"""GGUF files on llama.cpp: llama-cpp-python's low-level bindings (imported only when this backend
runs), a loaded model (``GGUFModel``: weights memory-mapped, its vocabulary, llama.cpp's own
tokenizer for the check that both sides agree on token ids) and what this machine's build can
do. The runner over it is backends/llama_cpp/runner.py."""

from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cactus_cli.core.errors import ModelError
from cactus_cli.infer.load.devices import cpu_flags

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
            # information, warnings and errors: a failed load's reason, the buffer sizes
            if line and level in (2, 3, 4):
                _log.append(line)

        _callback = keep_quiet  # (a reference, or ctypes frees the callback under llama.cpp)
        ll.llama_log_set(_callback, ctypes.c_void_p(0))
        ll.llama_backend_init()


def amx_in_use() -> bool:
    """Whether this llama.cpp build would put weights in its AMX buffers (built with AMX, on a CPU
    that has it). Its AMX matmul crashes on any batch wider than one token (llama.cpp issue 20824,
    open; measured here: llama-bench -p 2 segfaults, -p 0 does not), and a verify is a batch, so
    on such a machine the extra buffer types stay off and the weights the CPU repack has kernels
    for are put in its buffers by name (``repack_overrides``)."""
    return b"AMX_INT8 = 1" in (bindings().llama_print_system_info() or b"")


# The weight types llama.cpp's CPU repack has x86 kernels for (ggml-cpu/repack.cpp,
# ggml_repack_get_optimal_repack_type, in llama-cpp-python 0.3.36's llama.cpp), each for a matrix
# whose rows (ne[1]) are a multiple of 8; Q2_K with AVX-512 only. A tensor put in its buffers
# without a kernel aborts the load, so only these are named.
X86_REPACKED = ("Q4_0", "Q4_K", "IQ4_NL", "MXFP4")
MATMUL_WEIGHT = re.compile(r"^blk\.(\d+)\.(attn_(?:q|k|v|qkv|output)|ffn_(?:gate|up|down))\.weight$")


class _BuftOverride(ctypes.Structure):  # llama.h's llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@functools.cache
def _ggml() -> tuple[Any, Any] | None:
    """ggml's base and registry libraries as llama-cpp-python ships them (None where they are not
    found), with the public calls cactus makes typed."""
    try:
        lib = Path(bindings().__file__).parent / "lib"
        base = ctypes.CDLL(str(next(lib.glob("libggml-base.*"))))
        reg = ctypes.CDLL(str(next(p for p in lib.glob("libggml.*") if "base" not in p.name)))
    except (ModelError, StopIteration, OSError):
        return None
    P, S = ctypes.c_void_p, ctypes.c_char_p
    for lib_, name, res, args in (
        (reg, "ggml_backend_dev_by_type", P, [ctypes.c_int]),
        (base, "ggml_backend_dev_backend_reg", P, [P]),
        (base, "ggml_backend_reg_get_proc_address", P, [P, S]),
        (base, "ggml_backend_buft_name", S, [P]),
        (base, "gguf_init_from_file", P, [S, _GGUFInit]),
        (base, "gguf_free", None, [P]),
        (base, "gguf_get_n_tensors", ctypes.c_int64, [P]),
        (base, "gguf_get_tensor_name", S, [P, ctypes.c_int64]),
        (base, "gguf_get_tensor_type", ctypes.c_int, [P, ctypes.c_int64]),
        (base, "ggml_type_name", S, [ctypes.c_int]),
        (base, "ggml_get_tensor", P, [P, S]),
        (base, "ggml_n_dims", ctypes.c_int, [P]),
        (base, "ggml_nrows", ctypes.c_int64, [P]),
        (base, "ggml_free", None, [P]),
    ):
        fn = getattr(lib_, name, None)
        if fn is None:
            return None
        fn.restype, fn.argtypes = res, args
    return base, reg


class _GGUFInit(ctypes.Structure):  # gguf.h's gguf_init_params
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


@functools.cache
def _repack_buffer_type() -> int | None:
    """llama.cpp's CPU_REPACK buffer type, None where this build has none."""
    libs = _ggml()
    if libs is None:
        return None
    base, reg_lib = libs
    dev = reg_lib.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    reg = base.ggml_backend_dev_backend_reg(dev) if dev else None
    fn = base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts") if reg else None
    if not fn:
        return None
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)
    i = 0
    while bufts and bufts[i]:
        if base.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return bufts[i]
        i += 1
    return None


def gguf_tensors(path: str) -> list[tuple[str, str, int, int]] | None:
    """Every tensor of a GGUF file as (name, type, dimensions, rows), read by ggml's own parser
    (metadata only), None where it cannot be read."""
    libs = _ggml()
    if libs is None:
        return None
    base = libs[0]
    ctx = ctypes.c_void_p()
    g = base.gguf_init_from_file(path.encode(), _GGUFInit(True, ctypes.pointer(ctx)))
    if not g:
        return None
    try:
        out = []
        for i in range(base.gguf_get_n_tensors(g)):
            name = base.gguf_get_tensor_name(g, i)
            t = base.ggml_get_tensor(ctx, name)
            kind = base.ggml_type_name(base.gguf_get_tensor_type(g, i)).decode().upper()
            out.append((name.decode(), kind, base.ggml_n_dims(t), base.ggml_nrows(t)))
        return out
    finally:
        base.gguf_free(g)
        if ctx:
            base.ggml_free(ctx)


def repack_patterns(tensors: list[tuple[str, str, int, int]], flags: set[str]) -> list[str]:
    """Name patterns (one per layer) for the matmul weights among ``tensors`` (gguf_tensors) that
    the x86 repack has kernels for on a CPU with these ``flags`` (none without AVX2)."""
    if "avx2" not in flags:
        return []
    types = X86_REPACKED + (("Q2_K",) if "avx512f" in flags else ())
    layers: dict[str, list[str]] = {}
    for name, kind, dims, rows in tensors:
        m = MATMUL_WEIGHT.match(name)
        if (m or name == "output.weight") and kind in types and dims == 2 and rows % 8 == 0:
            layers.setdefault(m.group(1) if m else "output", []).append(m.group(2) if m else "")
    return [
        r"^output\.weight$" if layer == "output" else rf"^blk\.{layer}\.({'|'.join(names)})\.weight$"
        for layer, names in layers.items()
    ]


def repack_overrides(path: str) -> tuple[Any, int] | None:
    """On an AMX build: llama.cpp's tensor buffer overrides that put the weights its CPU repack
    has kernels for in CPU_REPACK buffers (the AVX-512 kernels a build without AMX uses: verifies
    of 4 tokens 1.8x cheaper than plain buffers on the AMX Xeon, docs/llama-cpp.md), AMX left out;
    and how many tensors they name. None where nothing can be repacked."""
    buft = _repack_buffer_type()
    tensors = gguf_tensors(path) if buft is not None else None
    if not tensors:
        return None
    patterns = repack_patterns(tensors, cpu_flags())
    if not patterns:
        return None
    table = (_BuftOverride * (len(patterns) + 1))(*(_BuftOverride(p.encode(), buft) for p in patterns))
    named = sum(1 for name, *_ in tensors if any(re.search(p, name) for p in patterns))
    return table, named


_BUFFER_SIZE = re.compile(r"(\S+) model buffer size =\s*([0-9.]+) MiB")
BUFFERS = {
    "repacked": "llama.cpp's extra buffer types: weights repacked for this CPU's kernels",
    "repacked, AMX left out": "the weights the CPU repack has kernels for in its buffers, by name; AMX's left out (amx_in_use)",
    "plain": "plain CPU buffers, the file mapped (an AMX build where nothing can be repacked)",
}


def buffer_layout() -> str:
    """Where this build puts a GGUF's weights on this CPU (a BUFFERS key; "plain" too for a file
    with nothing to repack): what a step costs depends on it, so costs are kept per layout."""
    if not amx_in_use():
        return "repacked"
    return "repacked, AMX left out" if _repack_buffer_type() is not None else "plain"


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
    buffers: str  # where the weights are: BUFFERS
    buffer_mib: dict[str, float]  # MiB of weights per llama.cpp buffer type (CPU, CPU_REPACK, ...), as it logged them

    @classmethod
    def load(cls, path: str, threads: int) -> "GGUFModel":
        ll = bindings()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0  # this backend is the CPU's
        amx = amx_in_use()
        overrides = repack_overrides(path) if amx else None
        buffers = "repacked" if not amx else "repacked, AMX left out" if overrides else "plain"
        params.use_extra_bufts = buffers == "repacked"
        if overrides is not None:
            params.tensor_buft_overrides = ctypes.cast(overrides[0], ctypes.c_void_p)
        # Repacked weights are copies: with the file mapped too, both stay resident (1.8x the file
        # in the process's memory, measured); read into buffers instead (1.0x). Plain buffers map it.
        params.load_mode = ll.LLAMA_LOAD_MODE_MMAP if buffers == "plain" else ll.LLAMA_LOAD_MODE_NONE
        _log.clear()
        handle = ll.llama_model_load_from_file(path.encode(), params)
        if not handle and overrides is not None:  # (never worse than plain buffers: load it so)
            params.tensor_buft_overrides, params.load_mode, buffers = None, ll.LLAMA_LOAD_MODE_MMAP, "plain"
            handle = ll.llama_model_load_from_file(path.encode(), params)
        if not handle:
            why = next(
                (line for line in reversed(_log) if "error" in line.lower() or "failed" in line.lower()),
                _log[-1] if _log else "no reason given",
            )
            raise ModelError(f"llama.cpp could not load {path}: {why}")
        sizes = {m.group(1): float(m.group(2)) for m in map(_BUFFER_SIZE.search, _log) if m}
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
            buffers,
            sizes,
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
