"""Hostile inputs against the new surface, each case classified: the server (a real uvicorn on
127.0.0.1 with the tiny test pair), the command line (long drafts, caches, output files, serve's
flags) and the code sandbox (model-written code that attacks the machine or the eval).

    python benchmarks/hostile_sweep.py                 # every case, a table at the end
    python benchmarks/hostile_sweep.py --only server   # server | cli | sandbox
    python benchmarks/hostile_sweep.py --json out.json

Outcomes: fine (the answer a user should get: a 4xx in OpenAI's shape naming the problem, a
one-line error with exit code 2, a refused attack), traceback (a 500, an exception in the log, a
Python traceback on stderr), hang (no answer within the case's time), wrong (accepted what should
be refused, or refused what should be accepted), lost (the server stopped answering, or answered
the canary differently afterwards), leak (threads or file descriptors left behind), security (an
attack that got through). Light: tiny models, a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
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


# ---------------------------------------------------------------------------------------- server

P = "the cat sat on the mat and the dog"


def chat(**kw):
    return {"messages": [{"role": "user", "content": P}], "max_tokens": 4, **kw}


def comp(**kw):
    return {"prompt": P, "max_tokens": 4, **kw}


C, X = "/v1/completions", "/v1/chat/completions"
BAD = (400,)
OK = (200,)
# (name, method, path, json body or raw bytes, headers, accepted statuses)
SERVER_CASES: list[tuple] = [
    ("body not JSON", "POST", C, b"{not json", {}, BAD),
    ("body a JSON array", "POST", C, b"[1, 2]", {}, BAD),
    ("body a JSON string", "POST", C, b'"hello"', {}, BAD),
    ("body empty", "POST", C, b"", {}, BAD),
    ("body JSON null", "POST", C, b"null", {}, BAD),
    ("invalid UTF-8 in the body", "POST", C, b'{"prompt": "\xff\xfe", "max_tokens": 2}', {}, BAD),
    ("a lone surrogate in a string", "POST", C, b'{"prompt": "a \\ud800 b", "max_tokens": 2}', {}, (200, 400)),
    ("NUL characters in the prompt", "POST", C, comp(prompt="the \u0000 cat \u0000"), {}, OK),
    ("emoji and RTL text in the prompt", "POST", C, comp(prompt="the 🐈 قطة cat"), {}, OK),
    ("deeply nested JSON", "POST", C, b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", {}, BAD),
    ("duplicate keys", "POST", C, b'{"prompt": "a", "prompt": "the cat", "max_tokens": 2}', {}, (200, 400)),
    (
        "text/plain content type",
        "POST",
        C,
        json.dumps(comp()).encode(),
        {"content-type": "text/plain"},
        (200, 400, 415),
    ),
    ("messages missing", "POST", X, {"max_tokens": 2}, {}, BAD),
    ("messages empty", "POST", X, {"messages": [], "max_tokens": 2}, {}, BAD),
    ("messages a string", "POST", X, {"messages": "hi", "max_tokens": 2}, {}, BAD),
    ("a message without a role", "POST", X, {"messages": [{"content": "hi"}]}, {}, BAD),
    ("role tool", "POST", X, {"messages": [{"role": "tool", "content": "x"}]}, {}, BAD),
    ("content null", "POST", X, {"messages": [{"role": "user", "content": None}]}, {}, BAD),
    ("content an integer", "POST", X, {"messages": [{"role": "user", "content": 5}]}, {}, BAD),
    (
        "content text parts",
        "POST",
        X,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": P}]}], "max_tokens": 2},
        {},
        OK,
    ),  # noqa: E501
    (
        "content an image part",
        "POST",
        X,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {},
        BAD,
    ),  # noqa: E501
    ("content parts not objects", "POST", X, {"messages": [{"role": "user", "content": ["hi"]}]}, {}, BAD),
    ("a text part without text", "POST", X, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, {}, BAD),
    (
        "only a system message",
        "POST",
        X,
        {"messages": [{"role": "system", "content": "be brief"}], "max_tokens": 2},
        {},
        OK,
    ),  # noqa: E501
    (
        "an assistant message last",
        "POST",
        X,
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the"}], "max_tokens": 2},
        {},
        OK,
    ),  # noqa: E501
    # (a key clients add inside a message, e.g. litellm's provider_specific_fields, is let through)
    ("a message with an unknown key", "POST", X, {"messages": [{"role": "user", "content": "hi", "x": 1}]}, {}, OK),
    ("prompt missing", "POST", C, {"max_tokens": 2}, {}, BAD),
    ("prompt empty", "POST", C, comp(prompt=""), {}, BAD),
    ("prompt a list of strings (a batch)", "POST", C, comp(prompt=["a", "b"]), {}, BAD),
    ("prompt token ids past the vocabulary", "POST", C, comp(prompt=[1, 2, 10**6]), {}, BAD),
    ("prompt negative token ids", "POST", C, comp(prompt=[5, -1]), {}, BAD),
    ("prompt nested token lists", "POST", C, comp(prompt=[[5, 6]]), {}, BAD),
    ("prompt token ids as floats", "POST", C, comp(prompt=[5.5, 6.0]), {}, BAD),
    ("prompt an object", "POST", C, comp(prompt={"a": 1}), {}, BAD),
    ("prompt longer than the context", "POST", C, comp(prompt="the " * 3000), {}, BAD),
    ("max_tokens 0", "POST", C, comp(max_tokens=0), {}, BAD),
    ("max_tokens negative", "POST", C, comp(max_tokens=-5), {}, BAD),
    ("max_tokens a numeric string", "POST", C, comp(max_tokens="3"), {}, (200, 400)),
    ("max_tokens a word", "POST", C, comp(max_tokens="many"), {}, BAD),
    ("max_tokens 2.5", "POST", C, comp(max_tokens=2.5), {}, BAD),
    ("max_tokens true", "POST", C, comp(max_tokens=True), {}, BAD),
    ("max_tokens 10**12", "POST", C, comp(max_tokens=10**12), {}, BAD),
    ("max_tokens 2**70", "POST", C, comp(max_tokens=2**70), {}, BAD),
    ("max_tokens and max_completion_tokens differ", "POST", C, comp(max_tokens=9, max_completion_tokens=3), {}, OK),
    ("temperature negative", "POST", C, comp(temperature=-1), {}, BAD),
    ("temperature NaN", "POST", C, b'{"prompt": "the cat", "temperature": NaN}', {}, BAD),
    ("temperature Infinity", "POST", C, b'{"prompt": "the cat", "temperature": Infinity}', {}, BAD),
    ("temperature 1e308", "POST", C, comp(temperature=1e308), {}, BAD),
    ("temperature a word", "POST", C, comp(temperature="hot"), {}, BAD),
    ("temperature 1e-30", "POST", C, comp(temperature=1e-30), {}, (200, 400)),
    ("top_p 0", "POST", C, comp(top_p=0), {}, BAD),
    ("top_p 1.5", "POST", C, comp(top_p=1.5), {}, BAD),
    ("top_p NaN", "POST", C, b'{"prompt": "the cat", "top_p": NaN}', {}, BAD),
    ("top_k -1", "POST", C, comp(top_k=-1), {}, BAD),
    ("top_k 10**9", "POST", C, comp(top_k=10**9, temperature=0.7), {}, (200, 400)),
    ("stop a string", "POST", C, comp(stop="cat"), {}, OK),
    ("stop five strings", "POST", C, comp(stop=["a", "b", "c", "d", "e"]), {}, BAD),
    ("stop an empty string", "POST", C, comp(stop=[""]), {}, BAD),
    ("stop a number", "POST", C, comp(stop=[5]), {}, BAD),
    ("stop 10k characters", "POST", C, comp(stop=["x" * 10000]), {}, (200, 400)),
    ("stop that matches at once", "POST", C, comp(stop=[" "], max_tokens=8), {}, OK),
    ("seed negative", "POST", C, comp(seed=-3, temperature=0.8), {}, (200, 400)),
    ("seed 2**70", "POST", C, comp(seed=2**70, temperature=0.8), {}, (200, 400)),
    ("seed a word", "POST", C, comp(seed="x"), {}, BAD),
    ("stream a word", "POST", C, comp(stream="yes"), {}, BAD),
    ("stream_options without stream", "POST", C, comp(stream_options={"include_usage": True}), {}, (200, 400)),
    ("stream_options unknown key", "POST", C, comp(stream=True, stream_options={"x": 1}), {}, BAD),
    ("n 2", "POST", C, comp(n=2), {}, BAD),
    ("n 0", "POST", C, comp(n=0), {}, BAD),
    ("logprobs true", "POST", X, chat(logprobs=True, top_logprobs=3), {}, OK),
    ("top_logprobs without logprobs", "POST", X, chat(top_logprobs=3), {}, BAD),
    ("top_logprobs 21", "POST", X, chat(logprobs=True, top_logprobs=21), {}, BAD),
    ("logprobs 1000 on completions", "POST", C, comp(logprobs=1000), {}, BAD),
    # (a tool: 200 where the model's template has a tools section, else a 400 naming tools)
    ("tools", "POST", X, chat(tools=[{"type": "function", "function": {"name": "f"}}]), {}, (200, 400)),
    ("tools malformed", "POST", X, chat(tools=[{"type": "function", "function": {"name": 5}}]), {}, BAD),
    ("tools not a list", "POST", X, chat(tools={"f": 1}), {}, BAD),
    (
        "tool_choice naming no declared tool",
        "POST",
        X,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        {},
        BAD,
    ),
    (
        "a tool message without its call",
        "POST",
        X,
        {"messages": [{"role": "user", "content": P}, {"role": "tool", "tool_call_id": "x", "content": "r"}]},
        {},
        BAD,
    ),
    ("tools on completions", "POST", C, comp(tools=[{"type": "function", "function": {"name": "f"}}]), {}, BAD),
    # (JSON output on a word-level vocabulary that has no "{": refused, naming why)
    (
        "response_format on a vocabulary that cannot write JSON",
        "POST",
        X,
        chat(response_format={"type": "json_object"}),
        {},
        BAD,
    ),
    ("presence_penalty", "POST", X, chat(presence_penalty=1.0), {}, BAD),
    ("logit_bias", "POST", X, chat(logit_bias={"5": 100}), {}, BAD),
    ("an unknown field", "POST", X, chat(foo=1), {}, BAD),
    ("rule unknown", "POST", C, comp(rule="bogus"), {}, BAD),
    ("rule a number", "POST", C, comp(rule=5), {}, BAD),
    ("delta with rule sps", "POST", C, comp(rule="sps", delta=1.0), {}, BAD),
    ("delta negative", "POST", C, comp(rule="cactus", delta=-1), {}, BAD),
    ("delta NaN", "POST", C, b'{"prompt": "the cat", "rule": "cactus", "delta": NaN}', {}, BAD),
    ("delta 1e300", "POST", C, comp(rule="cactus", delta=1e300), {}, BAD),
    ("num_draft_tokens 0", "POST", C, comp(num_draft_tokens=0), {}, (200, 400)),
    ("num_draft_tokens -3", "POST", C, comp(num_draft_tokens=-3), {}, BAD),
    ("num_draft_tokens 10**6", "POST", C, comp(num_draft_tokens=10**6), {}, BAD),
    ("num_draft_tokens a word", "POST", C, comp(num_draft_tokens="fast"), {}, BAD),
    ("num_draft_tokens auto", "POST", C, comp(num_draft_tokens="auto"), {}, OK),
    ("draft another model", "POST", C, comp(draft="gpt2"), {}, BAD),
    ("draft none", "POST", C, comp(draft="none"), {}, OK),
    ("draft suffix (not loaded)", "POST", C, comp(draft="suffix"), {}, (200, 400)),
    ("model wrong", "POST", C, comp(model="gpt-4"), {}, (404,)),
    ("model empty string", "POST", C, comp(model=""), {}, (200, 404)),
    ("GET on a POST route", "GET", C, None, {}, (405,)),
    ("an unknown path", "GET", "/v1/nothing", None, {}, (404,)),
    ("path traversal", "GET", "/../../etc/passwd", None, {}, (404,)),
    ("HEAD /health", "HEAD", "/health", None, {}, (200, 405)),
    ("OPTIONS on a route", "OPTIONS", C, None, {}, (200, 405)),
    (
        "Content-Length not a number (uvicorn refuses the HTTP)",
        "POST",
        C,
        json.dumps(comp()).encode(),
        {"content-length": "abc"},
        (400,),
    ),  # noqa: E501
    (
        "Content-Length larger than the body",
        "POST",
        C,
        json.dumps(comp()).encode(),
        {"content-length": "999"},
        (400, 408, 0),
    ),  # noqa: E501
    ("a body of 9 MiB", "POST", C, b'{"prompt": "' + b"a" * (9 << 20) + b'"}', {}, (413,)),
    ("a 1 MiB prompt (under the limit)", "POST", C, comp(prompt="the " * (1 << 18)), {}, BAD),
]


def start_server(models: dict[str, str], api_key: str | None = None, max_queue: int = 4):
    from cactus_cli.app.serve.serving import Server
    from cactus_cli.app.session import Session

    session = Session.load(
        verifier=models["verifier"], draft=models["draft_close"], device="cpu", dtype="float32",
        num_draft_tokens=3, max_tokens=16, temperature=0.0, seed=0,
    )  # fmt: skip
    return serve(Server(session, max_queue=max_queue), api_key)


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


def server_sweep(models: dict[str, str]) -> None:
    errors = Errors()
    for name in ("uvicorn.error", "uvicorn", "fastapi", ""):
        logging.getLogger(name).addHandler(errors)
    server, url, stop = start_server(models)
    canary = comp(max_tokens=8, temperature=0)
    base = httpx.post(url + C, json=canary, timeout=30).json()["choices"][0]["text"]
    try:
        for name, method, path, body, headers, accept in SERVER_CASES:
            seen = len(errors.records)
            try:
                status, text = _raw(url, method, path, body, headers)
            except httpx.TimeoutException:
                record("server", name, "hang", "no answer in 30 s")
                continue
            except Exception as err:  # noqa: BLE001
                record("server", name, "lost", f"{type(err).__name__}: {err}")
                continue
            logged = errors.records[seen:]
            try:
                after = httpx.post(url + C, json=canary, timeout=30).json()["choices"][0]["text"]
            except Exception as err:  # noqa: BLE001
                record("server", name, "lost", f"canary after it: {type(err).__name__}: {err}")
                server, url, stop = start_server(models)
                continue
            if status >= 500 or logged:
                record("server", name, "traceback", f"{status} {text[:120]} {logged[:1]}")
            elif after != base:
                record("server", name, "lost", f"the canary's answer changed: {after!r} vs {base!r}")
            elif status not in accept:
                record("server", name, "wrong", f"{status} (expected {accept}) {text[:150]}")
            elif method != "HEAD" and (problem := one_line_error(status, text)):
                record("server", name, "wrong", problem)
            else:
                record("server", name, "fine", f"{status} {text[:100]}")
        concurrency(url, models, errors)
        disconnects(url, server)
        time.sleep(1.0)  # (the first rounds fill the executor's thread pool: bounded, kept for reuse)
        threads0, fds0 = _threads(), len(os.listdir("/proc/self/fd"))
        for name, method, path, body, headers, _ in SERVER_CASES:  # a second round of everything
            try:
                _raw(url, method, path, body, headers)
            except Exception:  # noqa: BLE001 (counted above)
                pass
        concurrency(url, models, errors)
        disconnects(url, server)
        time.sleep(1.0)
        threads1, fds1 = _threads(), len(os.listdir("/proc/self/fd"))
        pool_max = min(32, (os.cpu_count() or 1) + 4)  # (asyncio's default executor: grows to this, then reuses)
        record(
            "server",
            f"threads and fds: a second round of the {len(SERVER_CASES)} cases, the burst and the disconnects",
            "fine" if threads1[0] <= threads0[0] and threads1[1] <= pool_max and fds1 <= fds0 + 2 else "leak",
            f"threads (others, executor pool) {threads0}->{threads1}, fds {fds0}->{fds1}",
        )
        api_keys(models)
    finally:
        stop()


def _threads() -> tuple[int, int]:
    """Threads other than asyncio's executor pool, and the pool's."""
    names = [t.name for t in threading.enumerate()]
    pool = sum(n.startswith("asyncio_") for n in names)
    return len(names) - pool, pool


def concurrency(url: str, models, errors: Errors) -> None:
    """30 requests at once against a queue of 4: each gets 200 or 503, none is lost."""
    statuses: list[int] = []

    def go(i):
        try:
            statuses.append(httpx.post(url + C, json=comp(max_tokens=6, seed=i), timeout=120).status_code)
        except Exception as err:  # noqa: BLE001
            statuses.append(-1)
            errors.records.append(repr(err))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    ok = all(s in (200, 503) for s in statuses) and len(statuses) == 30 and 200 in statuses
    record("server", "30 requests at once, queue of 4", "fine" if ok else "lost", f"{sorted(statuses)}")


def disconnects(url: str, server) -> None:
    """20 streams dropped after their first chunk, then 5 whole requests dropped by a short
    client timeout: no generation is left running and the server answers at once afterwards."""
    body = comp(max_tokens=200, temperature=0.9, stream=True)
    for _ in range(20):
        with httpx.stream("POST", url + C, json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
    for _ in range(5):
        try:
            httpx.post(url + C, json=comp(max_tokens=200, temperature=0.9), timeout=0.05)
        except httpx.TimeoutException:
            pass
    deadline = time.monotonic() + 20
    while (server.running or server.queue.qsize()) and time.monotonic() < deadline:  # (running: the slots' requests)
        time.sleep(0.05)
    idle = not server.running and server.queue.qsize() == 0
    record("server", "20 dropped streams and 5 dropped whole requests", "fine" if idle else "leak",
           f"running={len(server.running)} waiting={server.queue.qsize()}")  # fmt: skip


def api_keys(models) -> None:
    server, url, stop = start_server(models, api_key="s3cret")
    try:
        for name, headers, want in (
            ("no Authorization header", {}, 401),
            ("Basic instead of Bearer", {"Authorization": "Basic s3cret"}, 401),
            ("the key without Bearer", {"Authorization": "s3cret"}, 401),
            ("a prefix of the key", {"Authorization": "Bearer s3cre"}, 401),
            ("the key and more", {"Authorization": "Bearer s3cretX"}, 401),
            ("a non-ASCII key", {"Authorization": "Bearer s3cr\u00e9t".encode()}, 401),
            ("lower-case bearer", {"Authorization": "bearer s3cret"}, (200, 401)),
            ("the right key", {"Authorization": "Bearer s3cret"}, 200),
            ("/metrics without the key", {}, 401),
        ):
            path = "/metrics" if "metrics" in name else C
            try:
                r = httpx.request("GET" if path == "/metrics" else "POST", url + path, json=comp() if path == C else None,
                                  headers=headers, timeout=30)  # fmt: skip
                status = r.status_code
            except Exception as err:  # noqa: BLE001
                record("server", f"api key: {name}", "traceback", repr(err))
                continue
            wants = want if isinstance(want, tuple) else (want,)
            outcome = "fine" if status in wants else ("security" if status == 200 else "wrong")
            record("server", f"api key: {name}", outcome, str(status))
    finally:
        stop()


# ------------------------------------------------------------------------------------------- cli


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


# --------------------------------------------------------------------------------------- sandbox

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


# ------------------------------------------------------------------------ caches and long drafts


def cache_sweep(tmp: Path) -> None:
    """The requantized-model cache (a tiny GGUF through llama.cpp's own quantizer): what a damaged,
    half-written or foreign cache entry gives the next run."""
    from cactus_cli.infer.load.gguf_layout import requantize
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("server", "cli", "sandbox", "cache", "drafts", "fifth"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cactus-sweep-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        os.environ["CACTUS_HOME"] = str(home)
        os.environ["HF_HUB_OFFLINE"] = "1"
        models = tiny_models(Path(tmp)) if a.only not in ("sandbox", "cache", "fifth") else {}
        if a.only in (None, "server"):
            server_sweep(models)
        if a.only in (None, "cli"):
            cli_sweep(models, home)
        if a.only in (None, "sandbox"):
            sandbox_sweep()
        if a.only in (None, "cache"):
            cache_sweep(Path(tmp))
        if a.only in (None, "drafts"):
            long_draft_sweep(models)
        if a.only in (None, "fifth"):  # (the fifth round: slots, tools, JSON output, logprobs, remeasure)
            import sweep_fifth

            sweep_fifth.run(sys.modules[__name__], Path(tmp))
    kinds = ("fine", "traceback", "hang", "wrong", "lost", "leak", "security")
    print(f"\n| surface | cases | {' | '.join(kinds)} |\n|---|---|{'---|' * len(kinds)}")
    surfaces = ("server", "cli", "sandbox", "cache", "drafts", "tools", "json", "logprobs", "slots", "remeasure")
    for surface in (*surfaces, None):
        rows = [r for r in RESULTS if surface is None or r.surface == surface]
        counts = [sum(r.outcome == k for r in rows) for k in kinds]
        print(f"| {surface or 'all'} | {len(rows)} | {' | '.join(map(str, counts))} |")
    if a.json:
        a.json.write_text(json.dumps([asdict(r) for r in RESULTS], indent=2))
    sys.exit(0 if all(r.outcome == "fine" for r in RESULTS) else 1)


if __name__ == "__main__":
    main()
