"""Rank 0's verifier runner under --tp: it wraps the runner of rank 0's shard and announces every
call (forward, crop, reset) to the other ranks before making it, so every rank's KV cache holds
the same sequence and every collective lines up. A call is one fixed-size int64 tensor (one
broadcast, nothing pickled, no host sync for ids already on the device). Ctrl-C during a call
is deferred until it has finished, so no rank is left waiting inside a collective."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator

import torch

from cactus_cli.infer.backends.torch import group
from cactus_cli.infer.load.sources import LoadedModel
from cactus_cli.infer.runner import Row, Runner, one_by_one, prefill, to_device

OPS = ("stop", "reset", "forward", "crop")
CMD_SLOTS = 64  # [op, n, arg, ids...]: a step's ids ride inline; a longer forward (a prefill) sends the rest after
_INLINE = CMD_SLOTS - 3


def command(
    op: str, arg: int = 0, ids: torch.Tensor | None = None, device: torch.device = torch.device("cpu")
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A runner call as a fixed-size int64 tensor on ``device``, plus the ids that do not fit inline."""
    n = 0 if ids is None else ids.numel()  # a shape: known without a sync
    inline = min(n, _INLINE)
    parts = [to_device([OPS.index(op), n, arg], device)]
    if inline:
        parts.append(ids.view(-1)[:inline].to(device))
    parts.append(torch.zeros(_INLINE - inline, dtype=torch.int64, device=device))
    rest = ids.view(-1)[inline:].to(device) if n > inline else None
    return torch.cat(parts), rest


def parse_command(cmd: torch.Tensor) -> tuple[str, int, int, torch.Tensor]:
    """(op, number of ids, arg, the inline ids) from a ``command`` tensor."""
    op, n, arg = cmd[:3].tolist()
    return OPS[op], n, arg, cmd[3 : 3 + min(n, _INLINE)]


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ctrl-C (or SIGTERM) during a collective would leave the other ranks inside it: hold it
    until the call is done, then raise it (main thread only; elsewhere nothing to defer)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit: list[int] = []
    previous = {sig: signal.signal(sig, lambda *_: hit.append(1)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if hit:
        raise KeyboardInterrupt


class ShardedRunner:
    """A ``Runner`` that announces each call to the followers, then makes it on ``inner``."""

    compiled = False  # (--compile does not combine with --tp yet)
    step_block = 1

    def __init__(self, inner: Runner):
        self.inner = inner
        group.at_stop(self.close)

    @property
    def lm(self) -> LoadedModel:
        return self.inner.lm

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def forward_passes(self) -> int:
        return self.inner.forward_passes

    @property
    def compile_seconds(self) -> float:
        return self.inner.compile_seconds

    @property
    def cache_len(self) -> int:
        return self.inner.cache_len

    def _announce(self, op: str, arg: int = 0, ids: torch.Tensor | None = None) -> None:
        import torch.distributed as dist

        cmd, rest = command(op, arg, ids, group.comm_device())
        dist.broadcast(cmd, src=0, group=group.commands_group())
        if rest is not None:
            dist.broadcast(rest, src=0, group=group.commands_group())

    def _call(self, op: str, make: Callable[[], object], arg: int = 0, ids: torch.Tensor | None = None):
        with _sigint_deferred():
            try:
                self._announce(op, arg, ids)
                return make()
            except RuntimeError as err:  # gloo / NCCL: a peer is gone
                if "Connection closed" in str(err) or "peer" in str(err).lower() or "NCCL" in str(err):
                    group.peer_failed(err)
                raise

    def reset(self) -> None:
        self._call("reset", self.inner.reset)

    def forward(self, ids, keep: int) -> torch.Tensor:
        ids = to_device(ids, self.lm.device)
        return self._call("forward", lambda: self.inner.forward(ids, keep), keep, ids)

    def crop(self, length: int) -> None:
        self._call("crop", lambda: self.inner.crop(length), length)

    def prefill(self, prompt: list[int], previous: list[int], reuse: bool) -> int:
        return prefill(self, prompt, previous, reuse)

    def reserve(
        self, tokens: int, widths: tuple[int, ...] = (), report: Callable[[str], None] | None = None, exact: bool = True
    ) -> None:
        self.inner.reserve(tokens, widths, report, exact)

    def sequence(self, seq: int) -> ShardedRunner:
        if seq != 0:
            raise ValueError("a sharded runner holds one sequence (every rank keeps the same one)")
        return self

    def forward_rows(self, rows: list[Row]) -> list[torch.Tensor]:
        return one_by_one(rows)

    def adopt(self, donor: Runner, length: int) -> int:
        return 0

    def close(self) -> None:
        self._announce("stop")
