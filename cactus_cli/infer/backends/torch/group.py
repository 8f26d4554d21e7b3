"""Tensor parallelism (`--tp N`), the process group: checks before anything starts, starting the
other ranks (or joining torchrun's), the rendezvous, watching the followers and stopping them.

The verifier is sharded over N processes with transformers' tensor-parallel plans (q/k/v/gate/up
column-wise, o/down row-wise, lm_head gathered) under torch.distributed; NCCL on CUDA, gloo
(float32) on CPU. Rank 0 is the driver: it reads input, prints, runs the draft, the k policy and
the acceptance rule, exactly as without --tp. Its verifier runner (sharded.py, beside this) announces each
call to the other ranks, whose only job is to run the same call on their shard (app/follower.py,
started here as ``python -m cactus_cli.app.follower``), so every rank's KV cache holds the same
sequence and every collective lines up. The draft lives on rank 0 only.

`cactus ... --tp N` starts ranks 1..N-1 itself (this process becomes rank 0 and keeps the
terminal); under `torchrun`, every rank runs the command and ranks > 0 serve as followers.
A rank that dies ends the others with one line.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from cactus_cli.core.errors import ConfigError

FOLLOWER_MODULE = "cactus_cli.app.follower"  # what a started rank runs (the loop sits above the engine)
FOLLOWER_ENV = "CACTUS_TP_FOLLOWER"  # set for the ranks this process starts
STORE_ENV = "CACTUS_TP_STORE"  # the rendezvous file of a group this process started (no network port)
LOG_ENV = "CACTUS_TP_LOG"  # a started follower's own log file, removed by it if rank 0 dies
RENDEZVOUS_SECONDS = 60  # every rank must have joined by then (CACTUS_TP_RENDEZVOUS_SECONDS overrides)
COLLECTIVE_MINUTES = 10  # a forward's collectives (a hung peer); waiting for the next command has no limit
_followers: list[tuple[subprocess.Popen, Path]] = []
_store_dir: Path | None = None
_commands = None  # the process group commands are broadcast on (no timeout: rank 0 may wait on a user)
_started = False
_at_stop: list[Callable[[], None]] = []  # rank 0's sharded runner: tells the followers to stop


def at_stop(close: Callable[[], None]) -> None:
    """Run ``close`` (tell the followers to stop) when rank 0 stops the group."""
    _at_stop.append(close)


def commands_group():
    """The process group rank 0 broadcasts runner calls on (no timeout)."""
    return _commands


def comm_device() -> torch.device:
    """Where command tensors live: the current GPU under NCCL, the CPU under gloo."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def is_follower() -> bool:
    """A rank > 0 of a tensor-parallel group (started by us or by torchrun)."""
    rank, world = rank_and_world()
    return world > 1 and rank > 0


# --------------------------------------------------------------------------- checks


