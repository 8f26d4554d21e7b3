"""Running model-written code against its tests, so a wrong, hanging or hostile program is a
failed check and can neither harm the machine nor the eval that runs it.

What a check runs in (Linux; ``isolation_problem`` says when this machine cannot give it):

- **Another user.** Root drops to ``nobody`` first; then a new user namespace maps that uid (or
  an unprivileged caller's own) to root inside it, with every capability dropped once the
  namespace is set up. Outside, every file access is checked as the unprivileged uid: no
  ``/etc/shadow``, no other user's files, no signals to or ptrace of the eval (which also marks
  itself not dumpable: ``PR_SET_DUMPABLE`` 0).
- **Its own PID, network, mount, IPC and UTS namespaces.** The check's first process is PID 1 of
  a namespace that holds only its own processes (``/proc`` shows nothing else, a parent pid is
  0); when it ends, or the eval ends it, the kernel kills everything left in the namespace, a
  double-forked ``setsid`` daemon included. The network namespace has only a loopback that is
  down: no connection anywhere, 127.0.0.1 included.
- **One writable folder.** Landlock lets the check create, write, rename or remove files only
  in its own empty temporary folder (removed afterwards), and read only Python, the system's
  programs, libraries and /etc (``read_roots``): not /home, /root, /tmp or the eval's files.
- **Limits.** CPU seconds, address space, file size and core dumps by ``resource``; processes
  counted in the namespace by a watchdog that kills the namespace past MAX_PROCESSES (and a
  cgroup ``pids.max`` where the eval may make one); a wall-clock timeout; output kept up to
  OUTPUT_BYTES (the rest read and dropped). ``python -I`` with an environment of its own.
- **The verdict.** A check passes only if ``check(entry_point)`` returned: the launcher writes a
  random token, read from a pipe at start and never written into the program file, to a second
  pipe afterwards; ``sys.exit(0)`` or ``os._exit(0)`` in the model's code is a failure.

What it does not promise: code in the checked process can always lie about its own result (it
runs where the token lives); the isolation is what protects the machine and the eval. With
``--unsafe-exec`` (where namespaces or Landlock are missing: some containers, macOS) only the
process group, the limits, the timeout and the empty folder remain (docs/eval.md).
"""

from __future__ import annotations

import ctypes
import functools
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cactus_cli.app.eval.check_processes import PidsCgroup, check_processes, hold_namespace, kill_check

TIMEOUT_SECONDS = 10.0
MEMORY_BYTES = 1 << 30  # address space per check
FILE_BYTES = 16 << 20  # largest file a check may write
MAX_PROCESSES = 32  # processes a check may hold
OUTPUT_BYTES = 16 << 10  # of stdout + stderr kept for the report
NOBODY = 65534  # the uid and gid root drops to before it isolates a check

