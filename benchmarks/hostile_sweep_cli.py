"""The hostile sweep's command-line round (``hostile_sweep.py --only cli``): ``python -m cactus_cli``
with hostile flags (long drafts, threads, quantization, --remember and --profile files, output to a
FIFO, serve's port, host, queue and key), each expected to exit 0 or with one error line and code 2.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from hostile_sweep_harness import record


def cli_sweep(models: dict[str, str], home: Path) -> None:
    env = dict(os.environ, CACTUS_HOME=str(home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    v, d = models["verifier"], models["draft_close"]
    base = ["generate", "the cat", "--verifier", v, "--draft", d, "--device", "cpu", "--dtype", "float32", "-n", "4",
            "--plain"]  # fmt: skip
    fifo = home / "fifo"
    os.mkfifo(fifo)
    ro = home / "readonly"
    ro.mkdir()
    os.chmod(ro, 0o555)
    garbage = home / "garbage.json"
    garbage.write_bytes(b"\x00\xff{not json")
    cases = [
        ("--max-draft-tokens 0", base + ["-k", "auto", "--max-draft-tokens", "0"], 2),
        ("--max-draft-tokens -1", base + ["-k", "auto", "--max-draft-tokens", "-1"], 2),
        ("--max-draft-tokens 10**6", base + ["-k", "auto", "--max-draft-tokens", "1000000"], 2),
        ("--max-draft-tokens a word", base + ["-k", "auto", "--max-draft-tokens", "many"], 2),
        ("--max-draft-tokens with a fixed k", base + ["-k", "4", "--max-draft-tokens", "8"], 2),
        ("-k 64 on a 512-token model", base + ["-k", "64"], 0),
        ("-k 100000", base + ["-k", "100000"], 2),
        ("-k -1", base + ["-k", "-1"], 2),
        ("--quantize q4_0 on a torch model", base + ["--quantize", "q4_0"], 2),
        ("--quantize nonsense", base + ["--quantize", "q3_x"], 2),
        ("--threads 0", base + ["--threads", "0"], 2),
        ("--threads 10**6", base + ["--threads", "1000000"], (0, 2)),
        ("--remember a directory", base + ["--draft", "suffix", "--remember", str(home)], 2),
        (
            "--remember in a read-only folder (root may write there)",
            base + ["--draft", "suffix", "--remember", str(ro / "m.json")],
            (0, 2),
        ),
        ("--remember a garbage file", base + ["--draft", "suffix", "--remember", str(garbage)], (0, 2)),
        ("--remember a FIFO (a reader on it)", base + ["--draft", "suffix", "--remember", str(fifo)], 0),
        ("--json into a pipe", base[:-1] + ["--json"], 0),
        ("--verifier a missing folder", ["generate", "x", "--verifier", str(home / "none")], 2),
        ("--verifier /dev/null", ["generate", "x", "--verifier", "/dev/null"], 2),
        ("--verifier a garbage .gguf", ["generate", "x", "--verifier", str(garbage.with_suffix(".gguf"))], 2),
        ("--profile a directory", ["generate", "x", "--profile", str(home)], 2),
        ("--profile /dev/zero", ["generate", "x", "--profile", "/dev/zero"], 2),
        (
            "a prompt of invalid UTF-8 on stdin",
            ["generate", "-", "--verifier", v, "--device", "cpu", "-n", "2"],
            (0, 2),
        ),
        ("serve --port 70000", ["serve", "--verifier", v, "--port", "70000"], 2),
        ("serve --port -1", ["serve", "--verifier", v, "--port", "-1"], 2),
        ("serve --max-queue 0", ["serve", "--verifier", v, "--max-queue", "0"], 2),
        ("serve --max-queue -5", ["serve", "--verifier", v, "--max-queue", "-5"], 2),
        ("serve --host not-a-host", ["serve", "--verifier", v, "--host", "no such host!", "--port", "0"], 2),
        ("serve --api-key empty", ["serve", "--verifier", v, "--api-key", "", "--port", "0"], 2),
        ("serve on a port in use", ["serve", "--verifier", v, "--port", "{busy}"], 2),
        (
            "bench --csv to a FIFO (a reader on it)",
            [
                "bench",
                "--verifier",
                v,
                "--draft",
                d,
                "--device",
                "cpu",
                "-k",
                "2",
                "--limit",
                "1",
                "-n",
                "4",
                "--csv",
                str(fifo),
            ],
            0,
        ),  # fmt: skip
        ("bench --out to a file", ["bench", "--out", str(garbage)], 2),
    ]
    (home / "garbage.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    for name, args, want in cases:
        args = [a.replace("{busy}", str(busy.getsockname()[1])) for a in args]
        stdin = b"\xff\xfe the cat\n" if "stdin" in name else b""
        got: list[bytes] = []
        if "FIFO" in name:  # (a FIFO without a reader blocks its writer, as for any Unix tool)
            threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True).start()
        try:
            p = subprocess.run([sys.executable, "-m", "cactus_cli", *args], env=env, input=stdin,
                               capture_output=True, timeout=90)  # fmt: skip
        except subprocess.TimeoutExpired:
            record("cli", name, "hang", "no exit in 90 s")
            continue
        err = p.stderr.decode("utf-8", "replace")
        wants = want if isinstance(want, tuple) else (want,)
        lines = [line for line in err.strip().splitlines() if line.startswith("error")]
        if "Traceback" in err:
            record("cli", name, "traceback", err.strip().splitlines()[-1])
        elif p.returncode not in wants:
            record("cli", name, "wrong", f"exit {p.returncode} (expected {wants}): {err.strip()[-200:]}")
        elif p.returncode == 2 and len(lines) != 1:
            record("cli", name, "wrong", f"not one error line: {err.strip()[-200:]}")
        elif "FIFO" in name and not (time.sleep(0.5) or got and got[0]):
            record("cli", name, "lost", "nothing reached the FIFO's reader")
        else:
            record("cli", name, "fine", f"exit {p.returncode}: {(lines or [''])[0][:140]}")
    busy.close()
