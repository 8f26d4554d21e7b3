"""`cactus serve` on 127.0.0.1 with the tiny pair, through the real `openai` client, httpx and curl:
answers equal Session's (greedy: token for token), per-request speculation settings take effect,
every bad input is a 400/404/413 in OpenAI's error shape and the server keeps serving, a client
that leaves cancels its generation, a full queue is a 503, the API key, a cached prefix gives the
cold cache's answer, and SIGTERM ends the stream in flight and exits 0."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

try:
    import fastapi  # noqa: F401
    import openai

    try:
        import httpx
    except ImportError:
        import httpx2 as httpx  # (what newer openai releases use instead)
    import uvicorn  # noqa: F401
except ImportError as err:
    if os.environ.get("CI"):
        raise RuntimeError('the serve tests need the serve and test extras: install ".[demo,test,eval,serve]"') from err
    pytest.skip(f"the serve extra is not installed ({err.name})", allow_module_level=True)

from cactus_cli.app.serve.serving import Finished, Server  # noqa: E402
from cactus_cli.app.session import Session  # noqa: E402

PROMPT = "the cat sat on the mat and the dog"


def start(server: Server, api_key: str | None = None):
    """Run the app on a free port in a thread; (base url, stop)."""
    import uvicorn

    from cactus_cli.app.serve.http_api import build_app

    config = uvicorn.Config(build_app(server, api_key), host="127.0.0.1", port=0, log_level="error")
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    port = http.servers[0].sockets[0].getsockname()[1]

    def stop():
        http.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


def load_session(tiny) -> Session:
    """The pair the server tests serve (test_serve_fields.py serves it too): greedy, k 3, 16 tokens."""
    return Session.load(
        verifier=tiny["verifier"],
        draft=tiny["draft_close"],
        device="cpu",
        dtype="float32",
        num_draft_tokens=3,
        max_tokens=16,
        temperature=0.0,
        seed=0,
    )


@pytest.fixture(scope="module")
def session(tiny):
    return load_session(tiny)


@pytest.fixture(scope="module")
def served(session):
    server = Server(session, max_queue=4)
    url, stop = start(server)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield server, url, client
    stop()
    server.stop()


def chat(client, **kw):
    return client.chat.completions.create(model=kw.pop("model", None) or client.models.list().data[0].id, **kw)


def test_models_health_and_metrics(served):
    server, url, client = served
    assert [m.id for m in client.models.list().data] == [server.model_id]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{url}/metrics").text
    assert "# TYPE vllm:spec_decode_num_accepted_tokens_total counter" in text
    assert re.search(r"^vllm:num_requests_waiting 0$", text, re.M)


def test_whole_and_streamed_answers_equal_the_session_greedy(served, session):
    server, url, client = served
    messages = [{"role": "user", "content": PROMPT}]
    whole = chat(client, messages=messages, max_tokens=12)
    pieces, last, usage = [], None, []
    stream = chat(client, messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            last = chunk
        else:  # (the usage chunk, asked for: every benchmark client asks; its absence once crashed the stream)
            usage.append(chunk.usage)
    session.engine.reset()  # (a cold cache: the answer must not depend on what the last request left)
    expected = session.text(messages, max_tokens=12)
    assert whole.choices[0].message.content == "".join(pieces) == expected
    assert whole.choices[0].finish_reason == last.choices[0].finish_reason
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens == session.stats.num_output_tokens
    assert [u.completion_tokens for u in usage] == [whole.usage.completion_tokens]
    spec = whole.model_extra["speculative"]
    assert spec["rule"] == session.settings.rule and spec["drafted"] == session.stats.num_draft_tokens
    assert last.model_extra["speculative"]["accepted"] == spec["accepted"]
    done = client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=8)
    assert done.object == "text_completion" and done.usage.completion_tokens > 0


def test_per_request_speculation_settings_take_effect(served):
    server, url, client = served
    messages = [{"role": "user", "content": PROMPT}]
    plain = chat(client, messages=messages, max_tokens=12, extra_body={"draft": "none"}).model_extra["speculative"]
    assert plain["drafted"] == 0 and plain["draft"] == "none" and plain["num_draft_tokens"] == 0
    k4 = chat(client, messages=messages, max_tokens=12, extra_body={"num_draft_tokens": 4, "rule": "sps"})
    spec = k4.model_extra["speculative"]
    assert spec["rule"] == "sps" and spec["lossless"] and spec["drafted"] > 0 and spec["num_draft_tokens"] == 4
    cactus = chat(client, messages=messages, max_tokens=12, extra_body={"rule": "cactus", "delta": 0.25})
    assert cactus.model_extra["speculative"]["params"]["delta"] == 0.25


def test_a_shared_prefix_is_not_prefilled_again_and_gives_the_cold_answer(served, session):
    server, url, client = served
    first = [{"role": "user", "content": PROMPT + " and the cat"}]
    chat(client, messages=first, max_tokens=4)
    second = first + [{"role": "assistant", "content": "the dog"}, {"role": "user", "content": "the mat"}]
    warm = chat(client, messages=second, max_tokens=10)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    session.engine.reset()
    assert warm.choices[0].message.content == session.text(second, max_tokens=10)


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"n": 2}, 400, "n", "one choice per request"),
        ({"response_format": {"type": "xml"}}, 400, "response_format", "text, json_object or json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400, "response_format", "name"),
        ({"logit_bias": {"5": 1000}}, 400, "logit_bias", "from -100 to 100"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "renders no tools"),
        ({"functions": [{"name": "f"}]}, 400, "functions", "use tools"),
        ({"rule": "nope"}, 400, "rule", "rule must be one of sps, cactus"),
        ({"delta": -1}, 400, "delta", "delta"),
        ({"temperature": "hot"}, 400, "temperature", "temperature"),
        ({"num_draft_tokens": "many"}, 400, "num_draft_tokens", "num_draft_tokens"),
        ({"draft": "suffix"}, 400, "draft", "this server loaded draft"),
        ({"frobnicate": 1}, 400, "frobnicate", "unknown field"),
        ({"max_tokens": 100000}, 400, "max_tokens", "does not fit"),
        ({"messages": []}, 400, "messages", "messages"),
        ({"model": "gpt-4"}, 404, "model", "is not served here"),
        ({"messages": [{"role": "user", "content": "the " * 600}]}, 400, "messages", "context window"),
        ({"max_tokens": True}, 400, "max_tokens", "integer"),  # (strict: true is not 1)
        ({"max_tokens": "3"}, 400, "max_tokens", "integer"),
        ({"stream": "yes"}, 400, "stream", "boolean"),
        ({"rule": "sps", "delta": 1.0}, 400, "delta", "no effect with rule 'sps'"),
        ({"draft": "none", "num_draft_tokens": 4}, 400, "num_draft_tokens", "no effect without a draft"),
    ],
)
def test_bad_requests_get_one_clear_error_and_the_server_keeps_serving(served, body, status, param, words):
    server, url, client = served
    payload = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4} | body
    r = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert chat(client, messages=[{"role": "user", "content": PROMPT}], max_tokens=2).choices[0].message.content


def test_malformed_and_oversized_bodies(served, monkeypatch):
    server, url, client = served
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    nested = b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}"  # (Starlette's own parse error)
    r = httpx.post(f"{url}/v1/completions", content=nested, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json(), r.text
    r = httpx.get(f"{url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] == "GET is not allowed on /v1/completions"
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    from cactus_cli.app.serve import http_guard

    monkeypatch.setattr(http_guard, "MAX_BODY_BYTES", 1000)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "the " * 500})
    assert r.status_code == 413 and "over the 1000-byte limit" in r.json()["error"]["message"]
    chunked = httpx.post(f"{url}/v1/completions", content=iter([b'{"prompt": "the"}']))  # (no Content-Length)
    assert chunked.status_code == 411 and "Content-Length" in chunked.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 10**6], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    for path, raw, param in (  # a lone surrogate is valid JSON, but no text a tokenizer takes
        ("/v1/completions", b'{"prompt": "the \\ud800 cat", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a \\udfff"}]}', "messages"),
        ("/v1/completions", b'{"prompt": "the cat", "stop": ["\\ud800"]}', "stop"),
    ):
        r = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "unpaired surrogate" in r.json()["error"]["message"]


def slow(server: Server, gate: threading.Event | None = None, delay: float = 0.05) -> None:
    """Make the worker wait for ``gate`` before each step, and each step take ``delay`` seconds."""
    step = server.batch.step

    def slowly():
        if gate is not None:
            gate.wait(30)
        time.sleep(delay)
        return step()

    server.batch.step = slowly


@contextlib.contextmanager
def serving(session, api_key=None, gate=None, delay=None, **server_args):
    """A Server on ``session`` behind the app on a free port: (server, url). With ``gate`` or
    ``delay``, slowed as ``slow`` says (and restored afterwards)."""
    server = Server(session, **server_args)
    slowed = gate is not None or delay is not None
    if slowed:
        slow(server, gate, 0.05 if delay is None else delay)
    url, stop = start(server, api_key)
    try:
        yield server, url
    finally:
        if gate is not None:
            gate.set()
        stop()
        server.stop()


def test_a_client_that_leaves_cancels_its_generation(session):
    with serving(session, delay=0.05, max_queue=2) as (server, url):
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 400, "stream": True}
        body["temperature"] = 0.8  # (sampled: no early end on a repeated greedy EOS)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk, then leave
        deadline = time.monotonic() + 10
        while server.metrics.requests.get("abort", 0) < 1:
            assert time.monotonic() < deadline, "the generation went on after its client left"
            time.sleep(0.05)
        assert server.metrics.generation_tokens < 400
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200


def test_a_full_queue_is_a_503_with_retry_after(session):
    gate = threading.Event()
    with serving(session, gate=gate, delay=0, max_queue=1) as (server, url):
        body = {"prompt": PROMPT, "max_tokens": 2}
        answers: list[int] = []
        waiting = [
            threading.Thread(
                target=lambda: answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code)
            )
            for _ in range(2)
        ]
        for t in waiting:  # one running (held at the gate), one queued
            t.start()
            time.sleep(0.5)
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert (
            r.status_code == 503 and r.headers["retry-after"] == "1" and "queue is full" in r.json()["error"]["message"]
        )
        gate.set()
        for t in waiting:
            t.join(60)
        assert answers == [200, 200]
        assert 'cactus_requests_rejected_total{reason="queue full"} 1' in httpx.get(f"{url}/metrics").text


def test_metrics_count_what_the_answers_said(session):
    """/metrics after two answers: each counter is the sum of what the responses reported."""
    with serving(session) as (server, url):
        answers = [
            httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": n, "temperature": 0}, timeout=60)
            for n in (5, 9)
        ]
        bodies = [r.json() for r in answers]
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        text = httpx.get(f"{url}/metrics").text
        values = {
            line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")
        }

        def total(get):
            return sum(get(b) for b in bodies)

        assert values["vllm:prompt_tokens_total"] == total(lambda b: b["usage"]["prompt_tokens"])
        assert values["vllm:generation_tokens_total"] == total(lambda b: b["usage"]["completion_tokens"]) == 14
        assert values["vllm:spec_decode_num_draft_tokens_total"] == total(lambda b: b["speculative"]["drafted"]) > 0
        assert values["vllm:spec_decode_num_accepted_tokens_total"] == total(lambda b: b["speculative"]["accepted"])
        passes = total(lambda b: b["speculative"]["verifier_forward_passes"])
        assert values["cactus_verify_passes_total"] == passes
        assert values["cactus_tokens_per_verifier_pass"] == pytest.approx(14 / passes, abs=1e-4)
        drafts = values["vllm:spec_decode_num_drafts_total"]
        accepted = values["vllm:spec_decode_num_accepted_tokens_total"]
        assert values["cactus_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts, abs=1e-4)
        assert values['vllm:request_success_total{finished_reason="length"}'] == 2
        assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0


def test_stopping_ends_the_running_answer_and_turns_the_rest_away_with_a_503(session):
    """Server.stop (what SIGTERM and Ctrl-C call): the running stream ends with finish_reason
    abort, the queued request and any new one get a 503 with Retry-After, /health says so."""
    gate = threading.Event()
    with serving(session, gate=gate, max_queue=2) as (server, url):
        body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0.8, "stream": True}
        chunks: list[dict] = []

        def running():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                chunks.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))

        queued: list = []
        threads = [
            threading.Thread(target=running),
            threading.Thread(
                target=lambda: queued.append(
                    httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
                )
            ),
        ]
        for t in threads:  # one running (held at the gate), one queued
            t.start()
            time.sleep(0.5)
        gate.set()
        time.sleep(0.3)  # (a few steps of the running one)
        server.stop()
        for t in threads:
            t.join(60)
        assert queued[0].status_code == 503 and queued[0].headers["retry-after"] == "1"
        assert "shutting down" in queued[0].json()["error"]["message"]
        assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert sum(len(c["choices"][0]["text"]) for c in chunks if c["choices"]) > 0
        late = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
        assert late.status_code == 503 and late.headers["retry-after"] == "1"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json() == {"status": "stopping"}
        assert 'cactus_requests_rejected_total{reason="stopping"} 2' in httpx.get(f"{url}/metrics").text


def test_log_requests_logs_the_text_only_when_asked(session):
    lines: list[str] = []
    with serving(session, log=lines.append) as (server, url):
        httpx.post(f"{url}/v1/completions", json={"prompt": "the dog ran", "max_tokens": 2}, timeout=60)
        assert any("the dog ran" in line for line in lines) and any("answer" in line for line in lines)


def test_the_api_key(session):
    with serving(session, api_key="s3cret") as (server, url):
        body = {"prompt": PROMPT, "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{url}/health").status_code == 200  # (a load balancer's check needs no key)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=2).choices


def test_the_command_refuses_a_busy_port_a_bad_host_and_an_empty_key_before_loading(tiny, monkeypatch):
    """One line and exit 2, at once: the socket is bound before the models load (a load would
    fail this test: Session.load is replaced by one that raises)."""
    import socket

    from cactus_cli.app import session as session_module
    from tests.helpers import assert_one_line_error, invoke

    def no_load(*a, **kw):
        raise AssertionError("the models were loaded before the port was checked")

    monkeypatch.setattr(session_module.Session, "load", classmethod(no_load))
    monkeypatch.delenv("CACTUS_API_KEY", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for args, needle in (
            (["--port", port], "choose another --port"),
            (["--host", "no such host!"], "not an address this machine can listen on"),
            (["--api-key", ""], "--api-key"),
            (["--api-key", "two words"], "printable ASCII without spaces"),
        ):
            assert_one_line_error(invoke("serve", "--verifier", tiny["verifier"], *args), needle)


def test_the_command_serves_curl_and_sigterm_ends_the_stream_and_exits_0(tiny, tmp_path):
    env = dict(os.environ, CACTUS_HOME=str(tmp_path / "home"))
    cmd = [sys.executable, "-m", "cactus_cli", "serve", "--verifier", tiny["verifier"], "--draft", tiny["draft_close"]]
    cmd += ["--device", "cpu", "--dtype", "float32", "-k", "2", "--port", "0", "--no-color"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(120, proc.kill)  # (a hang fails the test instead of the suite)
    watchdog.start()
    try:
        url, said = None, []
        for line in proc.stderr:
            said.append(line)
            if m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line):
                url = m.group(1)
                break
        assert url, "serve did not say where it listens"
        assert any("answers without max_tokens run to their end" in line for line in said), said
        out = subprocess.run(
            [
                "curl",
                "-sS",
                "-H",
                "Content-Type: application/json",
                "-d",
                json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}),
                f"{url}/v1/chat/completions",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        doc = json.loads(out.stdout)
        assert doc["object"] == "chat.completion" and doc["usage"]["completion_tokens"] > 0, out.stdout
        body = {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 400,
            "temperature": 0.8,
            "stream": True,
        }
        events = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]", events[-3:]
        finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]]
        assert finals[-1] == "abort"  # (400 tokens take longer than the signal)
        assert proc.wait(30) == 0
        assert "the cat sat" not in proc.stderr.read()  # (no request's text in the log without --log-requests)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()


def test_a_stop_string_is_cut_whole_whole_and_streamed(served, session):
    """A stop string that spans two tokens ends the answer before its first character, in the
    whole answer and in the stream (smolagents' "</code>" came back as "...</code")."""
    server, url, client = served
    messages = [{"role": "user", "content": PROMPT}]
    text = chat(client, messages=messages, max_tokens=12, temperature=0).choices[0].message.content
    words = text.split()
    stop = f"{words[3]} {words[4]}"  # (the tiny tokenizer: one token a word)
    cut = text[: text.index(stop)]
    whole = chat(client, messages=messages, max_tokens=12, temperature=0, stop=[stop])
    assert whole.choices[0].message.content == cut and whole.choices[0].finish_reason == "stop"
    pieces = [
        c.choices[0].delta.content or ""
        for c in chat(client, messages=messages, max_tokens=12, temperature=0, stop=stop, stream=True)
        if c.choices
    ]
    assert "".join(pieces) == cut


def test_an_answer_without_max_tokens_runs_to_its_end_and_a_server_cap_holds(session):
    """No max_tokens: until the end of sequence or the context window, not the profile's 16; with
    --max-tokens the cap applies, and asking past it is a 400 naming max_tokens."""
    body = {"prompt": PROMPT, "temperature": 0}
    with serving(session) as (server, url):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        n_prompt, n_out = r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]
        assert session.settings.max_tokens == 16 and n_out > 16
        assert r["choices"][0]["finish_reason"] == "stop" or n_prompt + n_out == server.context_length
    with serving(session, max_tokens=5) as (server, url):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
        r = httpx.post(f"{url}/v1/completions", json=body | {"max_tokens": 6}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "cap of 5" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": []},
        {"tools": None},
        {"functions": []},
        {"response_format": None},
        {"response_format": {"type": "text"}},
        {"tool_choice": "none"},
        {"echo": False, "best_of": 1},
    ],
)
def test_what_clients_send_as_defaults_is_taken(served, extra):
    server, url, client = served
    payload = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2} | extra
    r = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 200, r.text


