"""The fifth round of hostile cases (``hostile_sweep.py --only fifth``): the surface added since the
fourth: slots and concurrency (``--parallel``), tool calls, JSON output, log-probabilities and the
measured choices (``cactus models remeasure``, stored conditions, garbage in the stores).

Every answer that comes back 200 is checked, not only its status: tool calls parse and validate
against their tool's schema, JSON answers that ended validate against theirs, log-probabilities are
finite, at most 0, sorted, the greedy token first, and greedy answers under concurrency equal the
same requests' answers alone. A tiny byte-level pair (every character a token, so grammars can be
kept) with a Hermes tools section in its chat template; a llama.cpp tiny GGUF for the stores.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

X, C = "/v1/chat/completions", "/v1/completions"
PARALLEL = 4

TEMPLATE = (
    "{%- if tools %}<s>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    'Call a tool as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call></s>\n{% endif %}'
    "{% for m in messages %}<s>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
PET = {
    "type": "object",
    "properties": {"animal": {"type": "string", "enum": ["cat", "dog", "bird"]}, "n": {"type": "integer"}},
    "required": ["animal", "n"],
    "additionalProperties": False,
}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def fn(name: str, params: dict | None = None, **kw) -> dict:
    f = {"name": name, **kw}
    if params is not None:
        f["parameters"] = params
    return {"type": "function", "function": f}


TOOLS = [fn("set_pet", PET), fn("get_weather", CITY, description="The weather in a city")]
P = "the cat"


def chat(content: str = P, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 48, "temperature": 0, **kw}


def comp(prompt: str = P, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": 24, "temperature": 0, **kw}


def schema_fmt(schema: Any, **kw) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, **kw}}


# ------------------------------------------------------------------------------------ checks


def valid(doc: Any, schema: dict) -> bool:
    """The part of JSON Schema these cases use."""
    if not isinstance(schema, dict):
        return True
    if "enum" in schema and doc not in schema["enum"]:
        return False
    kind = schema.get("type")
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind == "integer" and not (isinstance(doc, int) and not isinstance(doc, bool)):
        return False
    if kind == "number" and not (isinstance(doc, (int, float)) and not isinstance(doc, bool)):
        return False
    if kind in kinds and not isinstance(doc, kinds[kind]):
        return False
    if isinstance(doc, (int, float)) and not isinstance(doc, bool):
        if "minimum" in schema and doc < schema["minimum"] or "maximum" in schema and doc > schema["maximum"]:
            return False
    if isinstance(doc, str):
        if len(doc) < schema.get("minLength", 0) or len(doc) > schema.get("maxLength", 1 << 60):
            return False
    if isinstance(doc, dict):
        props = schema.get("properties", {})
        if any(k not in doc for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and any(k not in props for k in doc):
            return False
        return all(valid(v, props[k]) for k, v in doc.items() if k in props)
    if isinstance(doc, list) and isinstance(schema.get("items"), dict):
        return all(valid(v, schema["items"]) for v in doc)
    return True


def check_calls(body: dict, tools: list[dict], *, named: str | None = None, one: bool = False) -> str | None:
    """The answer's tool calls: ids, declared names, JSON arguments valid against their schema."""
    choice = body["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    for c in calls:
        if not c.get("id") or c.get("type") != "function" or c["function"]["name"] not in schemas:
            return f"a malformed call: {c}"
        if named and c["function"]["name"] != named:
            return f"a call to {c['function']['name']} where {named} was forced"
        try:
            args = json.loads(c["function"]["arguments"])
        except (ValueError, TypeError):
            return f"arguments not JSON: {c['function']['arguments']!r}"
        if not valid(args, schemas[c["function"]["name"]]):
            return f"arguments against the schema: {args}"
    if calls and choice["finish_reason"] not in ("tool_calls", "length"):
        return f"calls with finish_reason {choice['finish_reason']}"
    if one and len(calls) > 1:
        return f"{len(calls)} calls with parallel_tool_calls false"
    return None


def forced(tools: list[dict], named: str | None = None, one: bool = False) -> Callable[[dict], str | None]:
    def check(body: dict) -> str | None:
        choice = body["choices"][0]
        if choice["finish_reason"] != "length" and not choice["message"].get("tool_calls"):
            return f"no call although one was forced: {choice['message']}"
        return check_calls(body, tools, named=named, one=one)

    return check


def no_calls(body: dict) -> str | None:
    return f"calls with tool_choice none: {body}" if body["choices"][0]["message"].get("tool_calls") else None


def json_answer(schema: dict | None) -> Callable[[dict], str | None]:
    def check(body: dict) -> str | None:
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        if choice["finish_reason"] != "stop":
            return None  # (cut by max_tokens: nothing to validate)
        try:
            doc = json.loads(text)
        except ValueError:
            return f"not JSON: {text[:120]!r}"
        if not isinstance(doc, dict) or (schema and not valid(doc, schema)):
            return f"against the schema: {text[:120]!r}"
        return None

    return check


def logprobs_ok(top: int, chat_api: bool = True) -> Callable[[dict], str | None]:
    def check(body: dict) -> str | None:
        choice = body["choices"][0]
        lp = choice.get("logprobs")
        if lp is None:
            return "no logprobs"
        if chat_api:
            items = [
                (e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
                for e in lp["content"]
            ]
        else:
            tops = lp.get("top_logprobs") or [{}] * len(lp["tokens"])
            items = [
                (t, v, sorted(o.items(), key=lambda kv: -kv[1]))
                for t, v, o in zip(lp["tokens"], lp["token_logprobs"], tops)
            ]
        if len(items) != body["usage"]["completion_tokens"]:
            return f"{len(items)} log-probabilities for {body['usage']['completion_tokens']} tokens"
        for token, value, alts in items:
            if not (math.isfinite(value) and value <= 1e-6):
                return f"log-probability {value} for {token!r}"
            # (completions key the alternatives by text: tokens that decode alike collapse, as at OpenAI)
            if len(alts) != top and not (not chat_api and 1 <= len(alts) <= top):
                return f"{len(alts)} alternatives where {top} were asked"
            values = [v for _, v in alts]
            if values != sorted(values, reverse=True) or any(not math.isfinite(v) or v > 1e-6 for v in values):
                return f"alternatives not sorted or not log-probabilities: {alts}"
            if alts and value < values[0] - 1e-4:  # (greedy: the emitted token is the most likely)
                return f"greedy emitted {token!r} ({value}) below {alts[0]}"
        return None

    return check


# ------------------------------------------------------------------------------------ the server


def server_cases() -> list[tuple]:
    """(surface, name, path, body, accepted statuses, check of a 200 body or None)."""
    t = TOOLS
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]

    def hist(**changes) -> dict:
        msgs = json.loads(json.dumps(history))
        for path, value in changes.items():
            i, key = path.split(".", 1)
            target = msgs[int(i)]
            if key == "call":
                target["tool_calls"][0] = value
            elif value is ...:
                target.pop(key, None)
            else:
                target[key] = value
        return {"messages": msgs, "max_tokens": 16, "temperature": 0, "tools": t}

    named = {"type": "function", "function": {"name": "set_pet"}}
    out = [
        ("tools", "auto with two tools", X, chat(tools=t), (200,), lambda b: check_calls(b, t)),
        ("tools", "required", X, chat(tools=t, tool_choice="required"), (200,), forced(t)),
        ("tools", "named set_pet", X, chat(tools=t, tool_choice=named), (200,), forced(t, "set_pet")),
        ("tools", "none", X, chat(tools=t, tool_choice="none"), (200,), no_calls),
        (
            "tools",
            "required, parallel calls off",
            X,
            chat(tools=t, tool_choice="required", parallel_tool_calls=False),
            (200,),
            forced(t, one=True),
        ),
        (
            "tools",
            "required, parallel calls on",
            X,
            chat(tools=t, tool_choice="required", parallel_tool_calls=True),
            (200,),
            forced(t),
        ),
        (
            "tools",
            "required, temperature 1.5 seed 3",
            X,
            chat(tools=t, tool_choice="required", temperature=1.5, seed=3, max_tokens=120),
            (200,),
            forced(t),
        ),
        (
            "tools",
            "required, rule cactus delta 2",
            X,
            chat(tools=t, tool_choice="required", rule="cactus", delta=2.0),
            (200,),
            forced(t),
        ),
        ("tools", "required, draft none", X, chat(tools=t, tool_choice="required", draft="none"), (200,), forced(t)),
        (
            "tools",
            "required, num_draft_tokens 8",
            X,
            chat(tools=t, tool_choice="required", num_draft_tokens=8),
            (200,),
            forced(t),
        ),
        (
            "tools",
            "required, num_draft_tokens auto",
            X,
            chat(tools=t, tool_choice="required", num_draft_tokens="auto"),
            (200,),
            forced(t),
        ),
        (
            "tools",
            "required, max_tokens 3 (cut inside the call)",
            X,
            chat(tools=t, tool_choice="required", max_tokens=3),
            (200,),
            lambda b: check_calls(b, t),
        ),
        (
            "tools",
            "required, a stop string inside the call",
            X,
            chat(tools=t, tool_choice="required", stop=['"n"']),
            (200,),
            lambda b: check_calls(b, t),
        ),
        (
            "tools",
            "required with logprobs",
            X,
            chat(tools=t, tool_choice="required", logprobs=True, top_logprobs=2),
            (200,),
            forced(t),
        ),
        (
            "tools",
            "required with response_format json_object",
            X,
            chat(tools=t, tool_choice="required", response_format={"type": "json_object"}),
            (200, 400),
            forced(t),
        ),
        ("tools", "tools []", X, chat(tools=[]), (200,), no_calls),
        ("tools", "tools null", X, chat(tools=None), (200,), no_calls),
        ("tools", "tools [] and tool_choice none", X, chat(tools=[], tool_choice="none"), (200,), no_calls),
        ("tools", "tool_choice auto without tools", X, chat(tool_choice="auto"), (200,), no_calls),
        ("tools", "tool_choice required without tools", X, chat(tool_choice="required"), (400,), None),
        ("tools", "tool_choice named without tools", X, chat(tool_choice=named), (400,), None),
        ("tools", "parallel_tool_calls a word", X, chat(tools=t, parallel_tool_calls="yes"), (400,), None),
        (
            "tools",
            "parallel_tool_calls null",
            X,
            chat(tools=t, parallel_tool_calls=None),
            (200,),
            lambda b: check_calls(b, t),
        ),
        ("tools", "a tool of type retrieval", X, chat(tools=[{"type": "retrieval"}]), (400,), None),
        (
            "tools",
            "a function without a name",
            X,
            chat(tools=[{"type": "function", "function": {"parameters": CITY}}]),
            (400,),
            None,
        ),
        ("tools", "a name of 65 characters", X, chat(tools=[fn("f" * 65, CITY)]), (400,), None),
        ("tools", "a name with non-ASCII letters", X, chat(tools=[fn("météo", CITY)]), (400,), None),
        ("tools", "two tools of one name", X, chat(tools=[fn("f", CITY), fn("f", PET)]), (400,), None),
        ("tools", "parameters a list", X, chat(tools=[fn("f", [1, 2])]), (400,), None),
        (
            "tools",
            "parameters without properties, required",
            X,
            chat(tools=[fn("ping", {"type": "object"})], tool_choice="required"),
            (200,),
            forced([fn("ping", {"type": "object"})]),
        ),
        (
            "tools",
            "no parameters at all, required",
            X,
            chat(tools=[fn("ping")], tool_choice="required"),
            (200,),
            forced([fn("ping")]),
        ),
        (
            "tools",
            "a recursive $ref schema",
            X,
            chat(
                tools=[
                    fn("tree", {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}})
                ],
                tool_choice="required",
            ),
            (200, 400),
            lambda b: check_calls(b, [fn("tree", {"type": "object"})]),
        ),
        (
            "tools",
            "a catastrophic regex pattern",
            X,
            chat(
                tools=[
                    fn(
                        "f",
                        {
                            "type": "object",
                            "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}},
                            "required": ["s"],
                        },
                    )
                ],
                tool_choice="required",
            ),
            (200, 400),
            None,
        ),
        (
            "tools",
            "an enum of 1,000 strings",
            X,
            chat(
                tools=[
                    fn(
                        "f",
                        {
                            "type": "object",
                            "properties": {"s": {"enum": [f"v{i}" for i in range(1000)]}},
                            "required": ["s"],
                        },
                    )
                ],
                tool_choice="required",
            ),
            (200, 400),
            None,
        ),
        ("tools", "129 tools", X, chat(tools=[fn(f"f{i}", CITY) for i in range(129)]), (200, 400), None),
        (
            "tools",
            "a description of 100k characters",
            X,
            chat(tools=[fn("f", CITY, description="x" * 100_000)]),
            (400,),
            None,
        ),
        (
            "tools",
            "tool_choice a function without its name",
            X,
            chat(tools=t, tool_choice={"type": "function"}),
            (400,),
            None,
        ),
        (
            "tools",
            "tool_choice a name that is a number",
            X,
            chat(tools=t, tool_choice={"type": "function", "function": {"name": 5}}),
            (400,),
            None,
        ),
        ("tools", "tool_choice an empty object", X, chat(tools=t, tool_choice={}), (400,), None),
        ("tools", "tools on /v1/completions", C, comp(tools=t, tool_choice="required"), (400,), None),
        ("tools", "a call and its result in the history", X, hist(), (200,), lambda b: check_calls(b, t)),
        ("tools", "a tool result for an unknown call id", X, hist(**{"2.tool_call_id": "nope"}), (400,), None),
        ("tools", "a tool result without its call id", X, hist(**{"2.tool_call_id": ...}), (200, 400), None),
        (
            "tools",
            "arguments an object, not a string",
            X,
            hist(**{"1.call": {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}}),
            (200, 400),
            None,
        ),
        (
            "tools",
            "arguments not JSON",
            X,
            hist(**{"1.call": {**call, "function": {"name": "get_weather", "arguments": "{city"}}}),
            (400,),
            None,
        ),
        (
            "tools",
            "a call without an id",
            X,
            hist(**{"1.call": {k: v for k, v in call.items() if k != "id"}}),
            (200, 400),
            None,
        ),
        (
            "tools",
            "a call to an undeclared function",
            X,
            hist(**{"1.call": {**call, "function": {"name": "launch", "arguments": "{}"}}}),
            (200, 400),
            None,
        ),
        ("tools", "tool_calls not a list", X, hist(**{"1.tool_calls": {"id": "x"}}), (400,), None),
        (
            "tools",
            "a tool result as text parts",
            X,
            hist(**{"2.content": [{"type": "text", "text": "sunny"}]}),
            (200,),
            None,
        ),
        ("tools", "a tool result null", X, hist(**{"2.content": None}), (200, 400), None),
        (
            "tools",
            "a message with a name field",
            X,
            chat(messages=[{"role": "user", "content": P, "name": "ann"}]),
            (200,),
            None,
        ),
        ("tools", "functions []", X, chat(functions=[]), (200,), None),
        (
            "tools",
            "functions declared (the old API)",
            X,
            chat(functions=[{"name": "f", "parameters": CITY}]),
            (400,),
            None,
        ),
        ("tools", "function_call none (the old API)", X, chat(function_call="none"), (200, 400), None),
        (
            "json",
            "json_object",
            X,
            chat(response_format={"type": "json_object"}, max_tokens=200),
            (200,),
            json_answer(None),
        ),
        (
            "json",
            "json_schema strict",
            X,
            chat(response_format=schema_fmt(PET, strict=True), max_tokens=200),
            (200,),
            json_answer(PET),
        ),
        (
            "json",
            "json_schema not strict",
            X,
            chat(response_format=schema_fmt(PET), max_tokens=200),
            (200,),
            json_answer(PET),
        ),
        (
            "json",
            "json_schema on /v1/completions",
            C,
            comp(response_format=schema_fmt(PET), max_tokens=200),
            (200,),
            json_answer(PET),
        ),
        ("json", "type text", X, chat(response_format={"type": "text"}), (200,), None),
        ("json", "response_format null", X, chat(response_format=None), (200,), None),
        ("json", "response_format a string", X, chat(response_format="json"), (400,), None),
        ("json", "an unknown type", X, chat(response_format={"type": "yaml"}), (400,), None),
        (
            "json",
            "json_schema without its schema",
            X,
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            (200, 400),
            json_answer(None),
        ),
        (
            "json",
            "json_schema without a name",
            X,
            chat(response_format={"type": "json_schema", "json_schema": {"schema": PET}}, max_tokens=200),
            (200, 400),
            json_answer(PET),
        ),
        ("json", "a schema of type 5", X, chat(response_format=schema_fmt({"type": 5})), (400,), None),
        ("json", "a schema that is a string", X, chat(response_format=schema_fmt("object")), (400,), None),
        (
            "json",
            "a recursive $ref schema",
            X,
            chat(
                response_format=schema_fmt(
                    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
                ),
                max_tokens=120,
            ),
            (200, 400),
            json_answer(None),
        ),
        (
            "json",
            "2,000 properties",
            X,
            chat(
                response_format=schema_fmt(
                    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}
                )
            ),
            (200, 400),
            None,
        ),
        (
            "json",
            "an empty enum (nothing satisfies it)",
            X,
            chat(response_format=schema_fmt({"enum": []})),
            (200, 400),
            None,
        ),
        (
            "json",
            "minimum over maximum (nothing satisfies it)",
            X,
            chat(response_format=schema_fmt({"type": "integer", "minimum": 5, "maximum": 3})),
            (200, 400),
            None,
        ),
        (
            "json",
            "minLength 1,000 with max_tokens 8",
            X,
            chat(response_format=schema_fmt({"type": "string", "minLength": 1000}), max_tokens=8),
            (200, 400),
            None,
        ),
        (
            "json",
            "a catastrophic regex pattern",
            X,
            chat(response_format=schema_fmt({"type": "string", "pattern": "^(a|a)*$"})),
            (200, 400),
            None,
        ),
        (
            "json",
            "json_object streamed",
            X,
            chat(response_format={"type": "json_object"}, max_tokens=200, stream=True),
            (200,),
            None,
        ),
        (
            "json",
            "temperature 2 seed 1",
            X,
            chat(response_format=schema_fmt(PET), temperature=2.0, seed=1, max_tokens=200),
            (200,),
            json_answer(PET),
        ),
        (
            "json",
            "rule cactus delta 1",
            X,
            chat(response_format=schema_fmt(PET), rule="cactus", delta=1.0, max_tokens=200),
            (200,),
            json_answer(PET),
        ),
        (
            "json",
            "draft none",
            X,
            chat(response_format=schema_fmt(PET), draft="none", max_tokens=200),
            (200,),
            json_answer(PET),
        ),
        (
            "json",
            "num_draft_tokens auto",
            X,
            chat(response_format=schema_fmt(PET), num_draft_tokens="auto", max_tokens=200),
            (200,),
            json_answer(PET),
        ),
        (
            "json",
            "num_draft_tokens 0",
            X,
            chat(response_format=schema_fmt(PET), num_draft_tokens=0, max_tokens=200),
            (200, 400),
            json_answer(PET),
        ),
        (
            "json",
            "with logprobs",
            X,
            chat(response_format=schema_fmt(PET), logprobs=True, top_logprobs=3, max_tokens=200),
            (200,),
            json_answer(PET),
        ),
        (
            "json",
            "without max_tokens (runs to its end)",
            X,
            {k: v for k, v in chat(response_format=schema_fmt(PET)).items() if k != "max_tokens"},
            (200,),
            json_answer(PET),
        ),
        (
            "json",
            "a stop string inside the JSON",
            X,
            chat(response_format=schema_fmt(PET), stop=['"n"'], max_tokens=200),
            (200,),
            None,
        ),
        (
            "json",
            "with a system message",
            X,
            chat(
                messages=[{"role": "system", "content": "answer in JSON"}, {"role": "user", "content": P}],
                response_format={"type": "json_object"},
                max_tokens=200,
            ),
            (200,),
            json_answer(None),
        ),
        ("logprobs", "top_logprobs 0", X, chat(logprobs=True, top_logprobs=0), (200,), logprobs_ok(0)),
        ("logprobs", "top_logprobs 1", X, chat(logprobs=True, top_logprobs=1), (200,), logprobs_ok(1)),
        ("logprobs", "top_logprobs 5", X, chat(logprobs=True, top_logprobs=5), (200,), logprobs_ok(5)),
        ("logprobs", "top_logprobs 20", X, chat(logprobs=True, top_logprobs=20), (200,), logprobs_ok(20)),
        ("logprobs", "logprobs without top_logprobs", X, chat(logprobs=True), (200,), logprobs_ok(0)),
        ("logprobs", "logprobs false with top_logprobs", X, chat(logprobs=False, top_logprobs=3), (400,), None),
        ("logprobs", "top_logprobs -1", X, chat(logprobs=True, top_logprobs=-1), (400,), None),
        ("logprobs", "top_logprobs 2.5", X, chat(logprobs=True, top_logprobs=2.5), (400,), None),
        ("logprobs", "logprobs a string", X, chat(logprobs="true"), (400,), None),
        ("logprobs", "completions logprobs 0", C, comp(logprobs=0), (200,), logprobs_ok(0, False)),
        ("logprobs", "completions logprobs 1", C, comp(logprobs=1), (200,), logprobs_ok(1, False)),
        ("logprobs", "completions logprobs 5", C, comp(logprobs=5), (200,), logprobs_ok(5, False)),
        ("logprobs", "completions logprobs 6", C, comp(logprobs=6), (200, 400), logprobs_ok(6, False)),
        ("logprobs", "completions logprobs true", C, comp(logprobs=True), (200, 400), logprobs_ok(0, False)),
        ("logprobs", "echo with logprobs", C, comp(logprobs=2, echo=True), (400,), None),
        (
            "logprobs",
            "sampled at T 0.7 with a seed",
            X,
            chat(logprobs=True, top_logprobs=5, temperature=0.7, seed=4),
            (200,),
            None,
        ),
        (
            "logprobs",
            "rule cactus",
            X,
            chat(logprobs=True, top_logprobs=3, rule="cactus", delta=1.0),
            (200,),
            logprobs_ok(3),
        ),
        ("logprobs", "draft none", X, chat(logprobs=True, top_logprobs=3, draft="none"), (200,), logprobs_ok(3)),
        ("logprobs", "streamed", X, chat(logprobs=True, top_logprobs=2, stream=True), (200,), None),
    ]
    return out