# The launcher, run as ``python -I -c``: reads the token, isolates itself (``isolate``), sets the
# limits, runs check.py and only then writes the token. Nothing of it is in the program's file.
_BOOT = r"""
import ctypes, os, resource, runpy, signal, sys
_t = os.read({token_fd}, 64)
os.close({token_fd})
if {isolate}:
    _libc = ctypes.CDLL(None, use_errno=True)
    def _fail(what):
        os.write(2, ("sandbox: " + what + ": " + os.strerror(ctypes.get_errno()) + "\n").encode())
        os._exit(112)
    if os.getuid() == 0:
        # Python may live where nobody cannot reach it (a pyenv under /root): in a mount namespace of
        # its own, each folder that bars others gets an empty tmpfs over it, and the read roots under
        # it come back at their own paths (open_tree / move_mount), so nobody reads them and no more.
        if _libc.unshare(0x00020000) != 0 or _libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0:
            _fail("a mount namespace")
        _barred, _back = set(), []
        for _root in [os.getcwd()] + {read_roots!r}:
            _at = "/"
            for _part in _root.strip("/").split("/"):
                _at = os.path.join(_at, _part)
                try:
                    _st = os.stat(_at)
                except OSError:
                    break
                if _st.st_mode & 0o170000 == 0o040000 and not _st.st_mode & 0o001 and _st.st_uid != {nobody}:
                    _barred.add(_at)
                    _back.append(_root)
                    break
        _trees = []
        for _root in dict.fromkeys(_back):
            _fd = _libc.syscall(428, -100, _root.encode(), 1 | 0x8000 | 0o2000000)  # open_tree: a detached copy
            if _fd < 0:
                _fail("open_tree " + _root)
            _trees.append((_root, _fd))
        for _at in sorted(_barred, key=len):
            if _libc.mount(b"tmpfs", _at.encode(), b"tmpfs", 0x2 | 0x4, b"mode=755") != 0:
                _fail("tmpfs over " + _at)
        for _root, _fd in _trees:
            os.makedirs(_root, exist_ok=True)
            if _libc.syscall(429, _fd, b"", -100, _root.encode(), 0x4) != 0:  # move_mount, F_EMPTY_PATH
                _fail("move_mount " + _root)
            os.close(_fd)
        os.setgroups([])
        os.setgid({nobody})
        os.setuid({nobody})
        _libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: a changed uid is not dumpable, and /proc/self is then root's
    _uid, _gid = os.getuid(), os.getgid()
    if _libc.unshare(0x10000000 | 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000) != 0:
        _fail("unshare")  # (user, mount, pid, net, ipc, uts)
    for _f, _v in (("setgroups", "deny"), ("uid_map", "0 %d 1" % _uid), ("gid_map", "0 %d 1" % _gid)):
        with open("/proc/self/" + _f, "w") as _h:
            _h.write(_v)
    _pid = os.fork()
    if _pid:  # outside the new PID namespace: wait for its init, exit as it did
        signal.signal(signal.SIGTERM, lambda *a: os._exit(113))
        while True:
            try:
                _status = os.waitpid(_pid, 0)[1]
                break
            except InterruptedError:
                continue
        os._exit(os.waitstatus_to_exitcode(_status) if os.WIFEXITED(_status) else 114)
    _libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: the namespace dies with the launcher
    if _libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0:  # MS_REC | MS_PRIVATE
        _fail("mount --make-rprivate /")
    if _libc.mount(b"proc", b"/proc", b"proc", 0x2 | 0x4 | 0x8, None) != 0:  # nosuid, nodev, noexec
        _fail("mount /proc")
    _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    _abi = _libc.syscall(444, None, 0, 1)
    if _abi < 1:
        _fail("landlock")
    _read = 0x1 | 0x4 | 0x8  # execute, read a file, read a folder
    _write = 0x2 | 0x10 | 0x20 | 0x40 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800 | 0x1000
    _write |= (0x2000 if _abi >= 2 else 0) | (0x4000 if _abi >= 3 else 0) | (0x8000 if _abi >= 5 else 0)
    _attr = (ctypes.c_uint64 * 3)(_read | _write, 0x3 if _abi >= 4 else 0, 0x3 if _abi >= 6 else 0)
    _ruleset = _libc.syscall(444, ctypes.byref(_attr), 8 * (3 if _abi >= 6 else 2 if _abi >= 4 else 1), 0)
    if _ruleset < 0:
        _fail("landlock_create_ruleset")
    class _Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]
    _file = 0x1 | 0x2 | 0x4 | (0x4000 if _abi >= 3 else 0)  # what a rule on a file (not a folder) may grant
    for _path, _access in [(".", _read | _write), ("/dev/null", 0x2 | 0x4)] + [(_p, _read) for _p in {read_roots!r}]:
        try:
            _fd = os.open(_path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        if not os.path.isdir(_path):
            _access &= _file
        if _libc.syscall(445, _ruleset, 1, ctypes.byref(_Beneath(_access, _fd)), 0) != 0:
            _fail("landlock_add_rule " + _path)
        os.close(_fd)
    if _libc.syscall(446, _ruleset, 0) != 0:
        _fail("landlock_restrict_self")
    os.close(_ruleset)
    class _Cap(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    _data = (ctypes.c_uint32 * 6)()
    for _c in range(64):  # every capability out of the bounding set, then the sets themselves
        _libc.prctl(24, _c, 0, 0, 0)
    if _libc.capset(ctypes.byref(_Cap(0x20080522, 0)), _data) != 0:
        _fail("capset")
    del _libc, _Beneath, _Cap, _data, _attr, _fd, _path, _access
for _limit, _value in {limits!r}:
    try:
        resource.setrlimit(getattr(resource, _limit), (_value, _value))
    except (ValueError, OSError):
        pass
runpy.run_path("check.py", run_name="__main__")
os.write({result_fd}, _t)
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


def read_roots() -> list[str]:
    """What a check may read besides its folder: Python (this environment's and the one it was
    made from), the system's programs, libraries and configuration, its own /proc. Not /home,
    /root, /tmp or anything else of the users'."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots |= {os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(roots | {"/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/dev/urandom"})


def _drain(stream, keep: bytearray) -> None:
    while chunk := stream.read(65536):
        if len(keep) < OUTPUT_BYTES:
            keep += chunk[: OUTPUT_BYTES - len(keep)]