def check_tp(tp: int, config: Any, device: torch.device, verifier: str) -> None:
    """Fail before starting anything: no plan for this architecture, heads that do not divide,
    more ranks than GPUs."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(cfg, "base_model_tp_plan", None):
        arch = ", ".join(getattr(config, "architectures", None) or [type(config).__name__])
        raise ConfigError(
            f"--tp {tp}: transformers has no tensor-parallel plan for {arch} ({verifier}); run it without --tp"
        )
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % tp or kv % tp:
        raise ConfigError(
            f"--tp {tp}: the verifier has {heads} attention heads and {kv} key/value heads; "
            f"N must divide both (e.g. --tp {max(d for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0 and d <= tp)})"
        )
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if tp > visible:
            raise ConfigError(
                f"--tp {tp}: only {visible} GPU{'s' if visible != 1 else ''} visible; use --tp {visible} or fewer"
            )


# --------------------------------------------------------------------------- the group


def start(tp: int, device: torch.device, load: dict[str, Any]) -> None:
    """Make this process rank 0 of a ``tp``-rank group: start the other ranks (unless torchrun
    did) and join the process group. ``load`` tells the followers what to load."""
    global _started
    if _started:  # the followers are serving the first verifier: a second load would hang them
        raise ConfigError(
            "--tp: this process already runs a tensor-parallel group; load one verifier per run "
            "(one --quantize value, no model switch in chat)"
        )
    _started = True
    rank, world = rank_and_world()
    if world > 1:  # under torchrun (or already started)
        if world != tp:
            raise ConfigError(f"--tp {tp} but this group has WORLD_SIZE={world}; make them agree")
        atexit.register(stop_followers)  # tells torchrun's other ranks to stop
    else:
        global _store_dir
        # one machine: rendezvous through a file in a private folder, so no rank listens on a port
        _store_dir = Path(tempfile.mkdtemp(prefix="cactus-tp-"))
        store = str(_store_dir / "store")
        # and the ranks' own connections (gloo pairs, NCCL's bootstrap) on loopback only
        loopback = "lo0" if sys.platform == "darwin" else "lo"
        local = {name: os.environ.get(name, loopback) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
        base = dict(
            os.environ,
            WORLD_SIZE=str(tp),
            TRANSFORMERS_VERBOSITY="error",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            TQDM_DISABLE="1",
            **{STORE_ENV: store},
            **local,
        )
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # share the cores, as torchrun does
            threads = max(1, (os.cpu_count() or 1) // tp)
            base["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        for r in range(1, tp):
            fd, name = tempfile.mkstemp(prefix=f"cactus-tp-rank{r}-", suffix=".log")
            os.close(fd)
            log = Path(name)
            env = dict(base, RANK=str(r), LOCAL_RANK=str(r), **{FOLLOWER_ENV: json.dumps(load), LOG_ENV: name})
            with open(log, "w") as err:
                # stdin: a pipe only this process writes to, and never does: its end tells the follower we are gone
                proc = subprocess.Popen(
                    [sys.executable, "-m", FOLLOWER_MODULE],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                )  # Ctrl-C reaches rank 0 only
            _followers.append((proc, log))
        os.environ.update(WORLD_SIZE=str(tp), RANK="0", LOCAL_RANK="0", **{STORE_ENV: store}, **local)
        atexit.register(stop_followers)
        threading.Thread(target=_watch_followers, daemon=True).start()
    init(device)


def init(device: torch.device) -> None:
    """Join the group. The rendezvous is bounded (RENDEZVOUS_SECONDS, saying what it waits
    for), so a peer that never comes is one line, not a silent wait; a forward's collectives
    are bounded too (COLLECTIVE_MINUTES); the commands rank 0 broadcasts get a group of their
    own without a limit, since rank 0 may wait on its user for hours."""
    global _commands
    import torch.distributed as dist

    if dist.is_initialized():
        return
    rank, world = rank_and_world()
    store_path = os.environ.get(STORE_ENV)
    if store_path is None and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise ConfigError(
            f"WORLD_SIZE={world} and RANK={rank} are set but MASTER_ADDR/MASTER_PORT are not; "
            "run under torchrun, or unset WORLD_SIZE and RANK and let --tp start its own ranks"
        )
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    seconds = float(os.environ.get("CACTUS_TP_RENDEZVOUS_SECONDS", RENDEZVOUS_SECONDS))
    wait = timedelta(seconds=seconds)
    where = "a private rendezvous file" if store_path else f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if rank == 0 and store_path is None:
        sys.stderr.write(f"waiting up to {seconds:g} s for {world} tensor-parallel ranks at {where}\n")
    try:
        if store_path:
            store = dist.FileStore(store_path, world)
            store.set_timeout(wait)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=wait)
        else:  # torchrun or the user's own launcher: their address and port
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=wait)
    except (RuntimeError, ValueError) as err:
        first = " ".join(str(err).split())[:160]
        raise ConfigError(
            f"tensor parallel: not all {world} ranks joined within {seconds:g} s at {where} "
            f"({first}); check that every rank was started"
        ) from None
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(minutes=COLLECTIVE_MINUTES))
    _commands = dist.new_group(list(range(world)), timeout=timedelta(days=365))


def _watch_followers() -> None:
    """Rank 0: a follower that exits before being told to ends the run with one line."""
    while True:
        time.sleep(0.2)
        _end_if_a_follower_died()


def _end_if_a_follower_died() -> None:
    for r, (proc, log) in enumerate(_followers, start=1):
        code = proc.poll()
        if code is not None and code != 0 and not getattr(proc, "_told_to_stop", False):
            last = _last_line(log)
            sys.stderr.write(
                f"error: tensor-parallel rank {r} exited with code {code}"
                f"{': ' + last if last else ''}; stopping every rank\n"
            )
            sys.stderr.flush()
            stop_followers(kill=True)
            os._exit(1)


def _last_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def peer_failed(err: BaseException) -> None:
    """Rank 0: a collective failed (a peer died mid-call). Say which rank and why, in one line,
    and end every rank, instead of a gloo/NCCL traceback."""
    deadline = time.monotonic() + 2  # the dead follower's exit code may take a moment to show
    while time.monotonic() < deadline:
        _end_if_a_follower_died()
        time.sleep(0.1)
    first = " ".join(str(err).split())[:200]
    sys.stderr.write(f"error: a tensor-parallel peer failed ({first}); stopping every rank\n")
    sys.stderr.flush()
    stop_followers(kill=True)
    os._exit(1)


def stop_followers(kill: bool = False) -> None:
    """Rank 0 on exit: tell followers to stop (if the group still works), then make sure."""
    for proc, _ in _followers:
        proc._told_to_stop = True  # type: ignore[attr-defined]
    if not kill:
        for close in _at_stop:
            with contextlib.suppress(Exception):
                close()
    deadline = time.monotonic() + (0 if kill else 5)
    for proc, log in _followers:
        with contextlib.suppress(Exception):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            log.unlink()
    _followers.clear()
    if _store_dir is not None:
        shutil.rmtree(_store_dir, ignore_errors=True)
