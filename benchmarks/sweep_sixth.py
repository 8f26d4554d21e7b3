"""The sixth round of hostile cases (issue 71): request bodies, lone surrogates and deep nesting,
tool results, logprobs against usage, other servers' fields, question.jsonl files, --backend vllm.

    python benchmarks/sweep_sixth.py [TREE] [--only server|cli] [--json out.json]

TREE (default: this checkout) runs as ``python -m cactus_cli`` on PYTHONPATH: ``cactus serve`` itself
on the fifth sweep's tiny pair (stderr read for tracebacks, /proc for threads, fds, memory). Every 200
is checked (calls, a logprob per counted token, what a field should change); outcomes as hostile_sweep's.
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

import hostile_sweep as hs
from sweep_fifth import TOOLS, chat, check_calls, fn, forced, logprobs_ok, make_pair, no_calls, stream_problem

X, C, PY, MIB, CRLF = "/v1/chat/completions", "/v1/completions", sys.executable, 1 << 20, "\r\n"
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [{"role": "user", "content": "weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
SECOND, NAMED = {"id": "call_2", "type": "function", "function": {"name": "set_pet", "arguments": '{"animal": "cat", "n": 2}'}}, '{"type": "function", "function": {"name": "get_weather"}}'  # fmt: skip
HARMLESS = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "reasoning_effort": "low", "modalities": ["text"], "n": 1,
            "prediction": {"type": "content", "content": "the cat"}, "cache_prompt": True, "repetition_penalty": 1.0, "logit_bias": {},
            "chat_template_kwargs": {"enable_thinking": False}, "min_p": 0.0, "frequency_penalty": 0.0, "continue_final_message": False}  # fmt: skip
# surface|name|accepted statuses|check of a 200|field a 400 names|JSON that changes a greedy chat body (max_tokens 12):
# "_c" a completion, "_t" the two tools, "_h" HISTORY with its call's "name", "arguments", "id", "result" or
# "name_of_result" changed, "_h2" two parallel calls; "@obj|list|nest|sobj:N@": JSON N deep (a schema; a string).
CASES = r"""
surrogate|a tool's description|400|-|-|{"tools": [{"type": "function", "function": {"name": "f", "description": "x\ud800"}}]} ;; surrogate|a parameter key|400|-|-|{"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"c\ud800": {"type": "string"}}}}}]}
surrogate|a parameter's description, required|400|-|-|{"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"c": {"type": "string", "description": "\ud800"}}}}}]}
surrogate|an enum value, required|400|-|-|{"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"c": {"enum": ["a", "\udfff"]}}}}}]} ;; surrogate|a call's name|400|-|-|{"_h": {"name": "get\ud800"}}
surrogate|a call's arguments (an escape in the string)|400|-|-|{"_h": {"arguments": "{\"city\": \"Par\\ud800\"}"}} ;; surrogate|a call's arguments (the character itself)|400|-|-|{"_h": {"arguments": "{\"city\": \"Par\ud800\"}"}} ;; surrogate|a call's id and its result's|200/400|-|-|{"_h": {"id": "\ud800"}}
surrogate|a tool result|200/400|calls|-|{"_h": {"result": "sun\ud800"}} ;; surrogate|a stop string|400|-|stop|{"stop": ["a\ud800"]} ;; surrogate|a stop string alone|400|-|stop|{"stop": "\ud800"} ;; surrogate|a system message|200/400|-|-|{"messages": [{"role": "system", "content": "\ud800"}, {"role": "user", "content": "hi"}]}
surrogate|an assistant message|200/400|-|-|{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "\ud800"}, {"role": "user", "content": "b"}]} ;; surrogate|a message's name|200/400|-|-|{"messages": [{"role": "user", "content": "a", "name": "\ud800"}]}
surrogate|a text part|200/400|-|-|{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]} ;; surrogate|a key of the body|400|-|-|{"k\ud800": 1} ;; surrogate|a key of a message|200/400|-|-|{"messages": [{"role": "user", "content": "a", "\ud800": 1}]}
surrogate|tool_choice's name|400|-|-|{"_t": 1, "tool_choice": {"type": "function", "function": {"name": "\ud800"}}} ;; surrogate|a json_schema's name|200/400|-|-|{"response_format": {"type": "json_schema", "json_schema": {"name": "\ud800", "schema": {"type": "object"}}}}
surrogate|a json_schema's property|400|-|-|{"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "object", "properties": {"\ud800": {"type": "string"}}}}}} ;; surrogate|metadata|200/400|same|metadata|{"metadata": {"k": "\ud800"}} ;; surrogate|user|200/400|same|user|{"user": "\ud800"}
surrogate|a completion's prompt|200/400|-|-|{"_c": 1, "prompt": "the \ud800"} ;; surrogate|a low surrogate before a high one|200/400|-|-|{"messages": [{"role": "user", "content": "\udc00\ud800"}]} ;; surrogate|chat_template_kwargs|200/400|-|chat_template_kwargs|{"chat_template_kwargs": {"k": "\ud800"}}
nesting|tool-call arguments 40 deep|200/400|calls|-|{"_h": {"arguments": "@sobj:40@"}} ;; nesting|tool-call arguments 200 deep|200/400|-|-|{"_h": {"arguments": "@sobj:200@"}} ;; nesting|tool-call arguments 3000 deep|400|-|-|{"_h": {"arguments": "@sobj:3000@"}}
nesting|tool parameters 30 deep, auto|200/400|calls_f|-|{"tools": [{"type": "function", "function": {"name": "f", "parameters": "@nest:30@"}}]} ;; nesting|tool parameters 100 deep, auto|400|-|-|{"tools": [{"type": "function", "function": {"name": "f", "parameters": "@nest:100@"}}]}
nesting|tool parameters 600 deep, required|400|-|-|{"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": "@nest:600@"}}]} ;; nesting|tool parameters 5000 deep, none|400|-|-|{"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f", "parameters": "@nest:5000@"}}]}
nesting|stop a list 100 deep|400|-|stop|{"stop": "@list:100@"} ;; nesting|metadata 500 deep|400|-|metadata|{"metadata": "@obj:500@"} ;; nesting|a json_schema 300 deep|400|-|-|{"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": "@nest:300@"}}}
nesting|message content 1000 deep|400|-|-|{"messages": [{"role": "user", "content": "@list:1000@"}]} ;; nesting|chat_template_kwargs 200 deep|400|-|chat_template_kwargs|{"chat_template_kwargs": "@obj:200@"} ;; nesting|logit_bias 300 deep|400|-|logit_bias|{"logit_bias": "@obj:300@"} ;; nesting|the whole body 100000 deep|400/422|-|-|{"_raw": "@list:100000@"}
tools|after a tool result, auto|200|calls|-|{"_h": {}, "max_tokens": 40} ;; tools|after a tool result, required|200|forced|-|{"_h": {}, "tool_choice": "required"} ;; tools|after a tool result, named|200|named|-|{"_h": {}, "tool_choice": NAMED} ;; tools|after a tool result, none|200|none|-|{"_h": {}, "tool_choice": "none", "max_tokens": 40}
tools|after two parallel results, auto|200|calls|-|{"_h2": 1, "max_tokens": 40} ;; tools|after two parallel results, required|200|forced|-|{"_h2": 1, "tool_choice": "required"} ;; tools|two results, parallel_tool_calls false|200|forced1|-|{"_h2": 1, "tool_choice": "required", "parallel_tool_calls": false}
tools|a tool result with a name|200|calls|-|{"_h": {"name_of_result": "get_weather"}} ;; tools|a tool result of empty text|200|calls|-|{"_h": {"result": ""}} ;; tools|a tool result before its call|400|-|-|{"_t": 1, "messages": [{"role": "user", "content": "w"}, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]}
tools|a doubled-brace call as assistant text|200|calls|-|{"_t": 1, "messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "{{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}}"}, {"role": "user", "content": "again"}]}
tools|required, streamed|200|streamed_forced|-|{"_t": 1, "stream": true, "tool_choice": "required", "max_tokens": 48} ;; tools|named, streamed|200|streamed_forced|-|{"_t": 1, "stream": true, "tool_choice": NAMED, "max_tokens": 48}
tools|after a tool result, required, streamed|200|streamed_forced|-|{"_h": {}, "stream": true, "tool_choice": "required", "max_tokens": 48} ;; tools|auto, streamed|200|streamed_calls|-|{"_t": 1, "stream": true, "max_tokens": 48}
tools|required, parallel on, streamed|200|streamed_forced|-|{"_t": 1, "stream": true, "tool_choice": "required", "parallel_tool_calls": true, "max_tokens": 48} ;; tools|named, a function not declared|400|-|-|{"_t": 1, "tool_choice": {"type": "function", "function": {"name": "launch"}}}
tools|required, max_tokens 1|200|calls|-|{"_t": 1, "tool_choice": "required", "max_tokens": 1} ;; logprobs|streamed, top_logprobs 0|200|lps:0|-|{LP: 0, "max_tokens": 40, "stream": true} ;; logprobs|streamed, top_logprobs 3|200|lps:3|-|{LP: 3, "max_tokens": 40, "stream": true}
logprobs|streamed, top_logprobs 20, max_tokens 8|200|lps:20|-|{LP: 20, "max_tokens": 8, "stream": true} ;; logprobs|completions logprobs 0|200|lpc:0|-|{"_c": 1, "logprobs": 0, "max_tokens": 40} ;; logprobs|completions logprobs 5|200|lpc:5|-|{"_c": 1, "logprobs": 5, "max_tokens": 40} ;; logprobs|top_logprobs 21|400|-|top_logprobs|{LP: 21}
logprobs|top_logprobs -1|400|-|top_logprobs|{LP: -1} ;; logprobs|top_logprobs without logprobs|200/400|-|logprobs|{"top_logprobs": 3} ;; logprobs|with a stop string|200|lp:2|-|{LP: 2, "stop": ["a"], "max_tokens": 60} ;; logprobs|streamed with a stop string|200|lps:1|-|{LP: 1, "stop": ["a"], "max_tokens": 60, "stream": true}
logprobs|sampled, seed 4|200|lpn|-|{LP: 2, "temperature": 1.0, "seed": 4, "max_tokens": 40} ;; logprobs|with tools required|200|lpn|-|{LP: 1, "_t": 1, "tool_choice": "required", "max_tokens": 48} ;; logprobs|with json_object|200|lpn|-|{"logprobs": true, "response_format": {"type": "json_object"}, "max_tokens": 60}
logprobs|with n 2|200/400|lpn|n|{LP: 1, "n": 2} ;; fields|modalities text and audio|400|-|modalities|{"modalities": ["text", "audio"]} ;; fields|service_tier a number|400|-|service_tier|{"service_tier": 5} ;; fields|chat_template_kwargs a list|400|-|chat_template_kwargs|{"chat_template_kwargs": [1]}
fields|frequency_penalty 2|200/400|changed|frequency_penalty|{"frequency_penalty": 2.0} ;; fields|frequency_penalty 3 (out of range)|400|-|frequency_penalty|{"frequency_penalty": 3.0} ;; fields|presence_penalty 2|200/400|changed|presence_penalty|{"presence_penalty": 2.0}
fields|repetition_penalty 3|200/400|changed|repetition_penalty|{"repetition_penalty": 3.0} ;; fields|repetition_penalty 0 (out of range)|400|-|repetition_penalty|{"repetition_penalty": 0.0} ;; fields|min_p 0.999 at temperature 1 (greedy)|200/400|same|min_p|{"min_p": 0.999, "temperature": 1.0, "seed": 5}
fields|min_p 2 (out of range)|400|-|min_p|{"min_p": 2.0} ;; fields|logit_bias -100 on the greedy letters|200/400|no_first|logit_bias|{"logit_bias": "@BAN@"} ;; fields|logit_bias +100 on 'x'|200/400|forced_x|logit_bias|{"logit_bias": {"@X@": 100}} ;; fields|logit_bias a key that is no token|400|-|logit_bias|{"logit_bias": {"abc": 1}}
fields|logit_bias 500|400|-|logit_bias|{"logit_bias": {"@X@": 500}} ;; fields|n 2|200/400|two|n|{"n": 2} ;; fields|n 0|400|-|n|{"n": 0} ;; fields|max_completion_tokens 5|200|cap:5|-|{"max_completion_tokens": 5, "max_tokens": null} ;; fields|max_completion_tokens 0|400|-|max_completion_tokens|{"max_completion_tokens": 0, "max_tokens": null}
fields|max_completion_tokens 10**9|400|-|max_completion_tokens|{"max_completion_tokens": 1000000000, "max_tokens": null} ;; fields|max_completion_tokens 5 and max_tokens 20|200/400|cap:20|max_|{"max_completion_tokens": 5, "max_tokens": 20}
fields|a final assistant message|200/400|go_on|assistant|{"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "the dog"}]}
fields|continue_final_message true|200/400|go_on|continue_final_message|{"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "the dog"}], "continue_final_message": true, "add_generation_prompt": false} ;; fields|continue_final_message without an assistant message|400|-|continue_final_message|{"continue_final_message": true}
"""


def env_for(tree: Path, tmp: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(tree), CACTUS_HOME=str(tmp / "home"), HF_HUB_OFFLINE="1")


class Served:
    """``cactus serve`` from ``tree`` on a free port of 127.0.0.1, its stderr in a file."""

    def __init__(self, tree: Path, pair: dict, tmp: Path):
        self.tree, self.pair, self.tmp, self.log, self.canary = tree, pair, tmp, tmp / "serve.log", None
        self.start()

    def start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port, self.url = s.getsockname()[1], f"http://127.0.0.1:{s.getsockname()[1]}"
        args = ["serve", "--verifier", self.pair["verifier"], "--draft", self.pair["draft"], "--port", str(self.port),
                "--parallel", "2", "--quantize", "none", "--compile", "off", "--dtype", "float32", "-k", "3"]  # fmt: skip
        self.proc = subprocess.Popen([PY, "-m", "cactus_cli", *args], env=env_for(self.tree, self.tmp), cwd=self.tmp,
                                     stdout=subprocess.DEVNULL, stderr=self.log.open("ab"))  # fmt: skip
        for _ in range(600):
            with suppress(hs.httpx.HTTPError):
                if hs.httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise SystemExit(f"the server did not start: {self.log.read_text(errors='replace')[-600:]}")

    def stats(self) -> tuple[int, int, int]:
        """(threads, open descriptors, resident MB) of the server."""
        status = dict(ln.split(":", 1) for ln in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines())
        return (
            int(status["Threads"]),
            len(os.listdir(f"/proc/{self.proc.pid}/fd")),
            int(status["VmRSS"].split()[0]) >> 10,
        )

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def wire(port: int, head: dict, parts: list, timeout: float = 60.0) -> tuple[int, str, dict | None]:
    """A request over a socket: ``head`` its headers, ``parts`` bytes to send or seconds to wait.
    (status, body, parsed 200); status 0: closed unanswered; TimeoutError: no answer at all."""
    head, data = {"Host": "x", "Content-Type": "application/json", "Connection": "close", **head}, b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"POST {X} HTTP/1.1\r\n{''.join(f'{k}: {v}{CRLF}' for k, v in head.items())}\r\n".encode())
        with suppress(BrokenPipeError, ConnectionResetError):  # (refused before the end: read the answer)
            for part in parts:
                time.sleep(part) if isinstance(part, float) else s.sendall(part)
        with suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    body = re.sub(rb"(^|\r\n)[0-9a-fA-F]+\r\n", b"", body) if b"transfer-encoding: chunked" in head.lower() else body
    status, text = (int(data.split(b" ", 2)[1]) if data else 0), body.decode("utf-8", "replace").strip()
    return status, text, json.loads(text) if status == 200 else None


def chunked(data: bytes, size: int = 4096) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(data[i : i + size]), data[i : i + size]) for i in range(0, len(data), size)] + [b"0\r\n\r\n"]  # fmt: skip


def dumps(body) -> bytes:
    """The body as JSON (lone surrogates as escapes), each "@kind:N@" string replaced by JSON N deep."""
    deep = {"obj": lambda n: '{"a": ' * n + "1" + "}" * n, "list": lambda n: "[" * n + "]" * n,
            "nest": lambda n: '{"type": "object", "properties": {"a": ' * n + '{"type": "integer"}' + "}}" * n,
            "sobj": lambda n: json.dumps('{"a": ' * n + "1" + "}" * n)}  # fmt: skip
    return re.sub(r'"@(\w+):(\d+)@"', lambda m: deep[m[1]](int(m[2])), json.dumps(body)).encode()


def post(srv: Served, body: dict | bytes, path: str = X) -> tuple[int, str, dict | None]:
    """A whole answer (status, text, doc), or a streamed one put together as doc."""
    data, stream = (body, False) if isinstance(body, bytes) else (dumps(body), body.get("stream"))
    with hs.httpx.stream("POST", srv.url + path, content=data, headers={"content-type": "application/json"},
                         timeout=60) as r:  # fmt: skip
        if r.status_code != 200 or not stream:
            text = r.read().decode("utf-8", "replace")
            return r.status_code, text, (json.loads(text) if r.status_code == 200 else None)
        got: dict = {"text": "", "calls": {}, "finish": None, "logprobs": [], "usage": None, "firsts": []}
        for line in r.iter_lines():
            doc = json.loads(line[6:]) if line.startswith("data: {") else {}
            got["usage"] = doc.get("usage") or got["usage"]
            for ch in doc.get("choices", []):
                delta = ch.get("delta", {})
                got["firsts"] += [delta.get("content")] if "content" in delta or "tool_calls" in delta else []
                got["text"] += delta.get("content") or ch.get("text") or ""
                for c in delta.get("tool_calls") or []:
                    slot = got["calls"].setdefault(c["index"], {"name": "", "arguments": ""})
                    slot["name"] += (c.get("function") or {}).get("name") or ""
                    slot["arguments"] += (c.get("function") or {}).get("arguments") or ""
                got["finish"] = ch.get("finish_reason") or got["finish"]
                got["logprobs"] += (ch.get("logprobs") or {}).get("content") or []
    return 200, json.dumps(got)[:300], got


def judge(
    srv: Served, surface: str, name: str, send, accept=(200,), check=None, names: str | None = None, limit=60
) -> None:
    """One case: ``send()`` gives (status, text, doc); classified as the fifth sweep did."""
    seen, t0, after, problem = len(srv.log.read_text(errors="replace")), time.monotonic(), None, None
    try:
        status, text, doc = send()
    except (hs.httpx.TimeoutException, TimeoutError):
        return hs.record(surface, name, "hang", "no answer in 60 s")
    except hs.httpx.TransportError as err:
        status, text, doc = -1, f"{type(err).__name__}: {err}", None
    took = time.monotonic() - t0
    with suppress(hs.httpx.HTTPError, TypeError):
        after = content(post(srv, chat(max_tokens=12))[2]) if srv.proc.poll() is None else None
    logged = srv.log.read_text(errors="replace")[seen:]  # (after the canary: what the server logs late counts too)
    try:
        problem = check(doc) if status == 200 and check else None
    except (KeyError, TypeError, IndexError, ValueError) as err:
        problem = f"answer not in its shape: {type(err).__name__} {err}: {text[:160]}"
    if status >= 500 or "Traceback" in logged:
        hs.record(surface, name, "traceback", f"{status} {text[:120]} {logged.strip()[-160:]}")
    elif status == -1 or after != srv.canary:
        hs.record(surface, name, "lost", f"{text[:120]}; the canary after it: {after!r}")
        if after is None:  # (it died: a new one for the cases after)
            srv.stop(), srv.start()
    elif took > limit:
        hs.record(surface, name, "hang", f"answered after {took:.0f} s")
    elif status not in accept or problem:
        hs.record(surface, name, "wrong", problem or f"{status} (expected {accept}) {text[:150]}")
    elif status not in (0, 200, 408, 411, 413) and (bad := hs.one_line_error(status, text)):
        hs.record(surface, name, "wrong", bad)
    elif status == 400 and names and names not in text:
        hs.record(surface, name, "wrong", f"a 400 that does not name {names}: {text[:150]}")
    else:
        hs.record(surface, name, "fine", f"{status} {text[:100]}")


def content(doc: dict) -> str:
    return doc["choices"][0]["message"]["content"] if "message" in doc["choices"][0] else doc["choices"][0]["text"]


def build(spec: str, srv: Served) -> tuple[str, dict | bytes]:
    """A case of CASES as (path, body)."""
    spec = spec.replace("{LP:", '{"logprobs": true, "top_logprobs":').replace("NAMED", NAMED)
    case = json.loads(spec.replace('"@BAN@"', srv.ban).replace("@X@", str(srv.x)))
    if "_raw" in case:
        return X, dumps(case["_raw"])
    path, body = (C, {"prompt": "the cat", "temperature": 0}) if case.pop("_c", 0) else (X, chat())
    body.update(max_tokens=12, **({"tools": TOOLS} if case.pop("_t", 0) else {}))
    if (h := case.pop("_h", None)) is not None or case.pop("_h2", 0):
        msgs = json.loads(json.dumps(HISTORY))
        call, result = msgs[1]["tool_calls"][0], msgs[2]
        for key, value in (h or {}).items():
            call.update({"id": value} if key == "id" else {})
            slot = {"id": "tool_call_id", "result": "content", "name_of_result": "name"}.get(key)
            (result.__setitem__(slot, value) if slot else call["function"].__setitem__(key, value))
        if h is None:  # (two parallel calls, two results)
            msgs[1]["tool_calls"].append(SECOND)
            msgs.append({"role": "tool", "tool_call_id": "call_2", "content": "done"})
        body.update(messages=msgs, tools=TOOLS)
    body.update(case, **({"stream_options": {"include_usage": True}} if case.get("stream") else {}))
    return path, {k: v for k, v in body.items() if v is not None}


def checks(srv: Served, tok) -> dict:
    """The checks of a 200 that CASES name."""
    base = srv.canary
    msgs = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "the dog"}]
    closed = len(tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))["input_ids"])

    def streamed_calls(g: dict) -> str | None:
        if g["calls"] and any(g["firsts"][:1]):
            return f"a streamed call's first delta carries content {g['firsts'][0]!r} (null in the whole answer)"
        return stream_problem(g, {})

    def lps(g: dict, top: int) -> str | None:
        if len(g["logprobs"]) != (n := (g["usage"] or {}).get("completion_tokens")):
            return f"{len(g['logprobs'])} streamed logprobs for {n} counted tokens"
        bad = [e for e in g["logprobs"] if len(e.get("top_logprobs") or []) != top]
        return f"{len(bad[0]['top_logprobs'])} alternatives where {top} were asked" if bad else None

    def lpn(d: dict) -> str | None:
        n, got = d["usage"]["completion_tokens"], sum(len(c["logprobs"]["content"]) for c in d["choices"])
        return None if got == n else f"{got} logprobs for {n} counted tokens"

    out = {
        "calls": lambda d: check_calls(d, TOOLS), "calls_f": lambda d: check_calls(d, [fn("f")]), "none": no_calls,
        "forced": forced(TOOLS), "forced1": forced(TOOLS, one=True), "named": forced(TOOLS, "get_weather"),
        "streamed_calls": streamed_calls, "lpn": lpn,
        "streamed_forced": lambda g: streamed_calls(g) or (None if g["calls"] or g["finish"] == "length" else "no call streamed where one was forced"),
        "same": lambda d: None if content(d) == base else f"the answer changed: {content(d)!r} vs {base!r}",
        "changed": lambda d: f"ignored: {base!r} as without it" if content(d) == base and len(set(base)) < len(base) else None,
        "no_first": lambda d: None if content(d) != base or srv.ban == "{}" else f"bias ignored: {content(d)!r}",
        "forced_x": lambda d: None if content(d).startswith("x") else f"bias ignored: {content(d)!r}",
        "two": lambda d: None if [c["message"]["content"] for c in d["choices"]] == [base] * 2 else "n 2: not 2 answers",
        "go_on": lambda d: None if d["usage"]["prompt_tokens"] < closed - 2 else (
            f"the final assistant message was closed and a new turn begun ({d['usage']['prompt_tokens']} prompt "
            f"tokens, {closed} closed)"),
    }  # fmt: skip
    for k in (0, 1, 2, 3, 5, 20):
        out |= {f"lp:{k}": logprobs_ok(k), f"lpc:{k}": logprobs_ok(k, chat_api=False), f"lps:{k}": lambda g, k=k: lps(g, k),
                f"cap:{k}": lambda d, k=k: None if d["usage"]["completion_tokens"] <= k else f"{d['usage']} past {k}"}  # fmt: skip
    return out


def body_round(srv: Served, same) -> None:
    ok, te, cl = dumps(chat(max_tokens=12)), {"Transfer-Encoding": "chunked"}, lambda n: {"Content-Length": str(n)}
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (9 * MIB) + b'"}]}'
    cases = [
        ("chunked, no Content-Length", te, chunked(ok), (200, 411)),
        ("chunked in 1-byte chunks", te, chunked(ok, 1), (200, 411)),
        ("chunked with an extension and a trailer", te, [b"%x;x=1\r\n%s\r\n0\r\nX-T: 1\r\n\r\n" % (len(ok), ok)], (200, 400, 411)),
        ("chunked and a matching Content-Length", {**te, **cl(len(ok))}, chunked(ok), (200, 400)),
        ("chunked and Content-Length 5", {**te, **cl(5)}, chunked(ok), (400,)),
        ("chunked 9 MiB, no Content-Length", te, chunked(big, MIB), (411, 413)),
        ("chunked 9 MiB, Content-Length 10", {**te, **cl(10)}, chunked(big, MIB), (400, 413)),
        ("chunked 20 MiB, Content-Length 10", {**te, **cl(10)}, chunked(big, MIB) * 2, (400, 413)),
        ("Transfer-Encoding gzip, chunked", {"Transfer-Encoding": "gzip, chunked"}, chunked(ok), (400, 411, 501)),
        ("two different Content-Lengths", {"Content-Length": f"{len(ok)}\r\nContent-Length: 3"}, [ok], (400,)),
        ("Content-Length 8 MiB + 1, sent", cl(8 * MIB + 1), [b" " * (8 * MIB + 1)], (413,)),
        ("Content-Length 9 MiB, nothing sent", cl(9 * MIB), [], (413,)),
        ("Expect: 100-continue, chunked", {**te, "Expect": "100-continue"}, chunked(ok), (200, 411)),
        ("a chunk size that is not hex", te, [b"zz\r\n{}\r\n0\r\n\r\n"], (400, 411)),
        ("a chunk longer than its size", te, [b"2\r\n{}{}\r\n0\r\n\r\n"], (400, 411)),
    ]  # fmt: skip
    rss0 = srv.stats()[2]
    for name, head, parts, accept in cases:  # (memory: the first case after which the server holds 300 MB more)
        judge(srv, "body", name, lambda: wire(srv.port, head, parts), accept, same)
        if (grew := srv.stats()[2] - rss0) > 300:
            hs.record("body", f"{name}: memory held after it", "security", f"the server grew by {grew} MB and kept it")
            rss0 = float("inf")
    stalls = [
        ("a body that stalls after 20 of its bytes", cl(len(ok)), [ok[:20]]),
        ("a chunked body that stalls after one chunk", te, chunked(ok, 20)[:1]),
        ("headers, then no body at all", cl(50), []),
        ("a body sent one byte per 8 s", cl(len(ok)), [p for b in ok[:12] for p in (bytes([b]), 8.0)]),
    ]  # fmt: skip
    fds0 = srv.stats()[1]
    with ThreadPoolExecutor(len(stalls)) as pool:  # (all at once: each answered 408 or closed in 80 s, else a hang)
        futures = [pool.submit(wire, srv.port, head, parts, 80) for _, head, parts in stalls]
        for (name, _, _), future in zip(stalls, futures):
            judge(srv, "body", name, future.result, (408, 411, 0), limit=90)
    time.sleep(3)
    fds1 = srv.stats()[1]
    hs.record("body", "descriptors after the stalled bodies", "fine" if fds1 <= fds0 + 2 else "leak", f"{fds0}->{fds1}")


def server_round(tree: Path, tmp: Path) -> None:
    from transformers import AutoTokenizer

    srv = Served(tree, pair := make_pair(tmp / "pair"), tmp)
    try:
        srv.canary = content(post(srv, chat(max_tokens=12))[2])
        tok = AutoTokenizer.from_pretrained(pair["verifier"])
        srv.x, srv.ban = tok.convert_tokens_to_ids("x"), json.dumps({tok.convert_tokens_to_ids(c): -100 for c in srv.canary if c.isascii() and c.isalnum()})  # fmt: skip
        threads0, fds0, _ = srv.stats()
        body_round(srv, (named := checks(srv, tok))["same"])
        generated = [f"fields|{k} {json.dumps(v)}|200/400|same|{k}|{json.dumps({k: v})}" for k, v in HARMLESS.items()]
        generated += [f'logprobs|top_logprobs {k}, max_tokens {m}|200|lp:{k}|-|{{LP: {k}, "max_tokens": {m}}}'
                      for k in (0, 1, 5, 20) for m in (6, 40)]  # fmt: skip
        for line in generated + re.split(r" ;; |\n", CASES.strip()):
            surface, name, accept, check, field, spec = line.split("|", 5)
            path, body = build(spec, srv)
            judge(srv, surface, name, lambda: post(srv, body, path), tuple(map(int, accept.split("/"))),
                  named.get(check), None if field == "-" else field)  # fmt: skip
        threads1, fds1, _ = srv.stats()
        hs.record("fields", "threads and descriptors after every server case", "fine" if fds1 <= fds0 + 2 and
                  threads1 <= threads0 + 4 else "leak", f"threads {threads0}->{threads1}, fds {fds0}->{fds1}")  # fmt: skip
    finally:
        srv.stop()


Q1, Q2, A1 = '{"question_id": 81, "category": "writing", "turns": ["the cat", "and the dog"]}', '{"question_id": 82, "category": "math", "turns": ["the mat"]}', '{"question_id": 7, "category": "math", "turns": ["the cat", "and the dog"], "answer": "4"}'  # fmt: skip
# command|extra arguments|what must happen ("ok": a report of each category; "err:N": one error line naming
# FILE:N and the field)|the field|the file, as a JSON string (Q1, Q2, A1: the rows above)
FILES = r"""
bench||ok|-|"Q1\nQ2\n" ;; bench|--concurrency 2|ok|-|"Q1\nQ2\nQ1\n" ;; bench||ok|-|"Q1\r\nQ2\r\n" ;; bench||ok/err:1|-|"\ufeffQ1\nQ2\n" ;; bench||ok|-|"\nQ1\n\n   \nQ2\n" ;; bench||ok|-|"{\"question_id\": 1, \"category\": \"writing\", \"turns\": [\"le chat \ud83d\udc08 \u00fcber\", \"\u65e5\u672c\"]}\n"
bench||ok|-|"{\"question_id\": 101, \"category\": \"math\", \"turns\": [\"2+2?\"], \"reference\": [\"4\"]}\n" ;; bench||ok|-|"{\"question_id\": \"q1\", \"turns\": [\"the cat\"]}\n" ;; bench|--concurrency 3|ok|-|"{\"turns\": [\"a\", \"b\", \"c\"], \"category\": \"roleplay\"}\nQ2\nQ1\n" ;; bench|--category math|ok|-|"Q1\nQ2\n"
bench||ok/err:2|question_id|"Q1\nQ1\n" ;; bench||ok/err:1|-|"{\"question_id\": 1, \"category\": \"writing\", \"turns\": [\"@HUGE@\"]}\n" ;; bench||err:1|turns|"{\"question_id\": 1, \"category\": \"writing\", \"turns\": []}\n" ;; bench||err:1|turns|"{\"question_id\": 1, \"category\": \"writing\", \"turns\": \"the cat\"}\n"
bench||err:1|turns|"{\"question_id\": 1, \"category\": \"writing\", \"turns\": [1]}\n" ;; bench||err:1|turns|"{\"question_id\": 1, \"category\": \"writing\", \"turns\": [\"\"]}\n" ;; bench||err:1|turns|"{\"question_id\": 1, \"category\": \"writing\", \"turns\": [null]}\n"
bench||err:1|turns|"{\"question_id\": 1, \"category\": \"writing\", \"turns\": {\"a\": 1}}\n" ;; bench||err:1|turns|"{\"question_id\": 1, \"category\": \"writing\", \"turns\": [\"a\", [\"b\"]]}\n" ;; bench||err:1|question_id|"{\"question_id\": 1.5, \"category\": \"writing\", \"turns\": [\"a\"]}\n"
bench||err:1|question_id|"{\"question_id\": [1], \"category\": \"writing\", \"turns\": [\"a\"]}\n" ;; bench||err:1|question_id|"{\"question_id\": null, \"category\": \"writing\", \"turns\": [\"a\"]}\n" ;; bench||err:1|question_id|"{\"question_id\": true, \"category\": \"writing\", \"turns\": [\"a\"]}\n"
bench||err:1|question_id|"{\"question_id\": {}, \"category\": \"writing\", \"turns\": [\"a\"]}\n" ;; bench||err:1|category|"{\"question_id\": 1, \"category\": 5, \"turns\": [\"a\"]}\n" ;; bench||err:1|category|"{\"question_id\": 1, \"category\": \"\", \"turns\": [\"a\"]}\n"
bench||err:1|category|"{\"question_id\": 1, \"category\": null, \"turns\": [\"a\"]}\n" ;; bench||err:1|category|"{\"question_id\": 1, \"category\": [\"a\"], \"turns\": [\"a\"]}\n" ;; bench||err:1|prompt|"{\"question_id\": 1, \"prompt\": \"the cat\", \"turns\": [\"a\"]}\n"
bench||err:3|turns|"Q1\nQ2\n{\"question_id\": 3, \"category\": \"math\", \"turns\": []}\n" ;; bench|--concurrency 2|err:2|turns|"Q1\n{\"question_id\": 3, \"turns\": [\"a\", 2]}\n" ;; bench||err:1|-|"[\"the cat\"]\n" ;; bench||err:2|-|"Q1\n{\"question_id\": 3, \"turns\":\n" ;; bench||err:0|-|"" ;; calibrate|--limit 2|ok|-|"Q1\nQ2\n"
calibrate||err:1|turns|"{\"question_id\": 1, \"category\": \"writing\", \"turns\": []}\n" ;; calibrate||err:2|category|"Q1\n{\"question_id\": 1, \"category\": 0, \"turns\": [\"a\"]}\n" ;; eval||err:1|answer|"Q1\nQ2\n" ;; eval||ok|-|"A1\n" ;; eval||err:1|turns|"{\"question_id\": 1, \"turns\": [], \"answer\": \"4\"}\n"
eval||err:1|turns|"{\"turns\": [\"a\"], \"test\": \"x\", \"entry_point\": \"f\"}\n"
"""


# a --backend vllm case: the command's arguments, then what CACTUS_VLLM_ARGS holds (- for unset)
VLLM = """generate "the cat"|-;bench --limit 1|-;serve --port 18123|-;chat|-;calibrate --limit 1|-;eval --limit 1|-
generate "the cat" --quantize w8a8|-;generate "the cat" --compile on|-;generate "the cat" --tp 2|-;bench --limit 1 --rules tas|-
generate "the cat" --draft suffix|-;generate "the cat" --rule tas|-;generate "the cat" --rule topk|-;serve --port 18123 --tp 2|-
bench --limit 1 --concurrency 2|-;serve --port 18123 --quantize w8a8|-;serve --port 18123 --draft suffix|-;chat --rule topk|-
generate "the cat" --draft none|-;generate "the cat"|{bad;generate "the cat"|[1];serve --port 18123|{"model": 5}
bench --limit 1|{"tensor_parallel_size": "x"};eval --limit 1 --compile on|-;calibrate --limit 1 --rule tas|-"""


def cli_round(tree: Path, tmp: Path) -> None:
    pair = make_pair(tmp / "cli-pair")
    model = ["--verifier", pair["verifier"], "--draft", pair["draft"], "-n", "4"]
    fast = [*model, "--quantize", "none", "--compile", "off", "--dtype", "float32", "-k", "3"]
    for i, line in enumerate(re.split(r" ;; |\n", FILES.strip())):
        cmd, extra, want, field, text = line.split("|", 4)
        text = json.loads(text).replace("Q1", Q1).replace("Q2", Q2).replace("A1", A1).replace("@HUGE@", "a " * 100_000)
        (path := tmp / f"q{i}.jsonl").write_bytes(text.encode("utf-8", "surrogatepass"))
        rows = [json.loads(r) for r in text.lstrip("\ufeff").splitlines() if r.strip()] if "ok" in want else []
        cats = {r.get("category", "default") for r in rows if "--category" not in extra or r.get("category") == "math"}
        turns = sum(len(r["turns"]) for r in rows if r.get("category", "default") in cats)
        args = [cmd, "--tasks" if cmd == "eval" else "--prompts", str(path), *fast, *extra.split(), "--json", *(["--rules", "sps"] if cmd == "bench" else [])]  # fmt: skip
        run_cli("prompts", f"{cmd} {extra} ({want}, {field}): {text[:70]!r}", tree, tmp, args, want, field, path.name,
                (lambda out: bench_problem(out, cats, turns)) if cmd == "bench" else None)  # fmt: skip
    for case in VLLM.replace("\n", ";").split(";"):
        args, env = case.split("|")
        argv = [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', args)] + ["--backend", "vllm"]
        argv += model if "--draft" not in args else model[:2]
        name = f"{args} --backend vllm" + ("" if env == "-" else f", CACTUS_VLLM_ARGS={env}")
        run_cli("vllm", name, tree, tmp, argv, "err", "/".join(["vllm", *re.findall(r"--[\w-]+", args)]), None, None, {} if env == "-" else {"CACTUS_VLLM_ARGS": env})  # fmt: skip


def bench_problem(out: str, cats: set, turns: int) -> str | None:
    """A bench report: every configuration reports each category, with at most 4 tokens a turn."""
    rs = json.loads(out)["results"]
    bad = [r for r in rs if set(r.get("by_category") or ()) != cats or not 0 < r["num_output_tokens"] <= 4 * turns]
    return f"{bad[0]['config']}: {bad[0]['num_output_tokens']} tokens, categories {sorted(bad[0].get('by_category') or ())} ({turns} turns of {sorted(cats)})" if bad else None  # fmt: skip


def run_cli(surface, name, tree, tmp, args, want, field, fname, check, env_over=None) -> None:
    """One command; ``want``: "ok" (exit 0, ``check`` passes), "err:N" (one error line naming FILE:N
    and ``field``, a non-zero exit, no traceback), or "ok/err:N" either."""
    try:
        p = subprocess.run([PY, "-m", "cactus_cli", *args], env={**env_for(tree, tmp), **(env_over or {})}, cwd=tmp,
                           capture_output=True, timeout=240, stdin=subprocess.DEVNULL)  # fmt: skip
    except subprocess.TimeoutExpired:
        return hs.record(surface, name, "hang", "no exit in 240 s")
    err, out = p.stderr.decode("utf-8", "replace").strip(), p.stdout.decode("utf-8", "replace")
    lines = [ln for ln in err.splitlines() if ln.startswith("error")]
    msg = (lines or err.splitlines()[-1:] or [""])[0]
    where = f"{fname}:{want.rsplit(':', 1)[1]}" if fname and ":" in want and not want.endswith(":0") else ""
    if "Traceback" in err:
        return hs.record(surface, name, "traceback", err.splitlines()[-1][:200])
    if p.returncode == 0 and "ok" in want:
        try:
            problem = check(out) if check else None
        except (ValueError, KeyError, TypeError) as e:
            problem = f"not the report expected: {type(e).__name__} {e}"
        return hs.record(surface, name, "wrong" if problem else "fine", problem or out.strip()[-100:])
    if p.returncode == 0 or "err" not in want:
        return hs.record(surface, name, "wrong", f"exit {p.returncode}, expected {want}: {err[-200:]}")
    if len(lines) != 1 and "Usage" not in err:
        return hs.record(surface, name, "wrong", f"not one error line: {err[-200:]}")
    if where not in msg or field != "-" and not any(f.lower() in err.lower() for f in field.split("/")):
        return hs.record(surface, name, "wrong", f"does not name {where} {field}: {msg[:200]}")
    hs.record(surface, name, "fine", f"exit {p.returncode}: {msg[:150]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", nargs="?", type=Path, default=hs.ROOT)
    ap.add_argument("--only", choices=("server", "cli"))
    ap.add_argument("--json", type=Path)
    sys.path.insert(0, str(tree := (a := ap.parse_args()).tree.resolve()))  # (its tests/conftest.py makes the pair)
    with tempfile.TemporaryDirectory(prefix="cactus-sixth-") as tmp:
        (Path(tmp) / "home").mkdir()
        if a.only in (None, "server"):
            server_round(tree, Path(tmp))
        if a.only in (None, "cli"):
            cli_round(tree, Path(tmp))
    kinds = ("fine", "traceback", "hang", "wrong", "lost", "leak", "security")
    print(f"\n| surface | cases | {' | '.join(kinds)} |\n|---|---|{'---|' * len(kinds)}")
    for surface in ("body", "surrogate", "nesting", "tools", "logprobs", "fields", "prompts", "vllm", None):
        rows = [r for r in hs.RESULTS if surface is None or r.surface == surface]
        print(f"| {surface or 'all'} | {len(rows)} | {' | '.join(str(sum(r.outcome == k for r in rows)) for k in kinds)} |")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps([vars(r) for r in hs.RESULTS], indent=2))


if __name__ == "__main__":
    main()