def _launch(work: Path, token_fd: int, result_fd: int, isolate: bool, timeout: float) -> tuple[dict, str]:
    """The environment and the bootstrap program of one check."""
    env = {
        "PATH": os.defpath,
        "LANG": "C.UTF-8",
        "HOME": str(work),
        "TMPDIR": str(work),
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    boot = _BOOT.format(
        token_fd=token_fd,
        result_fd=result_fd,
        isolate=isolate,
        nobody=NOBODY,
        limits=_limits(timeout),
        read_roots=read_roots(),
    )
    return env, boot


def _watch(proc: subprocess.Popen, t0: float, timeout: float, isolate: bool, held: list[tuple[int, str]]) -> str | None:
    """Wait for a check; stop at its timeout or its process limit. Returns why it was stopped
    or None; its PID namespace, once seen, is appended to ``held`` (the caller closes it)."""
    while proc.poll() is None:
        if isolate and not held and (ns := hold_namespace(proc.pid)) is not None:
            held.append(ns)
        name = held[0][1] if held else None
        if time.monotonic() - t0 > timeout:
            return "timeout"
        if len(check_processes(proc.pid, proc.pid, name)) + (name is not None) >= MAX_PROCESSES:  # (+ the launcher)
            return "too many processes"
        time.sleep(0.05)
    return None


def run_check(program: str, timeout: float | None = None, isolate: bool = True) -> Outcome:
    """Run ``program`` (the model's code, then the task's tests) and say whether it passed
    (``timeout``: seconds of wall clock, TIMEOUT_SECONDS by default). ``isolate=False``
    (``--unsafe-exec``) runs it with the limits, the timeout and an empty folder only."""
    timeout = TIMEOUT_SECONDS if timeout is None else timeout
    work = Path(tempfile.mkdtemp(prefix="cactus-check-"))
    token = secrets.token_hex(16).encode()
    token_read, token_write = os.pipe()
    result_read, result_write = os.pipe()
    cgroup = PidsCgroup(MAX_PROCESSES + 1) if isolate else None
    held: list[tuple[int, str]] = []  # the check's PID namespace, held open until it is swept
    t0 = time.monotonic()
    try:
        (work / "check.py").write_text(program, encoding="utf-8")
        if isolate and os.getuid() == 0:
            os.chown(work, NOBODY, NOBODY)  # the one place the check may write
            os.chown(work / "check.py", NOBODY, NOBODY)
        os.write(token_write, token)
        os.close(token_write)
        token_write = -1
        env, boot = _launch(work, token_read, result_write, isolate, timeout)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", boot],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(token_read, result_write),
            start_new_session=True,
        )
        if cgroup is not None:
            cgroup.add(proc.pid)
        for fd in (token_read, result_write):
            os.close(fd)
        token_read = result_write = -1
        kept = bytearray()
        reader = threading.Thread(target=_drain, args=(proc.stdout, kept), daemon=True)
        reader.start()
        status = _watch(proc, t0, timeout, isolate, held)
        kill_check(proc.pid, held[0][1] if held else None)
        proc.wait()
        reader.join(timeout=2)
        ran_to_end = _read_all(result_read) == token
        if status is None:
            status = (
                "passed"
                if proc.returncode == 0 and ran_to_end
                else ("exited early" if proc.returncode == 0 else "failed")
            )
        return Outcome(status == "passed", status, kept.decode("utf-8", "replace"), time.monotonic() - t0)
    finally:
        for fd in (token_read, token_write, result_read, result_write, *(fd for fd, _ in held)):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(work, ignore_errors=True)


def _read_all(fd: int) -> bytes:
    """What the launcher wrote (the pipe's write end is closed once every process is gone)."""
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


@functools.cache
def isolation_problem() -> str | None:
    """None when this machine can isolate a check as the module docstring says, else why not
    (one line): it runs one trivial check, isolated, once per process."""
    if sys.platform != "linux":
        return f"isolating model-written code needs Linux namespaces and Landlock ({sys.platform} has neither)"
    probe = run_check("pass\n", timeout=20.0)
    if probe.passed:
        return None
    why = next((line for line in probe.output.splitlines() if line.startswith("sandbox: ")), probe.status)
    return f"this machine cannot isolate model-written code ({why.removeprefix('sandbox: ')})"


def guard_eval_process() -> None:
    """The eval process itself: not dumpable, so nothing of its memory can be traced or read."""
    try:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    except (OSError, AttributeError):
        pass


def run_checks(
    programs: list[str], workers: int | None = None, timeout: float | None = None, isolate: bool = True
) -> list[Outcome]:
    """Many checks, in parallel where there are cores (each in its own namespaces)."""
    if not programs:
        return []
    if isolate:
        guard_eval_process()
    workers = workers or max(
        1,
        min(len(programs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)),
    )
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: run_check(p, timeout, isolate), programs))
