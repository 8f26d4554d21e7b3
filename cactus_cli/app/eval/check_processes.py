"""A sandboxed check's processes (sandbox.py): finding them by PID namespace or process group,
holding the namespace's name while the check runs, a pids cgroup where one may be made, and
ending them all."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path


def pid_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def check_processes(launcher: int, pgid: int, ns: str | None) -> list[int]:
    """The check's processes: those in its PID namespace (``ns``, the launcher's child's), else
    (unsafe, or before the namespace exists) those in its process group."""
    found = []
    try:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if ns is not None:
                    if pid_namespace(entry.name) == ns:
                        found.append(int(entry.name))
                    continue
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                if int(fields[2]) == pgid:  # (state, ppid, pgrp, ...)
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        return [launcher]
    return found


def hold_namespace(launcher: int) -> tuple[int, str] | None:
    """The PID namespace the launcher made for the check (its child's), once it exists, held
    open: (a descriptor, its name). While the descriptor is open the namespace cannot be freed,
    so its name (an inode number) cannot pass to another check's namespace, whose processes a
    sweep by that name would then kill (checks run side by side: it happened)."""
    mine = pid_namespace("self")
    try:
        with open(f"/proc/{launcher}/task/{launcher}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    for child in children:
        try:
            fd = os.open(f"/proc/{child}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        ns = f"pid:[{os.fstat(fd).st_ino}]"  # (the name readlink gives, read from what is held)
        if ns != mine:
            return fd, ns
        os.close(fd)
    return None


class PidsCgroup:
    """A pids cgroup (v1 or v2) for one check, where this process may make one (root): a hard
    process limit on top of the watchdog. Nothing (and no error) where it may not."""

    def __init__(self, limit: int) -> None:
        self.path: Path | None = None
        for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
            if (root / "cgroup.procs").is_file() and os.access(root, os.W_OK):
                try:
                    path = Path(tempfile.mkdtemp(prefix="cactus-check-", dir=root))
                    (path / "pids.max").write_text(str(limit))  # (one past: the watchdog says why)
                    self.path = path
                    return
                except OSError:
                    continue

    def add(self, pid: int) -> None:
        if self.path is not None:
            try:
                (self.path / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass

    def remove(self) -> None:
        if self.path is not None:
            for _ in range(50):  # (a cgroup is removed once its last process is reaped)
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.02)


def kill_check(launcher: int, ns: str | None) -> None:
    """End the check: its launcher's group (the namespace's init dies with the launcher, and the
    kernel then kills the whole namespace); the namespace's processes by name, in case."""
    try:
        os.killpg(launcher, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if ns is not None:
        for pid in check_processes(launcher, launcher, ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