def make_pair(root: Path) -> dict[str, str]:
    """The byte-level tiny pair (every character a token), its template with a tools section."""
    from tests.conftest import make_byte_pair

    return make_byte_pair(root, max_pos=2048, chat_template=TEMPLATE)


def start(hs, models: dict[str, str], parallel: int = PARALLEL, max_queue: int = 4):
    from cactus_cli.app.serve.serving import Server
    from cactus_cli.app.session import Session

    session = Session.load(
        verifier=models["verifier"], draft=models["draft"], device="cpu", dtype="float32",
        num_draft_tokens=3, temperature=0.0, seed=0, sequences=parallel,
    )  # fmt: skip
    return hs.serve(Server(session, max_queue=max_queue, parallel=parallel))


def streamed(hs, url: str, path: str, body: dict) -> tuple[int, dict]:
    """A streamed answer put together: (status, {"text", "calls", "finish", "logprobs"})."""
    got: dict = {"text": "", "calls": {}, "finish": None, "logprobs": 0, "chunks": 0}
    with hs.httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, {"error": r.text}
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            for ch in doc.get("choices", []):
                got["chunks"] += 1
                delta = ch.get("delta", {})
                got["text"] += delta.get("content") or ch.get("text") or ""
                for c in delta.get("tool_calls") or []:
                    slot = got["calls"].setdefault(c["index"], {"id": None, "name": "", "arguments": ""})
                    slot["id"] = slot["id"] or c.get("id")
                    slot["name"] += (c.get("function") or {}).get("name") or ""
                    slot["arguments"] += (c.get("function") or {}).get("arguments") or ""
                got["finish"] = ch.get("finish_reason") or got["finish"]
                got["logprobs"] += len((ch.get("logprobs") or {}).get("content") or [])
    return 200, got


