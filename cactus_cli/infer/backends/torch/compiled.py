"""The compiled runner: a static KV cache sized once per request and fixed-shape step functions
compiled with ``torch.compile`` (``fullgraph=True, dynamic=False``; CUDA graphs on CUDA through
``mode="reduce-overhead"``). Rollback rewinds the cache length: stale slots are masked (the
mask is causal over slot index, and slot index = position) and then overwritten.

A forward of width w runs the smallest compiled width >= w, padding the input (the padded
rows' logits are dropped and their cache slots rewound); widths above every compiled one, and
prefills, run eagerly over the same static cache. Masks and positions are built outside the
graph, so a graph sees the same shapes every call and never recompiles after its warm-up.
"""

from __future__ import annotations

import shutil
import time
from typing import Callable

import torch

from cactus_cli.infer.backends.torch.eager import CachedLM
from cactus_cli.infer.load.sources import LoadedModel
from cactus_cli.infer.runner import CompileUnavailable, Row, one_by_one, to_device

MIN_CAPACITY = 512  # static caches come in powers of two from here, so a growing chat recompiles rarely
CUDA_CACHE_SHARE = 0.4  # of the GPU memory free at allocation, at most, for one model's static KV cache


def plan_capacity(need: int, limit: int, cuda: bool, memory_tokens: int | None = None) -> tuple[int, str | None]:
    """Slots for a static cache that must hold ``need`` tokens (``limit``: the most it can ever
    need). On a CPU: a power of two from MIN_CAPACITY, so a growing chat re-sizes (and recompiles)
    rarely. On CUDA exactly ``need`` (the caller asks once for all a run or chat may reach: every
    re-size re-records every graph), capped by ``memory_tokens`` (what the GPU's free memory
    holds). Returns (capacity, a note when memory capped it)."""
    if not cuda:
        cap = MIN_CAPACITY
        while cap < need:
            cap *= 2
        return max(need, min(cap, limit)), None
    if memory_tokens is not None and need > memory_tokens:
        cap = max(memory_tokens, MIN_CAPACITY)
        return cap, (
            f"the KV cache holds {cap} tokens (what {CUDA_CACHE_SHARE:.0%} of free GPU memory allows); "
            "a longer conversation re-sizes it and recompiles"
        )
    return need, None


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes one cached token takes in a static cache (keys and values of every layer)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return 2 * int(cfg.num_hidden_layers) * kv * head_dim * torch.empty((), dtype=dtype).element_size()


def tune_inductor(device_type: str) -> dict[str, object]:
    """What gpt-fast sets before compiling for a GPU: coordinate-descent tuning is what lets
    inductor fuse ``F.linear(x, w.to(dtype)) * scales`` (int8 weights) into one kernel instead of
    writing a bfloat16 copy of every weight each forward. Returns the settings applied."""
    if device_type != "cuda":
        return {}
    import torch._inductor.config as cfg

    applied: dict[str, object] = {}
    for path, value in (
        ("coordinate_descent_tuning", True),
        ("triton.unique_kernel_names", True),
        ("fx_graph_cache", True),
    ):
        owner, _, name = path.rpartition(".")
        target = getattr(cfg, owner) if owner else cfg
        if hasattr(target, name):
            setattr(target, name, value)
            applied[path] = value
    return applied


def compile_problem(device: torch.device) -> str | None:
    """Why compiling cannot work on ``device``, checked before trying (None: worth a try)."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++ or clang++) for torch.compile's CPU backend"
    if device.type == "mps":
        return "torch.compile does not support MPS well enough yet"
    try:
        from transformers import StaticCache  # noqa: F401
    except ImportError:
        return "this transformers has no StaticCache"
    return None


def _raise_recompile_limit() -> None:
    """One graph per (runner, width, cache size): more than dynamo's default of 8 entries per
    function in a bench over many k, so raise the limit once."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 256))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4096)