def test_unknown_keys_inside_a_message_are_ignored(served):
    """litellm sends the assistant turn back with provider_specific_fields (mini-swe-agent's step 3)."""
    server, url, client = served
    messages = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": "the dog", "provider_specific_fields": {"x": 1}},
        {"role": "user", "content": "the mat"},
    ]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def batched(tiny):
    session = Session.load(
        verifier=tiny["verifier"],
        draft=tiny["draft_close"],
        device="cpu",
        dtype="float32",
        num_draft_tokens=3,
        max_tokens=16,
        temperature=0.0,
        seed=0,
        sequences=4,
    )
    return session


def test_eight_concurrent_requests_each_get_the_answer_they_get_alone(batched):
    """--parallel 4, 8 requests sent together (mixed lengths, shared prefixes, stop strings): each
    answer equals the one the request gets served alone, token for token (greedy, float32), and
    the server's steps ran four at a time with the rest waiting."""
    prompts = [
        PROMPT,
        PROMPT + " ran fast",
        "a red bird",
        PROMPT,
        "blue sky and the sun",
        "one two three",
        PROMPT + " sat",
        "the sea",
    ]
    bodies = [
        {"prompt": p, "max_tokens": 6 + 2 * i, "temperature": 0, **({"stop": ["sat on"]} if i % 3 == 0 else {})}
        for i, p in enumerate(prompts)
    ]
    with serving(batched, max_queue=8) as (server, url):
        alone = [httpx.post(f"{url}/v1/completions", json=b, timeout=120).json() for b in bodies]
    gate, steps = threading.Event(), []  # (the server's own view at each step: no polling race on a busy machine)
    with serving(batched, max_queue=8, parallel=4, gate=gate, delay=0.0) as (server, url):
        step = server.batch.step

        def counted():
            steps.append((len(server.running), server.queue.qsize()))
            return step()

        server.batch.step = counted
        answers: list = [None] * len(bodies)

        def send(i):
            answers[i] = httpx.post(f"{url}/v1/completions", json=bodies[i], timeout=120).json()

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(server.running) + server.queue.qsize() < len(bodies):  # every request in before the first step
            assert time.monotonic() < deadline, "the requests did not all arrive"
            time.sleep(0.01)
        gate.set()
        for t in threads:
            t.join()
    for got, want in zip(answers, alone):
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    running, waiting = zip(*steps)
    assert max(running) == 4 and max(waiting) > 0, steps


