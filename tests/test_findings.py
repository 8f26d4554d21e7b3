"""The fifth hardening round's findings, each reproduced as a user met it: every test
here failed before its fix."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cactus_cli.core.errors import ConfigError
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.pair.loader import load_pair

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def close(tiny):
    return load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32")


def test_a_run_without_drafts_leaves_no_stale_draft_cache_behind(close):
    """Finding 3: a request with draft none between two that draft; the third, sharing a prefix with
    the second, must draft from a draft cache that holds its own tokens (as a fresh engine does)."""
    tok = close.tokenizer
    a = tok("the cat sat on the mat and then the dog ran fast and it was very happy")["input_ids"]
    b = a[:6] + tok("a red bird sang and flew up")["input_ids"]
    c = b + tok("then the sun was big")["input_ids"]
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=4, max_tokens=24, ignore_eos=True)
    plain = dataclasses.replace(params, num_draft_tokens=0)
    engine = SpeculativeEngine(close)
    for prompt, p in ((a, params), (b, plain)):
        list(engine.generate(prompt, p, reuse_cache=True))
    after = [len(ev.accepted) for ev in engine.generate(c, params, reuse_cache=True)]
    fresh = SpeculativeEngine(close)
    list(fresh.generate(b, plain))
    cold = [len(ev.accepted) for ev in fresh.generate(c, params, reuse_cache=True)]
    assert after == cold
    lengths = engine.cache_lengths()
    assert lengths["draft"] <= lengths["sequence"]


def test_two_tasks_with_one_id_are_refused(tmp_path):
    """Finding 2: eval --out graded the second task of a shared id with the first's answer."""
    from cactus_cli.app.eval.tasks import load_tasks

    path = tmp_path / "tasks.jsonl"
    rows = [{"id": "q", "prompt": "one", "answer": "1"}, {"id": "q", "prompt": "two", "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=r"tasks.jsonl:2: the task id 'q' is used twice \(first at .*:1\)"):
        load_tasks(str(path), None)
    rows = [{"id": 7, "prompt": "one", "answer": "1"}, {"id": "7", "prompt": "two", "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match="used twice"):
        load_tasks(str(path), None)


LONG = "x" * 300  # a file name over the 255 bytes a directory entry holds (ENAMETOOLONG)


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--profile", LONG, "hi"],
        ["profiles", "show", LONG],
        ["bench", "--csv", "{dir}/" + LONG],
        ["bench", "--prompts", "{dir}/" + LONG],
        ["eval", "--out", "{dir}/" + LONG],
        ["eval", "--tasks", "{dir}/" + LONG],
        ["generate", "--verifier", "{dir}/" + LONG, "hi"],
        ["generate", "--remember", "{dir}/" + LONG, "--draft", "suffix", "hi"],
        ["chat", "--history", "{dir}/" + LONG],
        ["calibrate", "--save", LONG],
    ],
)
def test_a_file_name_too_long_is_one_line(tiny, tmp_path, args):
    """Finding 5: each of these was OSError [Errno 36] with a traceback."""
    from tests.helpers import invoke, pair_args

    args = [a.replace("{dir}", str(tmp_path)) for a in args]
    pair = [] if args[0] == "profiles" or "--verifier" in args else pair_args(tiny, "draft_close")
    if "--draft" in args:
        pair = [a for a in pair_args(tiny) if a not in ("--draft", tiny["draft"])]
    limit = ["--limit", "1", "-n", "4"] if args[0] in ("bench", "eval", "calibrate") else []
    r = invoke(*args[:1], *pair, *limit, *args[1:], input="")
    assert "Traceback" not in r.output
    assert r.exit_code == 2, r.output
    last = [ln for ln in r.output.strip().splitlines() if ln.strip()][-1]
    assert last.startswith("error: ") and "too long" in last, r.output


def test_a_non_utf8_a_folder_a_dangling_link_or_a_pipe_as_progress_file_is_one_line(tiny, tmp_path):
    """Finding 5 and 6: eval --out D --resume with D/progress.jsonl invalid UTF-8, a folder or a
    dangling link was a traceback; a FIFO blocked forever."""
    import os

    from tests.helpers import invoke, pair_args

    cases = {
        "bytes": lambda p: p.write_bytes(b'{"run": "\xff"}\n'),
        "folder": lambda p: p.mkdir(),
        "dangling": lambda p: p.symlink_to(tmp_path / "nowhere" / "x"),
        "fifo": lambda p: os.mkfifo(p),
    }
    for name, make in cases.items():
        out = tmp_path / name
        out.mkdir()
        make(out / "progress.jsonl")
        r = invoke("eval", *pair_args(tiny, "draft_close"), "--limit", "1", "-n", "4", "--out", out, "--resume")
        assert r.exit_code == 2 and "Traceback" not in r.output, (name, r.output)
        assert r.output.strip().splitlines()[-1].startswith("error: "), (name, r.output)


def test_a_prompts_file_with_a_lone_surrogate_is_one_line(tiny, tmp_path):
    from tests.helpers import bench_args, invoke

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "the cat \\ud800"}\n')
    r = invoke(*bench_args(tiny), "--prompts", prompts)
    assert r.exit_code == 2 and "p.jsonl:1: the text holds an unpaired surrogate" in r.output, r.output


def test_a_fifo_among_the_profiles_is_an_error_not_a_hang(tmp_path):
    """Finding 6: `generate -p pipe` and `profiles show pipe` blocked forever on a FIFO there."""
    import os

    from cactus_cli.app.config.profile_files import user_profile_dir
    from tests.helpers import invoke

    folder = user_profile_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.mkfifo(folder / "pipe.yaml")
    for args in (["profiles", "show", "pipe"], ["generate", "-p", "pipe", "hi"], ["profiles", "list"]):
        r = invoke(*args)
        assert "Traceback" not in r.output, r.output
        if args[1] != "list":
            assert r.exit_code == 2 and "not a regular file" in r.output, r.output


def test_a_key_given_twice_in_a_profile_is_refused(tmp_path):
    """Finding 10: YAML keeps the last of two equal keys silently."""
    from cactus_cli.app.config.profile_files import load_profile

    path = tmp_path / "twice.yaml"
    path.write_text("temperature: 0.2\nmax_tokens: 64\ntemperature: 0.9\n")
    with pytest.raises(ConfigError, match=r"twice.yaml:3: 'temperature' is given twice \(first at line 1\)"):
        load_profile(str(path))
    path.write_text("rule: cactus\nrule_params:\n  delta: 0.5\n  delta: 2\n")
    with pytest.raises(ConfigError, match=r"twice.yaml:4: 'delta' is given twice"):
        load_profile(str(path))


def test_calibrate_save_under_a_builtin_name_is_refused(tmp_path):
    """Finding 10: `calibrate --save default` wrote a user default.yaml that replaced the built-in
    default for every bare command, silently."""
    from cactus_cli.app.grid.calibrated_profile import save_target

    with pytest.raises(ConfigError, match="built-in profile's name.*every command that names no profile"):
        save_target("default")
    assert save_target("mine").name == "mine.yaml"


@pytest.mark.parametrize("phase", ["k", "delta"])
def test_an_interrupted_calibrate_prints_what_finished_and_saves_nothing(tiny, tmp_path, monkeypatch, phase):
    """Finding 7: Ctrl-C or SIGTERM after the delta sweep printed only `interrupted`."""
    from cactus_cli.app.grid import calibration as cal_mod
    from tests.helpers import calibrate_args, invoke

    if phase == "k":

        def stop(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(cal_mod, "_choose_k", stop)
    else:
        real, calls = cal_mod.run_speculative, []

        def second_stops(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(cal_mod, "run_speculative", second_stops)
    target = tmp_path / "p.yaml"
    r = invoke(*calibrate_args(tiny), "--save", target)
    assert r.exit_code == 130, r.output
    assert "delta=0 k=" in r.output and "nothing saved" in r.output, r.output
    assert ("while timing k" in r.output) == (phase == "k") and "Traceback" not in r.output
    assert not target.exists()


def test_a_connection_that_never_finishes_its_headers_is_closed(monkeypatch):
    """Finding 9: connections that sent partial headers, or nothing, were held for good (150 s+):
    each holds a file descriptor. A request whose headers arrive is answered as before."""
    pytest.importorskip("uvicorn")
    import socket
    import threading
    import time

    import uvicorn
    from fastapi import FastAPI

    from cactus_cli.app.serve import http_guard

    monkeypatch.setattr(http_guard, "HEADER_TIMEOUT", 1.0)
    app = FastAPI()

    @app.get("/ok")
    async def ok():
        return {"ok": True}

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", http=http_guard.guarded_http())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        silent = socket.create_connection(("127.0.0.1", port))
        partial = socket.create_connection(("127.0.0.1", port))
        partial.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # (no blank line: the headers never end)
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b'{"ok":true}' not in got:
            chunk = kept.recv(4096)
            assert chunk, got
            got += chunk
        kept.sendall(b"GET /ok HTTP/1.1\r\n")  # (a second request on the kept-alive connection, cut short)
        for sock in (silent, partial, kept):
            sock.settimeout(5)
            started = time.monotonic()
            assert sock.recv(4096) == b""  # closed by the server
            assert time.monotonic() - started < 4
    finally:
        server.should_exit = True
        thread.join(10)


# --- the fifth round's own sweep (benchmarks/hostile_sweep.py --only fifth) ------------------------


def test_requests_that_free_slots_will_take_are_not_refused_as_a_full_queue(tiny, monkeypatch):
    """--parallel 4 --max-queue 1: eight requests sent together got 503 "the queue is full" while
    slots were free (the worker takes waiting requests only between steps). Now a request waits
    only for what --parallel and --max-queue hold together: 4 + 1 here, the sixth is refused."""
    pytest.importorskip("fastapi")
    from cactus_cli.app.serve.serving import Busy, Server
    from cactus_cli.app.session import Session

    monkeypatch.setattr(Server, "_work", lambda self: None)  # (nothing is admitted: every request waits)
    session = Session.load(
        verifier=tiny["verifier"],
        draft=tiny["draft_close"],
        device="cpu",
        dtype="float32",
        num_draft_tokens=2,
        sequences=4,
    )
    server = Server(session, max_queue=1, parallel=4)
    ids = session.tokenizer("the cat")["input_ids"]
    for _ in range(5):
        server.submit(server.request(ids, {"max_tokens": 2}, lambda item: None))
    with pytest.raises(Busy, match=r"the queue is full \(1 requests waiting\)"):
        server.submit(server.request(ids, {"max_tokens": 2}, lambda item: None))


def test_a_schema_too_large_for_the_grammar_parser_is_the_requests_error(tiny, monkeypatch):
    """A JSON schema of 2,000 properties passes the compile check, then llguidance stops at the first
    property ("Current row has 8007 items; max is 2000"): a 500 "internal error" before, now a
    ConfigError (400) naming the limit."""
    pytest.importorskip("llguidance")
    from cactus_cli.infer.decode.grammar import Constraint

    class Stopped:
        def consume_tokens(self, tokens):
            return False

        def get_error(self):
            return "Parser Error: Current row has 8007 items; max is 2000; consider making your grammar left-recursive\n<state>"

        def is_error(self):
            return True

    constraint = Constraint.__new__(Constraint)
    constraint.matcher, constraint.eos = Stopped(), set()
    with pytest.raises(
        ConfigError, match=r"too large for the grammar parser \(Current row has 8007 items; max is 2000"
    ):
        constraint.advance([5])
    with pytest.raises(ConfigError, match="too large for the grammar parser"):
        constraint._failed("the grammar matcher failed")


def test_remeasure_keeps_a_folder_named_like_a_measurement(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cactus_cli.cli.main import app

    costs = tmp_path / "costs"
    (costs / "x.json").mkdir(parents=True)
    (costs / "m.json").write_text("{}")
    (costs / "l.json").symlink_to(costs / "nowhere")
    monkeypatch.setenv("CACTUS_HOME", str(tmp_path))
    r = CliRunner().invoke(app, ["models", "remeasure"])
    assert r.exit_code == 0 and "forgot 2 measurement(s)" in r.stdout, r.output  # ("Is a directory" before)
    assert "kept 1 folder(s) named like a measurement" in r.stderr and (costs / "x.json").is_dir()
    assert not (costs / "m.json").exists() and not (costs / "l.json").is_symlink()


def test_a_stored_thread_measurement_with_garbage_curves_is_read_as_none(tmp_path, monkeypatch):
    """A threads record whose "curves" is a list: AttributeError on every start before."""
    from cactus_cli.infer.backends.llama_cpp import gguf_layout

    path = tmp_path / "v.gguf"
    path.write_bytes(b"x" * 64)
    monkeypatch.setenv("CACTUS_HOME", str(tmp_path))
    monkeypatch.setattr(gguf_layout, "thread_candidates", lambda: [1, 2])
    key = gguf_layout._key(path, "v", "threads")
    for curves in ([1, 2], "fast", {"2": "fast"}, None):
        gguf_layout._store(
            key, {"scores": {"1": 2.0, "2": 1.0}, "curves": curves, "taken": "2026-12-05T10:00", "quiet": True}
        )
        n, why, records = gguf_layout._threads(path, "v", None)
        assert n == 2 and "measured fastest" in why
        gguf_layout._watch(path, n, records)  # (no curve to hold later verifies against: no watch)
        assert gguf_layout.watch_for(str(path), 2) is None


def test_json_output_on_a_vocabulary_that_cannot_write_json_is_a_400(tiny):
    """The word-level tiny tokenizer has no "{": response_format json_object was a 500 "internal
    error: the grammar matcher failed (NoExtensionBias)"; now refused before it is queued."""
    pytest.importorskip("fastapi")
    pytest.importorskip("llguidance")
    from cactus_cli.app.serve.serving import Server
    from cactus_cli.app.session import Session
    from tests.test_serve import httpx, start

    session = Session.load(
        verifier=tiny["verifier"], draft=tiny["draft_close"], device="cpu", dtype="float32", num_draft_tokens=2
    )
    server = Server(session, max_queue=2)
    url, stop = start(server)
    try:
        body = {"messages": [{"role": "user", "content": "the cat"}], "response_format": {"type": "json_object"}}
        r = httpx.post(f"{url}/v1/chat/completions", json=body | {"max_tokens": 8}, timeout=60)
        assert r.status_code == 400, r.text
        assert "vocabulary cannot write the requested output format" in r.json()["error"]["message"]
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "the cat", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
    finally:
        stop()
        server.stop()
