"""What every round of the hostile sweep shares: the outcomes it records (``Case``, ``RESULTS``,
``record``), the tiny test pair, and a server under test (``serve`` on a free port of 127.0.0.1,
``Errors`` to catch what it logs, ``_raw`` for requests whose headers lie, ``one_line_error`` for an
error answer's shape). Also puts the checkout on ``sys.path`` (``cactus_cli``, ``tests``) and picks
httpx. The rounds import these from here; sweep_fifth and sweep_sixth reach them through the
``hostile_sweep`` module they are handed or import (``hs.record``).
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

try:
    import httpx
except ImportError:  # (newer openai releases ship httpx2)
    import httpx2 as httpx


@dataclass
class Case:
    surface: str
    name: str
    outcome: str
    detail: str = ""


RESULTS: list[Case] = []


def record(surface: str, name: str, outcome: str, detail: str = "") -> None:
    RESULTS.append(Case(surface, name, outcome, detail[:300]))
    mark = "ok " if outcome == "fine" else "!! "
    print(f"{mark}{surface:8} {outcome:9} {name}  {detail[:160]}", flush=True)


def tiny_models(root: Path) -> dict[str, str]:
    from tests.conftest import SPECIALS, WORDS, make_model, make_tokenizer

    vocab = len(SPECIALS) + len(WORDS)
    out = {}
    for name, seed, noise in (("verifier", 0, 0.0), ("draft_close", 0, 0.03)):
        make_model(root / name, "llama", seed, vocab, noise=noise)
        make_tokenizer(root / name)
        out[name] = str(root / name)
    return out


def serve(server, api_key: str | None = None):
    """``server`` behind the app on a free port of 127.0.0.1, in a thread: (server, url, stop)."""
    import uvicorn

    from cactus_cli.app.serve.http_api import build_app

    config = uvicorn.Config(build_app(server, api_key), host="127.0.0.1", port=0, log_level="error")
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{http.servers[0].sockets[0].getsockname()[1]}"

    def stop():
        http.should_exit = True
        thread.join(10)
        server.stop()

    return server, url, stop


class Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(self.format(record)[:300])


def _raw(url: str, method: str, path: str, body, headers: dict, timeout: float = 30.0):
    """One request over a plain socket when headers must lie; httpx otherwise."""
    if "content-length" in headers:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=3) as s:
            head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "Connection: close\r\n\r\n"
            s.sendall(head.encode() + body)
            data = b""
            try:
                while chunk := s.recv(65536):
                    data += chunk
            except TimeoutError:  # (the server waits for the body it was promised: only this connection)
                return 0, ""
        status = int(data.split(b" ", 2)[1])
        return status, data.split(b"\r\n\r\n", 1)[-1].decode("utf-8", "replace")
    kw: dict = {"headers": headers, "timeout": timeout}
    if isinstance(body, (bytes, bytearray)):
        kw["content"] = body
        kw["headers"] = {"content-type": "application/json", **headers}
    elif body is not None:
        kw["json"] = body
    r = httpx.request(method, url + path, **kw)
    return r.status_code, r.text


def one_line_error(status: int, text: str) -> str | None:
    """What is wrong with an error answer, if anything (OpenAI's shape, one line, a field). A
    request that is not HTTP never reaches the app: uvicorn's plain 400 is its answer."""
    if status < 400 or text == "Invalid HTTP request received.":
        return None
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"not OpenAI's error shape: {text[:120]!r}"
    msg = err.get("message", "")
    if not msg or "\n" in msg or len(msg) > 400 or "Traceback" in msg:
        return f"message not one clear line: {msg[:160]!r}"
    return None