def server_round(hs, models: dict[str, str]) -> None:
    errors = hs.Errors()
    for name in ("uvicorn.error", "uvicorn", "fastapi", ""):
        logging.getLogger(name).addHandler(errors)
    server, url, stop = start(hs, models)
    canary = chat(max_tokens=12)
    base = hs.httpx.post(url + X, json=canary, timeout=60).json()["choices"][0]["message"]["content"]
    try:
        for surface, name, path, body, accept, check in server_cases():
            seen = len(errors.records)
            t0 = time.monotonic()
            try:
                if body.get("stream"):
                    status, doc = streamed(hs, url, path, {k: v for k, v in body.items() if k != "stream"})
                    text = json.dumps(doc)
                else:
                    status, text = hs._raw(url, "POST", path, body, {}, timeout=120)
                    doc = json.loads(text) if status == 200 else None
            except hs.httpx.TimeoutException:
                hs.record(surface, name, "hang", "no answer in 120 s")
                continue
            except Exception as err:  # noqa: BLE001
                hs.record(surface, name, "lost", f"{type(err).__name__}: {err}")
                continue
            took = time.monotonic() - t0
            logged = errors.records[seen:]
            try:
                after = hs.httpx.post(url + X, json=canary, timeout=60).json()["choices"][0]["message"]["content"]
            except Exception as err:  # noqa: BLE001
                hs.record(surface, name, "lost", f"canary after it: {type(err).__name__}: {err}")
                server, url, stop = start(hs, models)
                continue
            problem = None
            if status == 200 and body.get("stream"):
                problem = stream_problem(doc, body)
            elif status == 200 and check is not None:
                try:
                    problem = check(doc)
                except (KeyError, TypeError, IndexError) as err:
                    problem = f"answer not in OpenAI's shape: {type(err).__name__} {err}: {text[:160]}"
            if status >= 500 or logged:
                hs.record(surface, name, "traceback", f"{status} {text[:120]} {logged[:1]}")
            elif after != base:
                hs.record(surface, name, "lost", f"the canary's answer changed: {after!r} vs {base!r}")
            elif took > 60:
                hs.record(surface, name, "hang", f"answered after {took:.0f} s")
            elif status not in accept:
                hs.record(surface, name, "wrong", f"{status} (expected {accept}) {text[:150]}")
            elif problem:
                hs.record(surface, name, "wrong", problem)
            elif status != 200 and (bad := hs.one_line_error(status, text)):
                hs.record(surface, name, "wrong", bad)
            else:
                hs.record(surface, name, "fine", f"{status} {text[:100]}")
        slots_round(hs, url, server, errors)
    finally:
        stop()


