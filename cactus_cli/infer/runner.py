"""The one interface to a model, ``Runner``: one sequence of a model's KV cache. ``forward`` new
tokens and read logits, ``crop`` back after a rejection, ``prefill`` a prompt, ``reserve`` room
for a request. A model holds several sequences (one per slot of the engine): ``sequence(i)`` is
the runner of sequence i of the same model, ``forward_rows`` decodes several sequences' new tokens
in one model call (llama.cpp: one ``llama_decode``; torch: one forward over padded rows), and
``adopt`` copies a prefix another sequence holds (a shared system prompt is not prefilled twice).
The engine and the drafters only ever call these; the helpers below are shared by the
implementations."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from cactus_cli.infer.load.sources import LoadedModel


class CompileUnavailable(RuntimeError):
    """A compiled runner cannot compile here (torch.compile: no C++ compiler, an unsupported model,
    an old torch); the engine then builds its runners again, eager."""


class Runner(Protocol):
    """Everything the engine and the drafters use of a model runner."""

    lm: LoadedModel  # the model, its device and dtype
    vocab_size: int  # logits are cut to this many columns
    compiled: bool
    forward_passes: int  # model calls so far (prefills included)
    compile_seconds: float  # spent compiling (0 for an eager runner); excluded from tokens/s
    step_block: int  # a step's tokens cost least per token in whole multiples of this many (1: any width)

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

    def reserve(
        self, tokens: int, widths: tuple[int, ...] = (), report: Callable[[str], None] | None = None, exact: bool = True
    ) -> None:
        """Room for ``tokens`` cached tokens and steps of these widths (compiling them, if compiled)."""

    def sequence(self, seq: int) -> "Runner":
        """The runner of sequence ``seq`` of this model (``seq`` below the ``sequences`` the
        backend made the model for; 0 is the first runner made)."""

    def forward_rows(self, rows: list[Row]) -> list[torch.Tensor]:
        """One model call over several sequences of this model: for each row (a runner of one of
        its sequences, new ids [L], keep) the last ``keep`` logits rows [keep, V] (``keep`` 0:
        none, the ids only enter the cache). A row is never split across calls."""

    def adopt(self, donor: "Runner", length: int) -> int:
        """Make this sequence's cache hold the first ``length`` tokens that ``donor`` (another
        sequence of the same model) holds, without computing them again; returns the tokens
        now cached (0 where it cannot copy)."""


MAX_STEP_WIDTH = 128  # logits rows one forward_rows call may ask for in all (a step of many runs stays within it)
Row = tuple["Runner", "torch.Tensor | list[int]", int]  # (the runner of one sequence, new ids [L], logits rows kept)


def one_by_one(rows: list[Row]) -> list[torch.Tensor]:
    """``forward_rows`` for a runner that decodes one sequence per call: each row its own call,
    in order (rows of different sequences; no row is split). keep 0 returns an empty tensor."""
    out = []
    for runner, ids, keep in rows:
        logits = runner.forward(ids, keep=max(keep, 1))
        out.append(logits[logits.shape[0] - keep :] if keep else logits[:0])
    return out


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
    keep = cached_prefix(runner, prompt, previous, reuse)
    if len(prompt) - 1 > keep:
        runner.forward(prompt[keep:-1], keep=1)
    return keep


def cached_prefix(runner: Runner, prompt: list[int], previous: list[int], reuse: bool) -> int:
    """The first half of a prefill: the cache keeps the longest prefix ``prompt`` shares with
    ``previous`` (with ``reuse``; else it is emptied); returns its length. ``prompt[keep:-1]`` is
    left to feed, whole or in chunks beside other sequences' steps."""
    keep = min(common_prefix(previous[: runner.cache_len], prompt), len(prompt) - 1) if reuse else 0
    if keep:
        runner.crop(keep)
        return runner.cache_len  # (0 when a sliding window could not go back that far)
    runner.reset()
    return 0
