"""Tensor parallelism (`--tp N`): the verifier sharded over N processes with transformers'
tensor-parallel plans (q/k/v/gate/up column-wise, o/down row-wise, lm_head gathered) under
torch.distributed; NCCL on CUDA, gloo (float32) on CPU.

Rank 0 is the driver: it reads input, prints, runs the draft, the k policy and the acceptance
rule, exactly as without --tp. Its verifier runner (``ShardedLM``) is the same interface as
any other: each ``forward`` / ``crop`` / ``reset`` is first broadcast to the other ranks, whose
only job is to run the same call on their shard (``follow``), so every rank's KV cache holds the
same sequence and every collective lines up. The draft lives on rank 0 only: acceptance is
decided there, so a replica elsewhere would sit idle.

`cactus ... --tp N` starts ranks 1..N-1 itself (this process becomes rank 0 and keeps the
terminal); under `torchrun`, every rank runs the command and ranks > 0 turn into followers.
A rank that dies ends the others with one line; Ctrl-C on rank 0 is deferred until the
collective in flight has finished, so no rank is left waiting inside one.
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
from typing import Any, Iterator

import torch

from cactus_cli.errors import ConfigError
from cactus_cli.runners import CachedLM, to_device

FOLLOWER_ENV = "CACTUS_TP_FOLLOWER"  # set for the ranks this process starts
STORE_ENV = "CACTUS_TP_STORE"  # the rendezvous file of a group this process started (no network port)
LOG_ENV = "CACTUS_TP_LOG"  # a started follower's own log file, removed by it if rank 0 dies
RENDEZVOUS_SECONDS = 60  # every rank must have joined by then (CACTUS_TP_RENDEZVOUS_SECONDS overrides)
COLLECTIVE_MINUTES = 10  # a forward's collectives (a hung peer); waiting for the next command has no limit
_followers: list[tuple[subprocess.Popen, Path]] = []
_store_dir: Path | None = None
_commands = None  # the process group commands are broadcast on (no timeout: rank 0 may wait on a user)
_started = False


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
        raise ConfigError(f"--tp {tp}: transformers has no tensor-parallel plan for {arch} ({verifier}); "
                          "run it without --tp")
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % tp or kv % tp:
        raise ConfigError(f"--tp {tp}: the verifier has {heads} attention heads and {kv} key/value heads; "
                          f"N must divide both (e.g. --tp {max(d for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0 and d <= tp)})")
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if tp > visible:
            raise ConfigError(f"--tp {tp}: only {visible} GPU{'s' if visible != 1 else ''} visible; use --tp {visible} or fewer")


# --------------------------------------------------------------------------- the group


def start(tp: int, device: torch.device, load: dict[str, Any]) -> None:
    """Make this process rank 0 of a ``tp``-rank group: start the other ranks (unless torchrun
    did) and join the process group. ``load`` tells the followers what to load."""
    global _started
    if _started:  # the followers are serving the first verifier: a second load would hang them
        raise ConfigError("--tp: this process already runs a tensor-parallel group; load one verifier per run "
                          "(one --quantize value, no model switch in chat)")
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
        base = dict(os.environ, WORLD_SIZE=str(tp), TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1",
                    TQDM_DISABLE="1", **{STORE_ENV: store}, **local)
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
                proc = subprocess.Popen([sys.executable, "-m", "cactus_cli.distributed"], env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                        start_new_session=True)  # Ctrl-C reaches rank 0 only
            _followers.append((proc, log))
        os.environ.update(WORLD_SIZE=str(tp), RANK="0", LOCAL_RANK="0", **{STORE_ENV: store}, **local)
        atexit.register(stop_followers)
        threading.Thread(target=_watch_followers, daemon=True).start()
    _init(device)


def _init(device: torch.device) -> None:
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
        raise ConfigError(f"WORLD_SIZE={world} and RANK={rank} are set but MASTER_ADDR/MASTER_PORT are not; "
                          "run under torchrun, or unset WORLD_SIZE and RANK and let --tp start its own ranks")
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
        raise ConfigError(f"tensor parallel: not all {world} ranks joined within {seconds:g} s at {where} "
                          f"({first}); check that every rank was started") from None
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
            sys.stderr.write(f"error: tensor-parallel rank {r} exited with code {code}"
                             f"{': ' + last if last else ''}; stopping every rank\n")
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
    if not kill and _active_runner is not None:
        with contextlib.suppress(Exception):
            _active_runner.close()
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


# --------------------------------------------------------------------------- the runners

_active_runner: ShardedLM | None = None


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


OPS = ("stop", "reset", "forward", "crop")
CMD_SLOTS = 64  # [op, n, arg, ids...]: a step's ids ride inline; a longer forward (a prefill) sends the rest after
_INLINE = CMD_SLOTS - 3


def command(op: str, arg: int = 0, ids: torch.Tensor | None = None,
            device: torch.device = torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A runner call as a fixed-size int64 tensor on ``device`` (one broadcast, nothing pickled,
    no host sync for ids already on the device), plus the ids that do not fit inline."""
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