def test_parallel_bad_values_are_one_line_errors(monkeypatch, capsys):
    from cactus_cli.cli.main import main

    for value, needle in (
        ("0", "greater than or equal to 1"),
        ("-1", "greater than or equal to 1"),
        ("many", "valid integer"),
        ("100", "less than or equal to 64"),
    ):
        monkeypatch.setattr(sys, "argv", ["cactus", "serve", "--parallel", value])
        with pytest.raises(SystemExit) as exit_:
            main()
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
        assert "'--parallel'" in lines[0] and needle in lines[0], lines[0]


def test_parallel_past_memory_is_a_one_line_error():
    from cactus_cli.app.serve.serving import check_parallel
    from cactus_cli.core.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"--parallel 8: 8 slots of 2048 tokens need 3\.0 GiB .* use --parallel 2 or fewer"
    ):
        check_parallel(8, 196608, 1 << 30)
    check_parallel(8, 196608, None)  # (unknown: no check)


def test_the_measured_default_parallel_doubles_while_it_pays():
    from cactus_cli.app.serve.serving import choose_parallel
    from cactus_cli.infer.kpolicy.costs import CostModel

    cpu = CostModel()  # the EPYC's llama-bench curve (docs/adaptive-k.md): 4 wins, 8 adds only 16%
    for w, ms in {1: 29, 2: 46, 4: 66, 8: 114, 16: 163}.items():
        cpu.add_verify(w, ms / 1000)
    n, why = choose_parallel(cpu, 16)
    assert n == 4 and "8 would add 16%" in why
    gpu = CostModel()  # flat: every doubling pays
    for w in (1, 2, 4, 8, 16):
        gpu.add_verify(w, 0.01)
    assert choose_parallel(gpu, 16)[0] == 16
    assert choose_parallel(CostModel(), 16)[0] == 1