class CompiledLM(CachedLM):
    """A static KV cache and compiled fixed-width steps (see the module docstring)."""

    compiled = True

    def __init__(self, lm: LoadedModel, vocab_size: int, context_length: int, role: str = "model"):
        super().__init__(lm, vocab_size)
        self.role = role
        self.context_length = context_length
        self.capacity = 0
        self.length = 0  # tokens cached (the static cache's own counter is a device tensor: no syncs)
        self.widths: dict[int, Callable] = {}  # compiled width -> step function
        self.compile_seconds = 0.0
        self._slots: torch.Tensor | None = None
        self._plain_layers = False
        self._mode = "reduce-overhead" if lm.device.type == "cuda" else None
        self.cache_note: str | None = None  # set when GPU memory capped the cache below what was asked
        _raise_recompile_limit()
        tune_inductor(lm.device.type)

    # -- sequences: a static cache holds one --------------------------------------------------

    def sequence(self, seq: int) -> CompiledLM:
        if seq != 0:
            raise ValueError("a compiled runner holds one sequence (its static cache and graphs are one row's)")
        return self

    def forward_rows(self, rows: list[Row]) -> list[torch.Tensor]:
        return one_by_one(rows)

    def adopt(self, donor: CachedLM, length: int) -> int:
        return 0

    # -- the cache ---------------------------------------------------------------------------

    def reset(self) -> None:
        if self.cache is not None and self.length:
            self._rewind(self.length)
        self.length = 0

    @property
    def cache_len(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        extra = self.length - length
        if extra > 0:
            self._rewind(extra)
            self.length = length

    def _rewind(self, n: int) -> None:
        """Move every layer's length counter back ``n`` slots, in place (the graphs keep their
        addresses), in one foreach kernel rather than one per layer. Inside inference mode: on
        CUDA the counters were created in it (``.to(device)`` of a CPU tensor), and an in-place
        update of an inference tensor outside it raises."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self._rewind(n)
        if self._plain_layers:
            torch._foreach_sub_([layer.cumulative_length for layer in self.cache.layers], n)
        elif all(hasattr(layer, "crop") for layer in self.cache.layers):  # sliding-window layers: their own crop
            self.cache.crop(-n)
        else:  # (transformers < 5.24: only plain static layers rewind, by their length counter)
            raise CompileUnavailable(
                "this transformers cannot rewind a sliding-window static cache (5.24 or newer can)"
            )

    def reserve(
        self, tokens: int, widths: tuple[int, ...] = (), report: Callable[[str], None] | None = None, exact: bool = True
    ) -> None:
        """Size the static cache for ``tokens`` plus the widest step, and compile (with a warm-up)
        each width not compiled yet (``exact=False``: only widths no compiled one can pad to). A
        bigger cache is a new allocation (its contents are lost, so the next prefill starts over)
        and new graphs."""
        if not exact:
            widths = tuple(w for w in widths if not any(c >= w for c in self.widths))
        widest = max(widths + tuple(self.widths) + (1,))
        need = tokens + widest
        if need > self.capacity:
            cap, self.cache_note = plan_capacity(
                need, self.context_length + widest + 1, self.lm.device.type == "cuda", self._memory_tokens()
            )
            if self.cache_note and report is not None:
                report(f"{self.role}: {self.cache_note}")
            self._allocate(cap)
        for w in sorted(set(widths) - set(self.widths)):
            self._compile(w, report)

    def _memory_tokens(self) -> int | None:
        """Tokens a static cache may take of the GPU's free memory (None on other devices)."""
        dev = self.lm.device
        if dev.type != "cuda":
            return None
        try:
            per_token = kv_bytes_per_token(self.lm.model.config, self.lm.dtype)
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):  # an unusual attention layout: no cap
            return None
        free, _ = torch.cuda.mem_get_info(dev)
        free += self.capacity * per_token  # the cache being replaced is freed first
        return int(free * CUDA_CACHE_SHARE) // per_token

    def _allocate(self, capacity: int) -> None:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        old, self.widths = sorted(self.widths), {}
        self.cache = None  # the old cache and the graphs that captured it go before the new one is allocated
        if self.lm.device.type == "cuda":
            torch.cuda.empty_cache()
        self.cache = StaticCache(config=self.lm.model.config, max_cache_len=capacity)
        self._plain_layers = all(type(layer) is StaticLayer for layer in self.cache.layers)  # one foreach rewinds them
        self.capacity, self.length = capacity, 0
        self._slots = torch.arange(capacity, device=self.lm.device)
        with torch.inference_mode():  # one eager token allocates every layer (static addresses) before any tracing
            pos, mask = self._inputs(0, 1)
            self._call(torch.zeros(1, 1, dtype=torch.int64, device=self.lm.device), pos, mask, 1)
            self._rewind(1)
        for w in old:  # the graphs captured the old cache: build them again for the new one
            self._compile(w, None)

    # -- steps -------------------------------------------------------------------------------

    def _inputs(self, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [1, width] and the additive mask [1, 1, width, capacity]: query i (at
        position start + i) sees slots 0..start + i; later slots are stale or padding."""
        dev = self.lm.device
        pos = torch.arange(start, start + width, device=dev).clamp_(max=self.capacity - 1).view(1, width)
        blocked = self._slots.view(1, -1) > pos.view(width, 1)  # [width, capacity]
        mask = torch.zeros(1, 1, width, self.capacity, dtype=self.lm.dtype, device=dev)
        mask.masked_fill_(blocked, torch.finfo(self.lm.dtype).min)
        return pos, mask

    def _call(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, keep: int) -> torch.Tensor:
        out = self._body(ids, keep, self.cache, position_ids=pos, attention_mask=mask)
        return out.logits

    @torch.inference_mode()  # as forward runs: a graph traced outside it would be traced again inside
    def _compile(self, width: int, report: Callable[[str], None] | None) -> None:
        if report is not None:
            report(f"compiling the {self.role}'s {width}-token step (once per run; excluded from tokens/s)")
        fn = torch.compile(self._call, fullgraph=True, dynamic=False, mode=self._mode)
        t0 = time.perf_counter()
        ids = torch.zeros(1, width, dtype=torch.int64, device=self.lm.device)
        saved = self.length
        try:
            # warm-up at the end of what is cached, then rewind: on CUDA the first calls warm up
            # and record the graph, so three calls leave it ready to replay
            for _ in range(3 if self._mode else 1):
                pos, mask = self._inputs(self.length, width)
                fn(ids, pos, mask, width)
                self._rewind(width)
        except Exception as err:  # noqa: BLE001 - any compiler failure means "run eagerly"
            raise CompileUnavailable(first_line(err)) from err
        finally:
            self.length = saved
        if self.lm.device.type == "cuda":
            torch.cuda.synchronize(self.lm.device)
        self.compile_seconds += time.perf_counter() - t0
        self.widths[width] = fn

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor | list[int], keep: int) -> torch.Tensor:
        ids = to_device(ids, self.lm.device).view(1, -1)
        w = ids.shape[1]
        if self.length + w > self.capacity:
            raise RuntimeError(f"the static cache holds {self.capacity} tokens; reserve() more before this forward")
        width = min((c for c in self.widths if c >= w), default=None)
        if width is None or self.length + width > self.capacity:  # a prefill or a long catch-up: eager
            pos, mask = self._inputs(self.length, w)
            rows = self._call(ids, pos, mask, keep)[0]  # [keep, V]
        else:
            if width > w:
                ids = torch.cat([ids, ids.new_zeros(1, width - w)], 1)  # padding: rows dropped, slots rewound
            pos, mask = self._inputs(self.length, width)
            if self._mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            rows = self.widths[width](ids, pos, mask, width)[0, w - keep : w].clone()  # a CUDA graph reuses its output
            if width > w:
                self._rewind(width - w)
        self.length += w
        self.forward_passes += 1
        return rows[:, : self.vocab_size]


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".strip().rstrip(":")
