"""A tensor-parallel follower (ranks > 0 under --tp): join the group, load this rank's shard of
the verifier the way rank 0 loads its own, then run every runner call rank 0 announces until it
says stop. Nothing imports this module: rank 0 starts it as ``python -m cactus_cli.app.follower``
(infer/backends/torch/group.py), with a pipe on its stdin whose end tells it rank 0 is gone, and under
torchrun app/runtime.py hands a rank > 0 to ``serve`` before any model is loaded for
generation. Rank 0 that dies takes its followers with it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from cactus_cli.infer.backends.torch import group
from cactus_cli.infer.backends.torch.eager import CachedLM
from cactus_cli.infer.backends.torch.sharded import CMD_SLOTS, parse_command
from cactus_cli.infer.pair.loader import load_shard
from cactus_cli.infer.runner import Runner


def follow(runner: Runner) -> None:
    """Run what rank 0 announces, until it says stop."""
    import torch.distributed as dist

    device = group.comm_device()
    while True:
        cmd = torch.empty(CMD_SLOTS, dtype=torch.int64, device=device)
        dist.broadcast(cmd, src=0, group=group.commands_group())
        op, n, arg, ids = parse_command(cmd)
        if n > len(ids):
            rest = torch.empty(n - len(ids), dtype=torch.int64, device=device)
            dist.broadcast(rest, src=0, group=group.commands_group())
            ids = torch.cat([ids, rest])
        if op == "stop":
            return
        if op == "forward":
            runner.forward(ids, arg)
        elif op == "crop":
            runner.crop(arg)
        else:
            runner.reset()


PEER_GRACE_SECONDS = 2.0  # after a failed collective, how long to wait for the sign that rank 0 is gone
_rank0_gone = threading.Event()


class PeerLost(RuntimeError):
    """A collective failed while following rank 0: rank 0 (or another rank) went away."""


def _watch_rank0() -> None:
    """A follower whose rank 0 died (killed, crashed) exits instead of waiting forever, and
    removes what rank 0 can no longer clean: its own log and the rendezvous folder.

    Rank 0 holds the write end of this process's stdin and never writes to it, so the end of
    that pipe means rank 0 is exiting, however it died: the read returns at once, whatever the
    load. (Polling ``os.getppid()`` was not enough: a killed rank 0's sockets close before the
    kernel reparents its children, so the collective failed first, the follower checked its
    parent, still saw rank 0, and exited leaving both behind.)"""
    with contextlib.suppress(OSError):
        while os.read(0, 1):
            pass
    _rank0_gone.set()
    _remove_leftovers()
    os._exit(3)


def _remove_leftovers() -> None:
    with contextlib.suppress(OSError, KeyError):
        Path(os.environ[group.LOG_ENV]).unlink()
    if os.environ.get(group.STORE_ENV):
        shutil.rmtree(Path(os.environ[group.STORE_ENV]).parent, ignore_errors=True)


def serve(load: dict[str, Any]) -> None:
    """Join the group, load the verifier's shard, follow rank 0 until it says stop."""
    device = torch.device(load["device"])
    group.init(device)
    lm, vocab = load_shard(load)
    try:
        with torch.inference_mode():
            follow(CachedLM(lm, vocab))
    except RuntimeError as err:  # a collective failed: rank 0 went away without saying stop (killed, crashed)
        first = " ".join(str(err).split())[:300]
        if os.environ.get(group.FOLLOWER_ENV):
            raise PeerLost(first) from None  # main() knows whether rank 0 is gone
        print(f"a collective with rank 0 failed ({first}); this rank stops too", file=sys.stderr)
        os._exit(3)  # (under torchrun: nothing of ours to clean, and no interpreter teardown with a broken group)
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def main() -> None:
    """A rank started by rank 0: the load spec comes in the environment, rank 0's pipe on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 owns Ctrl-C
    threading.Thread(target=_watch_rank0, daemon=True).start()
    try:
        serve(json.loads(os.environ[group.FOLLOWER_ENV]))
    except Exception as err:  # noqa: BLE001 - one line for rank 0 to show
        print(f"{type(err).__name__}: {' '.join(str(err).split())[:300]}", file=sys.stderr)
        if isinstance(err, PeerLost):  # rank 0 is most likely dying: let the watcher see its pipe end and clean up
            _rank0_gone.wait(PEER_GRACE_SECONDS)
        sys.exit(1)  # rank 0 is alive: it reads this log's last line, then removes it


if __name__ == "__main__":
    main()