def test_a_request_asking_for_auto_on_a_fixed_k_profile_gets_the_cost_probe(tiny, tmp_path, monkeypatch):
    """The request is prepared with its own settings (it was prepared with the server's, so -k auto
    on a fixed-k profile never measured what a step costs)."""
    monkeypatch.setenv("CACTUS_HOME", str(tmp_path / "home"))  # (no cost cache from other tests)
    session = Session.load(
        verifier=tiny["verifier"], draft=tiny["draft_close"], device="cpu", dtype="float32", num_draft_tokens=3
    )
    assert not session.engine.costs.costs.knows("model")
    with serving(session) as (server, url):
        body = {"prompt": PROMPT, "max_tokens": 4, "num_draft_tokens": "auto"}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    assert session.engine.costs.costs.source.startswith("probe")


def test_one_at_a_time_two_conversations_keep_their_own_cached_prefixes(batched):
    """--parallel 1 keeps PREFIXES cached prompts: conversations that share only a chat header
    each keep their slot, so coming back to one skips its whole prefill (the request used to take
    the slot holding the longest common prefix, the header, and overwrite the other's cache:
    serve_bench's edits were prefilled again on every round)."""
    server = Server(batched, parallel=1)

    def ask(text: str) -> tuple[Finished, int]:
        ids = batched.encode([{"role": "user", "content": text}])
        box: list = []
        done = threading.Event()

        def deliver(item):
            if isinstance(item, (Finished, Exception)):
                box.append(item)
                done.set()

        server.submit(server.request(ids, {"max_tokens": 4, "temperature": 0}, deliver))
        assert done.wait(120)
        assert isinstance(box[0], Finished), box[0]
        return box[0], len(ids)

    try:
        a, b = PROMPT + " and then the cat sat down on the mat", "blue sky and the sun over the hills far away"
        ask(a)
        ask(b)
        again, n = ask(a)
        assert again.stats.reused_prefix_tokens >= n - 1, (again.stats.reused_prefix_tokens, n)
    finally:
        server.stop()
