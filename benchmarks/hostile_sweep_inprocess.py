"""The hostile sweep's rounds that call the package in this process: the code sandbox
(``--only sandbox``: model-written code that attacks the machine or the eval), the requantized-model
cache (``--only cache``: damaged, half-written or foreign entries) and long drafts (``--only drafts``:
greedy equality up to 64 drafted tokens and at the context's end).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from hostile_sweep_harness import record

SANDBOX_CASES = [
    ("an endless loop", "while True: pass", "timeout"),
    ("sleeps past the timeout", "import time; time.sleep(60)", "timeout"),
    ("allocates 8 GiB", "x = bytearray(8 << 30)", "failed"),
    (
        "a fork bomb",
        "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
        ("failed", "timeout", "too many processes"),
    ),  # noqa: E501
    ("100 MB of output", "import sys\nfor _ in range(100): sys.stdout.write('x' * (1 << 20))", ("failed", "passed")),
    ("writes a 2 GiB file", "open('big', 'wb').write(b'x' * (2 << 30))", "failed"),
    ("writes /tmp", "open('/tmp/cactus-sweep-owned', 'w').write('x')", "failed"),
    ("writes /dev/shm", "open('/dev/shm/cactus-sweep-owned', 'w').write('x')", "failed"),
    ("writes the home folder", "import os; open(os.path.expanduser('~root') + '/owned', 'w')", "failed"),
    ("reads /etc/shadow", "open('/etc/shadow').read()", "failed"),
    ("reads /root", "import os; os.listdir('/root')", "failed"),
    (
        "finds the eval's environment through /proc/*/environ",
        "import os\nfor p in os.listdir('/proc'):\n    try:\n        assert b'SWEEP_SECRET' not in open(f'/proc/{p}/environ', 'rb').read()\n    except OSError:\n        pass",
        "passed",
    ),  # noqa: E501
    ("sees other processes", "import os; assert len([p for p in os.listdir('/proc') if p.isdigit()]) > 3", "failed"),
    ("connects to 127.0.0.1", "import socket; socket.create_connection(('127.0.0.1', {port}), 2)", "failed"),
    ("connects to ::1", "import socket; socket.create_connection(('::1', {port}), 2)", "failed"),
    ("resolves a host name", "import socket; socket.getaddrinfo('pypi.org', 443)", "failed"),
    ("kill(-1, SIGKILL)", "import os, signal; os.kill(-1, signal.SIGKILL)", ("failed", "exited early")),
    ("setuid(0)", "import os; os.setuid(0); open('/etc/shadow').read()", "failed"),
    (
        "raises its own limits",
        "import resource as r; r.setrlimit(r.RLIMIT_AS, (r.RLIM_INFINITY, r.RLIM_INFINITY))",
        "failed",
    ),  # noqa: E501
    (
        "mounts a tmpfs over /tmp",
        "import ctypes; assert ctypes.CDLL(None).mount(b'x', b'/tmp', b'tmpfs', 0, None) == 0",
        "failed",
    ),  # noqa: E501
    (
        "a symlink out of its folder, then writes",
        "import os; os.symlink('/etc/cron.d/owned', 'l'); open('l', 'w').write('x')",
        "failed",
    ),  # noqa: E501
    ("chroot", "import os; os.chroot('.')", "failed"),
    ("os._exit(0) before the tests", "import os; os._exit(0)", ("failed", "exited early")),
    ("sys.exit(0) before the tests", "import sys; sys.exit(0)", ("failed", "exited early")),
    (
        "closes the result pipe",
        "import os\nfor fd in range(3, 256):\n    try: os.close(fd)\n    except OSError: pass",
        ("failed", "passed"),
    ),  # noqa: E501
    (
        "writes a fake pass on every fd",
        "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'0' * 32)\n    except OSError: pass\nos._exit(0)",
        ("failed", "exited early"),
    ),  # noqa: E501
    (
        "a setsid daemon",
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(300)\n    os._exit(0)",
        "passed",
    ),  # noqa: E501
]


def sandbox_sweep() -> None:
    from cactus_cli.app.eval import sandbox

    if problem := sandbox.isolation_problem():
        record("sandbox", "isolation available", "wrong", problem)
        return
    sandbox.guard_eval_process()
    os.environ["SWEEP_SECRET"] = "1"  # (what a check must not find in any process it can see)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    before = set(os.listdir("/proc"))
    for name, code, want in SANDBOX_CASES:
        program = code.replace("{port}", str(port)) + "\n\ndef check(c):\n    pass\n\ncheck(None)\n"
        t0 = time.monotonic()
        out = sandbox.run_check(program, timeout=5)
        wants = want if isinstance(want, tuple) else (want,)
        escaped = [p for p in ("/tmp/cactus-sweep-owned", "/dev/shm/cactus-sweep-owned", "/root/owned",
                               "/etc/cron.d/owned") if os.path.exists(p)]  # fmt: skip
        if escaped:
            record("sandbox", name, "security", f"wrote {escaped}")
            for p in escaped:
                os.remove(p)
        elif time.monotonic() - t0 > 20:
            record("sandbox", name, "hang", f"{time.monotonic() - t0:.0f} s")
        elif out.status not in wants:
            record("sandbox", name, "security" if out.passed else "wrong", f"{out.status}: {out.output[-160:]!r}")
        else:
            record("sandbox", name, "fine", f"{out.status} in {out.seconds:.1f} s")
    time.sleep(0.5)
    left = [p for p in set(os.listdir("/proc")) - before if p.isdigit() and _is_check(p)]
    record("sandbox", "no process outlives its check", "leak" if left else "fine", f"left: {left}")
    listener.close()


def _is_check(pid: str) -> bool:
    try:
        return (
            "cactus-check" in Path(f"/proc/{pid}/cwd").resolve().as_posix()
            or "sleep" in Path(f"/proc/{pid}/cmdline").read_text()
        )
    except OSError:
        return False


def cache_sweep(tmp: Path) -> None:
    """The requantized-model cache (a tiny GGUF through llama.cpp's own quantizer): what a damaged,
    half-written or foreign cache entry gives the next run."""
    from cactus_cli.infer.backends.llama_cpp.gguf_layout import requantize
    from tests.gguf_helpers import write_tiny_gguf

    src = write_tiny_gguf(tmp / "tiny.gguf", seed=3)
    good = requantize(src, "q4_0", "sweep").read_bytes()
    out = requantize(src, "q4_0", "sweep")
    rec = out.with_name(out.name + ".json")

    def damage_middle():
        with open(out, "r+b") as f:
            f.seek(len(good) // 2)
            f.write(b"\xff" * 64)

    cases = [
        ("truncated", lambda: os.truncate(out, 100)),
        ("damaged in place, size kept", damage_middle),
        ("emptied", lambda: out.write_bytes(b"")),
        ("replaced by a directory", lambda: (out.unlink(), out.mkdir())),
        ("its record deleted", lambda: rec.unlink()),
        ("its record garbage", lambda: rec.write_bytes(b"\x00{")),
        ("its record a JSON list", lambda: rec.write_text("[1, 2]")),
        ("its record names another size", lambda: rec.write_text(json.dumps({"bytes": 5, "sha256": "0"}))),
        (
            "a stale half-written temp file",
            lambda: (out.parent / f".tmp-sweep-q4_0-{2**22 + 7}-x.gguf").write_bytes(b"h"),
        ),  # noqa: E501
        ("touched, unchanged", lambda: os.utime(out, ns=(5, 5))),
    ]
    for name, harm in cases:
        try:
            harm()
            again = requantize(src, "q4_0", "sweep")
            ok = again.is_file() and again.read_bytes() == good
            stale = [p.name for p in out.parent.iterdir() if p.name.startswith(".tmp-")]
            record_ok = json.loads(rec.read_text())["bytes"] == len(good)
            outcome = "fine" if ok and not stale and record_ok else "wrong"
            said = f"same bytes as made: {ok}; temp files left: {stale}"
        except Exception as err:  # noqa: BLE001
            from cactus_cli.core.errors import CactusError

            clear = isinstance(err, CactusError) and "\n" not in str(err)  # (a one-line error, exit 2)
            outcome, said = ("fine" if clear else "traceback"), f"{type(err).__name__}: {err}"
            if out.is_dir():
                out.rmdir()
        record("cache", f"requantized file {name}", outcome, said)


def long_draft_sweep(models: dict[str, str]) -> None:
    """Drafts up to 64 tokens: greedy output equals the verifier alone's, token for token, at every
    k, on a prompt that repeats (so the suffix trees draft long) and at the context's end."""
    from cactus_cli.app.session import Session

    prompt = " ".join(["the cat sat on the mat and the dog ran to the cat"] * 6)
    common = dict(verifier=models["verifier"], device="cpu", dtype="float32", temperature=0.0, seed=0)
    alone = Session.load(draft="none", max_tokens=60, **common)
    want = [t for ev in alone.generate(prompt) for t in ev.emitted]
    for draft, k in (
        ("suffix", 64),
        ("suffix", "auto"),
        (models["draft_close"], 64),
        ("suffix+" + models["draft_close"], 32),
    ):  # noqa: E501
        extra = {"max_draft_tokens": 64} if k == "auto" else {}
        session = Session.load(draft=draft, num_draft_tokens=k, max_tokens=60, **common, **extra)
        got = []
        for _ in range(2):  # (the second time, the suffix trees remember the first answer: long drafts)
            got = [t for ev in session.generate(prompt) for t in ev.emitted]
        longest = max((k for k, n in enumerate(session.stats.k_histogram) if n), default=0)
        record("drafts", f"greedy equality, draft {Path(draft).name} k {k}", "fine" if got == want else "wrong",
               f"{len(got)} tokens, longest draft {longest}")  # fmt: skip
    near_end = Session.load(draft="suffix", num_draft_tokens=64, max_tokens=1000, **common)
    ids = near_end.encode(prompt)
    room = near_end.context_length - len(ids)
    events = list(near_end.generate(prompt))
    n = sum(len(ev.emitted) for ev in events)
    fine = events[-1].finish_reason in ("context", "stop") and n <= room
    record("drafts", "k 64 up to the context's end", "fine" if fine else "wrong",
           f"{n} tokens in {room} positions, finish {events[-1].finish_reason}")  # fmt: skip
