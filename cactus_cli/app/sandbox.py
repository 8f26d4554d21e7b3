"""Running model-written code against its tests, so a wrong, hanging or hostile program is a
failed check and never stalls or harms the eval.

Each check is a fresh ``python -I`` in its own process group and an empty temporary folder
(removed afterwards), with an environment of its own (PATH, a locale, HOME and TMPDIR in that
folder: nothing inherited, no keys or tokens), stdin closed, CPU seconds, address space, file
size and (for a non-root user) process count limited with ``resource``, a wall-clock timeout,
and its output read and kept up to OUTPUT_BYTES (the rest is read and dropped, so an endless
print cannot block or fill memory). A watchdog kills the whole group on timeout or when it holds
more than MAX_PROCESSES processes (a fork bomb; root ignores RLIMIT_NPROC), and kills whatever
is left once the check ends. A check passes only if the tests ran to their end: the harness
writes a random token to a pipe only it knows after ``check(entry_point)`` returns, so a
``sys.exit(0)`` or ``os._exit(0)`` in the model's code is a failure, not a pass.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_SECONDS = 10.0
MEMORY_BYTES = 1 << 30  # address space per check
FILE_BYTES = 16 << 20  # largest file a check may write
MAX_PROCESSES = 32  # processes a check's group may hold
OUTPUT_BYTES = 16 << 10  # of stdout + stderr kept for the report
_HARNESS = """
import os as _cactus_os
_cactus_os.write({fd}, b"{token}")
"""
# the child sets its own limits before it runs the program (no preexec_fn: checks run from threads)
_BOOT = """
import resource, runpy
for _limit, _value in {limits!r}:
    try:
        resource.setrlimit(getattr(resource, _limit), (_value, _value))
    except (ValueError, OSError):
        pass
del _limit, _value
runpy.run_path("check.py", run_name="__main__")
"""


@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: str  # "passed", "failed" (an exception or exit code), "timeout", "exited early", "too many processes"
    output: str  # the first OUTPUT_BYTES of stdout and stderr
    seconds: float


def _limits(timeout: float) -> list[tuple[str, int]]:
    return [
        ("RLIMIT_CPU", int(timeout) + 1),
        ("RLIMIT_AS", MEMORY_BYTES),
        ("RLIMIT_FSIZE", FILE_BYTES),
        ("RLIMIT_NPROC", MAX_PROCESSES),
        ("RLIMIT_CORE", 0),
    ]


def _group_size(pgid: int) -> int:
    """Processes in a process group (Linux /proc; elsewhere 1: the limits alone bound it)."""
    count = 0
    try:
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                    count += int(fields[2]) == pgid  # (state, ppid, pgrp, ...)
                except (OSError, IndexError, ValueError):
                    continue
    except OSError:
        return 1
    return count


def _drain(stream, keep: bytearray) -> None:
    while chunk := stream.read(65536):
        if len(keep) < OUTPUT_BYTES:
            keep += chunk[: OUTPUT_BYTES - len(keep)]


def run_check(program: str, timeout: float | None = None) -> Outcome:
    """Run ``program`` (the model's code, then the task's tests) and say whether it passed
    (``timeout``: seconds of wall clock, TIMEOUT_SECONDS by default)."""
    timeout = TIMEOUT_SECONDS if timeout is None else timeout
    work = Path(tempfile.mkdtemp(prefix="cactus-check-"))
    token = secrets.token_hex(16)
    read_end, write_end = os.pipe()
    t0 = time.monotonic()
    try:
        (work / "check.py").write_text(program + _HARNESS.format(fd=write_end, token=token), encoding="utf-8")
        env = {
            "PATH": os.defpath,
            "LANG": "C.UTF-8",
            "HOME": str(work),
            "TMPDIR": str(work),
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT.format(limits=_limits(timeout))],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(write_end,),
            start_new_session=True,
        )
        os.close(write_end)
        write_end = -1
        kept = bytearray()
        reader = threading.Thread(target=_drain, args=(proc.stdout, kept), daemon=True)
        reader.start()
        status = None
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                status = "timeout"
            elif _group_size(proc.pid) > MAX_PROCESSES:
                status = "too many processes"
            if status:
                break
            time.sleep(0.05)
        _kill_group(proc.pid)
        proc.wait()
        reader.join(timeout=2)
        ran_to_end = _read_all(read_end) == token.encode()
        if status is None:
            status = (
                "passed"
                if proc.returncode == 0 and ran_to_end
                else ("exited early" if proc.returncode == 0 else "failed")
            )
        return Outcome(status == "passed", status, kept.decode("utf-8", "replace"), time.monotonic() - t0)
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(work, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_all(fd: int) -> bytes:
    """What the harness wrote (the pipe's write end is closed once every process is gone)."""
    os.set_blocking(fd, False)
    out = b""
    try:
        while chunk := os.read(fd, 4096):
            out += chunk
            if len(out) > 1024:
                break
    except BlockingIOError:
        pass
    return out


def run_checks(programs: list[str], workers: int | None = None, timeout: float | None = None) -> list[Outcome]:
    """Many checks, in parallel where there are cores (each is one process group)."""
    if not programs:
        return []
    workers = workers or max(
        1,
        min(len(programs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)),
    )
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: run_check(p, timeout), programs))
