"""The hostile sweep's server round (``hostile_sweep.py --only server``): the cases sent at a real
uvicorn on 127.0.0.1 with the tiny test pair (bodies, types, fields, sizes, methods, headers), each
followed by a canary request; then a burst past the queue, dropped clients, a second round to look
for leaked threads and descriptors, and the API key.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from hostile_sweep_harness import Errors, _raw, httpx, one_line_error, record, serve

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