def stream_problem(doc: dict, body: dict) -> str | None:
    if "json" in (body.get("response_format") or {}).get("type", "") and doc["finish"] == "stop":
        try:
            json.loads(doc["text"])
        except ValueError:
            return f"streamed JSON does not parse: {doc['text'][:120]!r}"
    if body.get("logprobs") and doc["logprobs"] == 0:
        return "no logprobs in the streamed chunks"
    for c in doc["calls"].values():
        try:
            json.loads(c["arguments"])
        except ValueError:
            return f"streamed call arguments not JSON: {c}"
    if doc["finish"] is None:
        return "no finish_reason in the stream"
    return None


# ------------------------------------------------------------------------------ slots and concurrency


def run_all(threads: list[threading.Thread], seconds: float = 240) -> None:
    """Start every thread, then wait for each (at most ``seconds``)."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds)


def together(hs, url: str, requests: list[tuple[str, dict]], stream: list[bool] | None = None) -> list[Any]:
    """Send every request at once (threads), each answer or the exception it raised, in order."""
    out: list[Any] = [None] * len(requests)
    stream = stream or [False] * len(requests)

    def go(i: int) -> None:
        path, body = requests[i]
        try:
            if stream[i]:
                out[i] = streamed(hs, url, path, body)[1]
            else:
                out[i] = hs.httpx.post(url + path, json=body, timeout=180).json()
        except Exception as err:  # noqa: BLE001
            out[i] = err

    run_all([threading.Thread(target=go, args=(i,)) for i in range(len(requests))])
    return out


def answer_problem(check: Callable[[dict], str | None], doc: Any) -> str | None:
    """What is wrong with one answer of several sent together (an error answer included)."""
    if not isinstance(doc, dict) or "choices" not in doc:
        return f"no answer: {str(doc)[:160]}"
    return check(doc)


def text_of(doc: Any) -> str | None:
    if isinstance(doc, dict) and "choices" in doc:
        ch = doc["choices"][0]
        return ch["message"]["content"] if "message" in ch else ch["text"]
    if isinstance(doc, dict) and "text" in doc:
        return doc["text"]
    return None


def alone_vs_together(hs, url: str, name: str, requests: list[tuple[str, dict]], stream: list[bool] | None = None):
    alone = [text_of(hs.httpx.post(url + p, json=b, timeout=180).json()) for p, b in requests]
    both = [text_of(d) for d in together(hs, url, requests, stream)]
    bad = [i for i, (a, b) in enumerate(zip(alone, both)) if a != b or a is None]
    hs.record("slots", name, "fine" if not bad else "wrong",
              f"{len(requests)} requests, all equal alone" if not bad else f"request {bad[0]}: {both[bad[0]]!r} vs {alone[bad[0]]!r}")  # fmt: skip


def wait_idle(server, seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not server_busy(server):
            return True
        time.sleep(0.05)
    return False


def server_busy(server) -> bool:
    return bool(server.running) or server.queue.qsize() > 0


def slots_round(hs, url: str, server, errors) -> None:
    g = lambda p, n, **kw: (C, comp(p, max_tokens=n, **kw))  # noqa: E731
    prompts = [
        "the cat",
        "the cat sat on",
        "the dog ran",
        "the mat and the dog",
        "cat dog bird",
        "the",
        "sat on the mat",
        "the cat sat on the mat and",
    ]
    alone_vs_together(hs, url, "8 greedy requests of mixed lengths", [g(p, 8 + 6 * i) for i, p in enumerate(prompts)])
    shared = "the cat sat on the mat and the dog ran fast " * 3
    alone_vs_together(hs, url, "8 sharing a prefix, some with stop strings",
                      [g(shared + p, 20, **({"stop": [" the"]} if i % 2 else {})) for i, p in enumerate(prompts)])  # fmt: skip
    alone_vs_together(hs, url, "4 streamed", [g(p, 20) for p in prompts[:4]], [True] * 4)
    alone_vs_together(hs, url, "4 streamed and 4 whole", [g(p, 16) for p in prompts], [i % 2 == 0 for i in range(8)])
    rules = [{"rule": "sps"}, {"rule": "cactus", "delta": 1.0}, {"rule": "tas"}, {"rule": "cactus-exact", "delta": 0.5}]
    alone_vs_together(hs, url, "4 rules side by side", [g("the cat", 20, **r) for r in rules])
    ks = [{"num_draft_tokens": k} for k in (1, 2, 4, "auto")]
    alone_vs_together(hs, url, "k 1, 2, 4 and auto side by side", [g("the dog ran", 20, **k) for k in ks])
    alone_vs_together(
        hs,
        url,
        "draft none beside drafting requests",
        [g("the cat sat", 20, **({"draft": "none"} if i == 0 else {})) for i in range(4)],
    )
    seeded = [g("the cat", 20, temperature=0.8, seed=s) for s in (1, 2, 3, 4)]
    alone_vs_together(hs, url, "4 seeded samples at T 0.8", seeded)
    alone_vs_together(hs, url, "the same request 4 times", [g("the mat", 20)] * 4)
    mixed = [
        (X, chat(response_format=schema_fmt(PET), max_tokens=200)),
        (X, chat(tools=TOOLS, tool_choice="required")),
        (X, chat(logprobs=True, top_logprobs=3)),
        g("the cat", 20),
    ]
    alone_vs_together(hs, url, "JSON, a forced call, logprobs and plain text together", mixed)
    docs = together(
        hs, url, [(X, chat(response_format=schema_fmt(PET), temperature=1.0, seed=s, max_tokens=200)) for s in range(4)]
    )
    bad = [d for d in docs if answer_problem(json_answer(PET), d)]
    hs.record("slots", "4 sampled JSON answers together", "fine" if not bad else "wrong", str(bad[:1])[:200])
    docs = together(
        hs,
        url,
        [(X, chat(tools=TOOLS, tool_choice="required", temperature=1.0, seed=s, max_tokens=120)) for s in range(4)],
    )
    bad = [d for d in docs if answer_problem(forced(TOOLS), d)]
    hs.record("slots", "4 sampled forced calls together", "fine" if not bad else "wrong", str(bad[:1])[:200])
    # speculation stays alive after a draft-less request in a slot
    together(hs, url, [g("the cat sat on the mat", 30, draft="none")] * 4)
    docs = together(hs, url, [g("the cat sat on the mat", 30)] * 4)
    spec = [d.get("speculative", {}) for d in docs if isinstance(d, dict)]
    kept = sum(s.get("accepted") or 0 for s in spec)
    hs.record(
        "slots",
        "drafting after draft-less requests in every slot",
        "fine" if kept > 0 else "wrong",
        f"accepted {kept}: {spec[:1]}",
    )
    cancel_round(hs, url, server)
    burst(hs, url, server)
    metrics_round(hs, url, server)
    over = together(hs, url, [g("the " * 3000, 4), g("the cat", 16), g("the dog", 16), g("the mat", 16)])
    ok = (
        isinstance(over[0], dict)
        and "error" in over[0]
        and all(isinstance(d, dict) and text_of(d) is not None for d in over[1:])
    )
    hs.record("slots", "a prompt past the context beside three others", "fine" if ok else "wrong", str(over[0])[:160])
    answers = together(
        hs, url, [(C, {"prompt": "the cat", "temperature": 0}), g("the cat", 8), g("the dog", 8), g("the mat", 8)]
    )
    ok = all(isinstance(d, dict) and d["choices"][0]["finish_reason"] in ("stop", "length") for d in answers)
    hs.record("slots", "one without max_tokens (to its end) beside three short", "fine" if ok else "wrong",
              f"{[d['usage']['completion_tokens'] if isinstance(d, dict) and 'usage' in d else d for d in answers]}")  # fmt: skip
    docs = together(hs, url, [g("the cat sat", 24)] * 4)
    bad = [d for d in docs if not isinstance(d, dict) or not isinstance(s := d.get("speculative"), dict)
           or not 1 <= s["verifier_forward_passes"] <= d["usage"]["completion_tokens"] + 1
           or not 0 <= s["accepted"] <= s["drafted"]]  # fmt: skip
    hs.record("slots", "each answer's speculative object its own", "fine" if not bad else "wrong", str(bad[:1])[:200])
    time.sleep(1.0)
    before = threading.active_count(), len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        together(hs, url, [g(p, 12) for p in prompts])
        cancel_round(hs, url, server, say=False)
    time.sleep(1.0)
    after = threading.active_count(), len(os.listdir("/proc/self/fd"))
    hs.record("slots", "threads and fds after two more rounds of 8 and of cancels",
              "fine" if after[0] <= before[0] + 2 and after[1] <= before[1] + 2 else "leak", f"{before} -> {after}")  # fmt: skip


def cancel_round(hs, url: str, server, say: bool = True) -> None:
    """One stream dropped after its first chunk while three others run; then four dropped at once."""
    body = comp("the cat", max_tokens=200, temperature=0.9, stream=True)

    def drop():
        with hs.httpx.stream("POST", url + C, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break

    others = [(C, comp(p, max_tokens=16)) for p in ("the cat", "the dog", "the mat")]
    alone = [text_of(hs.httpx.post(url + p, json=b, timeout=60).json()) for p, b in others]
    t = threading.Thread(target=drop)
    t.start()
    both = [text_of(d) for d in together(hs, url, others)]
    t.join(60)
    if say:
        hs.record(
            "slots", "a stream dropped beside three answers", "fine" if both == alone else "wrong", f"{both} vs {alone}"
        )
    run_all([threading.Thread(target=drop) for _ in range(4)], 60)
    idle = wait_idle(server)
    if say:
        hs.record("slots", "four streams dropped at once free their slots", "fine" if idle else "leak", f"idle={idle}")
    run_all([threading.Thread(target=lambda: _quick_drop(hs, url)) for _ in range(8)], 60)  # (some while queued)
    idle = wait_idle(server)
    if say:
        hs.record(
            "slots", "eight whole requests dropped, some while queued", "fine" if idle else "leak", f"idle={idle}"
        )


def _quick_drop(hs, url: str) -> None:
    try:
        hs.httpx.post(url + C, json=comp("the cat", max_tokens=200, temperature=0.9), timeout=0.3)
    except hs.httpx.TimeoutException:
        pass


def burst(hs, url: str, server) -> None:
    docs = []

    def go(i):
        try:
            docs.append(hs.httpx.post(url + C, json=comp("the cat", max_tokens=6, seed=i), timeout=180).status_code)
        except Exception:  # noqa: BLE001
            docs.append(-1)

    run_all([threading.Thread(target=go, args=(i,)) for i in range(40)])
    ok = len(docs) == 40 and all(s in (200, 503) for s in docs) and docs.count(200) >= PARALLEL
    hs.record("slots", f"40 requests at once, {PARALLEL} slots, a queue of 4", "fine" if ok else "lost",
              f"200: {docs.count(200)}, 503: {docs.count(503)}, other: {[s for s in docs if s not in (200, 503)]}")  # fmt: skip


def metrics_round(hs, url: str, server) -> None:
    seen: list[tuple[float, float]] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            text = hs.httpx.get(url + "/metrics", timeout=10).text
            vals = {}
            for line in text.splitlines():
                if line.startswith(
                    (
                        "cactus:num_requests_running",
                        "cactus:num_requests_waiting",
                        "vllm:num_requests_running",
                        "vllm:num_requests_waiting",
                    )
                ):
                    vals[line.split("{")[0].split(" ")[0].split(":")[1]] = float(line.rsplit(" ", 1)[1])
            seen.append((vals.get("num_requests_running", -1), vals.get("num_requests_waiting", -1)))
            time.sleep(0.05)

    t = threading.Thread(target=poll)
    t.start()
    together(hs, url, [(C, comp(p, max_tokens=24)) for p in ("the cat", "the dog", "the mat", "cat", "dog", "mat")])
    wait_idle(server)
    time.sleep(0.3)
    stop.set()
    t.join(10)
    peak = max((r for r, _ in seen), default=-1)
    last = seen[-1] if seen else (-1, -1)
    ok = 1 <= peak <= PARALLEL and last == (0, 0) and all(w >= 0 for _, w in seen)
    hs.record(
        "slots",
        "/metrics running and waiting during 6 requests, then 0",
        "fine" if ok else "wrong",
        f"peak {peak}, last {last}",
    )


# ---------------------------------------------------------------------------------- remeasure (CLI)


def cli_round(hs, home: Path) -> None:
    from tests.gguf_helpers import write_tiny_gguf

    gguf_file = write_tiny_gguf(home.parent / "fifth.gguf", seed=3)
    env = dict(os.environ, CACTUS_HOME=str(home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    costs = home / "costs"

    def cli(name: str, args: list[str], want=0, env_over: dict | None = None, check=None, setup=None) -> None:
        if setup is not None:
            setup()
        try:
            p = subprocess.run([sys.executable, "-m", "cactus_cli", *args], env={**env, **(env_over or {})},
                               capture_output=True, timeout=180)  # fmt: skip
        except subprocess.TimeoutExpired:
            hs.record("remeasure", name, "hang", "no exit in 180 s")
            return
        err, out = p.stderr.decode("utf-8", "replace"), p.stdout.decode("utf-8", "replace")
        wants = want if isinstance(want, tuple) else (want,)
        lines = [line for line in err.strip().splitlines() if line.startswith("error")]
        problem = check(out, err) if check is not None and p.returncode == 0 else None
        if "Traceback" in err:
            hs.record("remeasure", name, "traceback", err.strip().splitlines()[-1])
        elif p.returncode not in wants:
            hs.record("remeasure", name, "wrong", f"exit {p.returncode} (expected {wants}): {err.strip()[-200:]}")
        elif p.returncode == 2 and len(lines) != 1 and "Usage" not in err:
            hs.record("remeasure", name, "wrong", f"not one error line: {err.strip()[-200:]}")
        elif problem:
            hs.record("remeasure", name, "wrong", problem)
        else:
            hs.record(
                "remeasure",
                name,
                "fine",
                f"exit {p.returncode}: {(lines or out.strip().splitlines()[-1:] or [''])[0][:140]}",
            )

    gen = ["generate", "the cat", "--verifier", str(gguf_file), "--draft", "none", "-n", "6", "--json"]

    def plan_says(out: str, err: str) -> str | None:
        plan = json.loads(out)["settings"]["plan"]
        reason = plan["threads"].get("reason") or ""
        if not plan["threads"].get("value") or "measured" not in reason:
            return f"the plan does not say how its threads were chosen: {plan['threads']}"
        return None

    def forgot(n_min: int):
        def check(out: str, err: str) -> str | None:
            n = int(out.split("forgot ")[1].split(" ")[0]) if "forgot " in out else -1
            return None if n >= n_min else f"forgot {n}, expected at least {n_min}: {out.strip()}"

        return check

    def each_record(change: Callable[[dict], None]) -> Callable[[], None]:
        def setup() -> None:
            for path in costs.glob("*.json"):
                try:
                    doc = json.loads(path.read_text())
                except (ValueError, OSError):
                    continue
                target = doc.get("result", doc)
                if isinstance(target, dict):
                    change(target)
                path.write_text(json.dumps(doc))

        return setup

    def put(name: str, data: bytes | None = None, kind: str = "file") -> Callable[[], None]:
        def setup() -> None:
            costs.mkdir(parents=True, exist_ok=True)
            path = costs / name
            if kind == "dir":
                path.mkdir(exist_ok=True)
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "link":
                path.symlink_to(costs / "nowhere")
            else:
                path.write_bytes(data or b"")

        return setup

    cli("remeasure on an empty home", ["models", "remeasure"], 0, check=forgot(0))
    cli("a first generate on the tiny GGUF (plan says the threads)", gen, 0, check=plan_says)
    cli("remeasure after it", ["models", "remeasure"], 0, check=forgot(1))
    cli("remeasure twice", ["models", "remeasure"], 0, check=forgot(0))
    cli("generate after remeasure (measured again)", gen, 0, check=plan_says)
    cli("remeasure with an extra argument", ["models", "remeasure", "now"], 2)
    cli("remeasure --help", ["models", "remeasure", "--help"], 0)
    cli("a folder named like a measurement", ["models", "remeasure"], 0, setup=put("x.json", kind="dir"))
    cli("a FIFO named like a measurement", ["models", "remeasure"], 0, setup=put("f.json", kind="fifo"))
    cli("a dangling link named like a measurement", ["models", "remeasure"], 0, setup=put("l.json", kind="link"))
    cli("a costs folder that is a file", ["models", "remeasure"], (0, 2),
        setup=lambda: (_clear(costs), costs.write_text("x")))  # fmt: skip
    cli(
        "CACTUS_HOME a file", ["models", "remeasure"], (0, 2), env_over={"CACTUS_HOME": str(home.parent / "fifth.gguf")}
    )
    _clear(costs)
    cli("generate to fill the stores again", gen, 0, check=plan_says)
    for label, change in [
        ('"quiet": "yes"', lambda r: r.update(quiet="yes")),
        ('"taken": 5', lambda r: r.update(taken=5)),
        ('"taken" an object', lambda r: r.update(taken={"a": 1})),
        ('"cpu_share" a string', lambda r: r.update(cpu_share="x")),
        ('"curves" garbage', lambda r: r.update(curves={"2": "fast"}, scores=r.get("scores"))),
        ('"curves" a list', lambda r: r.update(curves=[1, 2])),
        ('"drift" NaN', lambda r: r.update(drift=float("nan"), quiet=False)),
        ("scores of a thread count that is not a number", lambda r: r.update(scores={"two": 1.0})),
        ('"quiet" false with no time', lambda r: (r.pop("taken", None), r.update(quiet=False))),
        ("a record without its result", lambda r: r.clear()),
    ]:
        cli(f"a stored measurement with {label}", gen, 0, check=plan_says, setup=each_record(change))
    cli("a store file of garbage bytes", gen, 0, check=plan_says, setup=put("gguf-layout-0000.json", b"\x00\xff{"))
    cli("remeasure forgets the garbage too", ["models", "remeasure"], 0, check=forgot(1))


def _clear(folder: Path) -> None:
    import shutil

    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder)
    elif folder.exists() or folder.is_symlink():
        folder.unlink()


def run(hs, tmp: Path) -> None:
    models = make_pair(tmp / "fifth")
    server_round(hs, models)
    home = tmp / "fifth-home"
    home.mkdir()
    cli_round(hs, home)
