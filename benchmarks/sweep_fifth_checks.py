"""What the fifth round's cases send and how their answers are checked: the request bodies (chat,
comp, schema_fmt), the tools and schemas (fn, TOOLS, PET, CITY), the byte-level pair's chat template,
a streamed answer put together (streamed), and the checks of an answer: tool calls parse and
validate against their tool's schema, JSON answers that ended validate against theirs,
log-probabilities are finite, at most 0, sorted, the greedy token first. sweep_sixth.py uses them too.
"""

from __future__ import annotations

import json
import math
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