def _comm_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class ShardedLM(CachedLM):
    """Rank 0's verifier runner: every call is announced to the followers, then made."""

    def __init__(self, lm, vocab_size: int):
        global _active_runner
        super().__init__(lm, vocab_size)
        _active_runner = self

    def _announce(self, op: str, arg: int = 0, ids: torch.Tensor | None = None) -> None:
        import torch.distributed as dist

        cmd, rest = command(op, arg, ids, _comm_device())
        dist.broadcast(cmd, src=0, group=_commands)
        if rest is not None:
            dist.broadcast(rest, src=0, group=_commands)

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        with _sigint_deferred():
            try:
                yield
            except RuntimeError as err:  # gloo / NCCL: a peer is gone
                if "Connection closed" in str(err) or "peer" in str(err).lower() or "NCCL" in str(err):
                    peer_failed(err)
                raise

    def reset(self) -> None:
        with self._collective():
            self._announce("reset")
            super().reset()

    def forward(self, ids, keep: int) -> torch.Tensor:
        ids = to_device(ids, self.lm.device)
        with self._collective():
            self._announce("forward", keep, ids)
            return super().forward(ids, keep)

    def crop(self, length: int) -> None:
        with self._collective():
            self._announce("crop", length)
            super().crop(length)

    def close(self) -> None:
        self._announce("stop")


def follow(runner: CachedLM) -> None:
    """Ranks > 0: run what rank 0 announces, until it says stop."""
    import torch.distributed as dist

    device = _comm_device()
    while True:
        cmd = torch.empty(CMD_SLOTS, dtype=torch.int64, device=device)
        dist.broadcast(cmd, src=0, group=_commands)
        op, n, arg, ids = parse_command(cmd)
        if n > len(ids):
            rest = torch.empty(n - len(ids), dtype=torch.int64, device=device)
            dist.broadcast(rest, src=0, group=_commands)
            ids = torch.cat([ids, rest])
        if op == "stop":
            return
        if op == "forward":
            runner.forward(ids, arg)
        elif op == "crop":
            runner.crop(arg)
        else:
            runner.reset()


def _watch_parent() -> None:
    """A follower whose rank 0 died (killed, crashed) exits instead of waiting forever, and
    removes what rank 0 can no longer clean: its own log and the rendezvous folder."""
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            _remove_leftovers()
            os._exit(3)


def _remove_leftovers() -> None:
    with contextlib.suppress(OSError):
        Path(os.environ[LOG_ENV]).unlink()
    if os.environ.get(STORE_ENV):
        shutil.rmtree(Path(os.environ[STORE_ENV]).parent, ignore_errors=True)


def follower_main(load: dict[str, Any]) -> None:
    """A follower: join the group, load the verifier's shard the way rank 0 does, follow."""
    from cactus_cli.models import load_shard

    if os.environ.get(FOLLOWER_ENV):
        threading.Thread(target=_watch_parent, daemon=True).start()
    device = torch.device(load["device"])
    _init(device)
    lm, vocab = load_shard(load)
    try:
        with torch.inference_mode():
            follow(CachedLM(lm, vocab))
    except RuntimeError as err:  # rank 0 went away without saying stop (killed, crashed)
        if "Connection closed" in str(err) or "NCCL" in str(err):
            print("rank 0 is gone; this rank stops too", file=sys.stderr)
            if os.environ.get(FOLLOWER_ENV):
                _remove_leftovers()
            os._exit(3)
        raise
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        dist.destroy_process_group()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 owns Ctrl-C
    parent = os.getppid()
    try:
        follower_main(json.loads(os.environ[FOLLOWER_ENV]))
    except Exception as err:  # noqa: BLE001 - one line for rank 0 to show
        print(f"{type(err).__name__}: {' '.join(str(err).split())[:300]}", file=sys.stderr)
        sys.exit(1)
    finally:
        if os.getppid() != parent:  # rank 0 died (whatever error that surfaced as): nobody else cleans up
            _remove_leftovers()
