"""What the sixth round's hostile probe of `cactus serve` found (issue 71, item 4), each pinned
here: a body over the limit sent chunked with a small Content-Length, a body that stalls after its
headers, lone surrogates and deep nesting outside message text (500s with tracebacks before),
`models remeasure` undone by a running server, batched timings saved and then dropped on load,
``max_completion_tokens`` refused by another field's name, and a final assistant message
(prefill) closed instead of continued."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from cactus_cli.app.serve import http_guard
from cactus_cli.core.paths import cache_path
from cactus_cli.infer.kpolicy.costs import Step
from cactus_cli.infer.kpolicy.store import CostStore
from tests.helpers import invoke

pytest.importorskip("fastapi")  # (the serve extra; test_serve says so on CI)

from .test_serve import httpx  # noqa: E402
from .test_tools import TOOLS_TEMPLATE  # noqa: E402

# the tiny tokenizer's template with the tools section Qwen2.5's has (the tools as transformers' tojson writes them)
TEMPLATE = TOOLS_TEMPLATE.replace(
    "{% for t in tools %}{{ t['function']['name'] }} {% endfor %}", "{{ tools | tojson }}"
)

# --- the cost store ------------------------------------------------------------------------------


def test_batched_verify_widths_are_saved_and_loaded_back(tmp_path):
    """`serve --parallel 4` with long drafts times verifies of 69-132 tokens (the step's runs
    together); they were saved, then dropped at the next start as invalid ("dropped 28 invalid
    entries"). Saved widths load back; one wider than any batch is never saved."""
    path = tmp_path / "costs.json"
    store = CostStore(path, {"pair": "x"})
    for width in (1, 5, 69, 100, 132):
        store.observe_verify(width, 0.01 * width)
    store.observe_verify(10**6, 1.0)  # (no batch is this wide)
    store.save()
    again = CostStore(path)
    assert again.notes == [], again.notes
    assert sorted(again.costs.verify) == [1, 5, 69, 100, 132]
    assert again.costs.t_v(132) == pytest.approx(1.32)


def test_a_running_server_does_not_write_back_what_models_remeasure_forgot(isolated_home):
    """With a server on the same CACTUS_HOME, `models remeasure` deleted the cost file and the
    server wrote it back with the old timings at its next finished request. Now the server drops
    what it held: the next save holds only what it timed since (unprobed, so the next start probes)."""
    key = {"pair": "remeasured"}
    path = cache_path(key)
    old = CostStore(path, key)
    old.observe_verify(1, 0.5)
    old.observe_verify(4, 0.9)
    old.probed({"quiet": True})  # (a probe's timings, saved)
    server = CostStore.read(key)  # the running server's store
    assert server.costs.t_v(4) == pytest.approx(0.9) and not server.provisional
    r = invoke("models", "remeasure")
    assert r.exit_code == 0 and "forgot 1 measurement" in r.output, r.output
    server.observe(Step("greedy", 1, 1, 0.01, 0.2))  # (a request finishes: the store is saved)
    server.save()
    assert not path.exists()  # (not written back)
    assert server.costs.verify == {} and server.acceptance == {}  # (the old timings are gone here too)
    server.observe(Step("greedy", 1, 1, 0.01, 0.3))
    server.save()
    doc = json.loads(path.read_text())
    assert doc["costs"]["verify"] == {"2": [0.3]} and doc["conditions"] is None
    assert CostStore.read(key).provisional  # (so the next start probes again, as remeasure says)


def test_a_store_another_process_rewrote_is_read_again_not_overwritten(tmp_path):
    """Another process's save (a fresh probe) is taken, not overwritten with this one's timings."""
    path = tmp_path / "costs.json"
    mine = CostStore(path)
    mine.observe_verify(1, 0.5)
    mine.save()
    theirs = CostStore(path)
    theirs.observe_verify(1, 0.1)
    theirs.probed({"quiet": True})
    mine.observe_verify(1, 0.6)
    mine.save()
    assert json.loads(path.read_text())["costs"]["verify"] == {"1": [0.1]}  # (theirs, kept)
    assert mine.costs.t_v(1) == pytest.approx(0.1) and mine.conditions == {"quiet": True}


# --- the body, at the transport -------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny):
    """The app on a free port behind uvicorn with `cactus serve`'s own protocol: (server, port)."""
    import uvicorn

    from cactus_cli.app.serve.http_api import build_app
    from cactus_cli.app.serve.serving import Server
    from cactus_cli.app.session import Session

    session = Session.load(
        verifier=tiny["verifier"], draft=tiny["draft_close"], device="cpu", dtype="float32", max_tokens=4, seed=0
    )
    session.tokenizer.chat_template = TEMPLATE
    server = Server(session, max_queue=4)
    config = uvicorn.Config(
        build_app(server), host="127.0.0.1", port=0, log_level="error", http=http_guard.guarded_http()
    )
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        assert thread.is_alive()
        time.sleep(0.02)
    yield server, http.servers[0].sockets[0].getsockname()[1]
    http.should_exit = True
    thread.join(10)
    server.stop()


def exchange(port: int, head: bytes, body: bytes = b"", wait: float = 10) -> tuple[bytes, float]:
    """Send a request's head and ``body`` on a fresh connection; (all the server sent before it
    closed the connection, seconds it took)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(wait)
    started = time.monotonic()
    sock.sendall(head + body)
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    sock.close()
    return got, time.monotonic() - started


def test_a_chunked_body_sent_with_a_small_content_length_is_refused(served):
    """The 8 MiB limit read the Content-Length header while h11 read the chunks: a 20 MiB body took
    the server from 0.5 GB to 3.4 GB. Both framings together are refused (RFC 9112), connection closed."""
    server, port = served
    chunk = b'{"prompt": "the cat", "max_tokens": 2}'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n"
    got, _ = exchange(port, head, b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk))
    assert got.startswith(b"HTTP/1.1 400"), got
    assert b"Content-Length or Transfer-Encoding, not both" in got and b"connection: close" in got.lower()


def test_the_body_limit_counts_the_bytes_that_arrive(monkeypatch):
    """Whatever the headers say, a body is refused (413) once more than the limit has arrived, and
    the app never sees it."""
    monkeypatch.setattr(http_guard, "MAX_BODY_BYTES", 1000)
    seen, sent = [], []

    async def app(scope, receive, send):
        seen.append(await receive())

    async def send(message):
        sent.append(message)

    chunks = [{"type": "http.request", "body": b"x" * 400, "more_body": True} for _ in range(5)]

    async def receive():
        return chunks.pop(0)

    scope = {"type": "http", "method": "POST", "headers": [(b"content-length", b"10")]}
    asyncio.run(http_guard.BodyGuard(app)(scope, receive, send))
    assert seen == [] and sent[0]["status"] == 413 and b"over the 1000-byte limit" in sent[1]["body"]
    assert len(chunks) == 2  # (it stopped reading at 1,200 bytes)


def test_a_body_that_stalls_after_its_headers_is_timed_out(served, monkeypatch):
    """Headers were timed out, a body never: a request that sent its headers and part of its body
    held its socket for good. Now a 408 and the connection closed, BODY_TIMEOUT after the headers;
    a slow body that arrives in time is answered."""
    server, port = served
    monkeypatch.setattr(http_guard, "BODY_TIMEOUT", 1.0, raising=False)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    got, took = exchange(port, head, b'{"prompt": ')
    assert got.startswith(b"HTTP/1.1 408"), got
    assert b"did not arrive within 1 s" in got and 0.9 < took < 5


# --- the request's JSON -------------------------------------------------------------------------


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALLED = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}


def with_call(name: str = "get_weather", arguments: str = '{"city": "Paris"}') -> list[dict]:
    call = {**CALLED["tool_calls"][0], "function": {"name": name, "arguments": arguments}}
    return [{"role": "user", "content": "the cat"}, {**CALLED, "tool_calls": [call]}]


JSON = {"content-type": "application/json"}


def raw_post(port: int, path: str, text: str) -> tuple[int, dict]:
    """POST ``text`` as it is (JSON that json.dumps would not write: lone surrogates kept as escapes)."""
    r = httpx.post(f"http://127.0.0.1:{port}{path}", content=text.encode(), headers=JSON, timeout=60)
    return r.status_code, r.json()


def surrogate(value: dict, where: list) -> str:
    """``value`` as JSON with the string at ``where`` (keys and indices) given a lone surrogate."""
    doc = json.loads(json.dumps(value))
    target = doc
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = "MARK"
    return json.dumps(doc).replace("MARK", "a \\ud800 b")


@pytest.mark.parametrize(
    "body, where, field",
    [
        ({"tools": [WEATHER]}, ["tools", 0, "function", "description"], "tools[0].function.description"),
        (
            {"messages": with_call()},
            ["messages", 1, "tool_calls", 0, "function", "name"],
            "messages[1].tool_calls[0].function.name",
        ),
        ({"messages": [{"role": "user", "content": "the cat"}]}, ["messages", 0, "content"], "messages[0].content"),
        ({"stop": ["x"]}, ["stop", 0], "stop[0]"),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(served, body, where, field):
    """A lone surrogate in a tool's description or an assistant call's name reached the chat
    template (TypeError, a 500 with a traceback); in message text it was already a 400, still is."""
    server, port = served
    payload = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2} | body
    status, doc = raw_post(port, "/v1/chat/completions", surrogate(payload, where))
    assert status == 400, doc
    assert doc["error"]["param"] == where[0] and doc["error"]["message"].startswith(f"{field}: "), doc
    assert "unpaired surrogate (\\ud800)" in doc["error"]["message"]


def test_lone_surrogates_in_keys_and_in_call_arguments_are_400s(served):
    server, port = served
    tool = json.loads(json.dumps(WEATHER))
    tool["function"]["parameters"]["properties"] = {"MARK": {"type": "string"}}
    text = json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [tool]}).replace("MARK", "\\udc00")
    status, doc = raw_post(port, "/v1/chat/completions", text)
    assert status == 400 and doc["error"]["message"].startswith("tools[0].function.parameters.properties: a key"), doc
    arguments = json.dumps({"city": "MARK"}).replace("MARK", "\\ud800")  # (JSON text in a string: the escape inside)
    status, doc = raw_post(port, "/v1/chat/completions", json.dumps({"messages": with_call(arguments=arguments)}))
    assert status == 400, doc
    assert doc["error"]["message"].startswith("messages[1].tool_calls[0].function.arguments.city: the text holds")


@pytest.mark.parametrize("levels", [400, 900])
def test_json_nested_deep_inside_a_request_is_a_400_not_a_recursion_error(served, levels):
    """Tool-call arguments or tool parameters nested 400-900 levels raised RecursionError (a 500)."""
    server, port = served
    tool = json.loads(json.dumps(WEATHER))
    tool["function"]["parameters"]["properties"]["city"]["default"] = json.loads(deep(levels))
    for path, body, field in (
        ("/v1/chat/completions", {"messages": with_call(arguments=deep(levels))}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "auto"},
            "tools",
        ),
        ("/v1/completions", {"prompt": "the cat", "stop": json.loads(deep(levels))}, "stop"),
    ):
        status, doc = raw_post(port, path, json.dumps(body))
        assert status == 400 and doc["error"]["param"] == field, (path, doc)
        assert f"nested deeper than {http_guard.MAX_DEPTH} levels" in doc["error"]["message"], doc
    status, doc = raw_post(port, "/v1/chat/completions", json.dumps({"messages": with_call(), "max_tokens": 2}))
    assert status == 200, doc  # (a call's arguments as they should be are taken)
