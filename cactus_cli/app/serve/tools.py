"""Tool calls for `cactus serve` (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``),
through the model's own chat template: the tools are rendered by the template's tools section,
and the model's calls are read back from its text in the Hermes format that Qwen2.5, Qwen3,
Hermes and many others are trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice`` ``required`` or a named function starts the answer with the call's opening (the
tokens go after the prompt, as the assistant's first words), so the model can only continue a
call; ``none`` renders no tools. A call is also read in the forms a broken template example taught
(Qwen2.5's: ``{{"name": ..., "arguments": {...}}}``) and, where it is the whole answer, without its
tags. What the model writes is checked before it is passed on as a call: valid JSON, a declared name, an object of arguments holding the schema's required keys. A
call that fails the check is left in the answer's text (finish_reason ``stop``), never passed on
as a broken call. Errors in a request are a ``FieldError`` naming the field (a 400)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from cactus_cli.app.serve.serving import FieldError
from cactus_cli.infer.decode.grammar import JSON_OPTIONS, Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_HEAD, CALL_REST = '\n{"name": "', '", "arguments": '  # a call: OPEN CALL_HEAD name CALL_REST arguments }\n CLOSE
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
BARE = ('{"name"', '{{"name"')  # how a whole answer that is a call without its tags starts (spaces aside)


@dataclass(frozen=True)
class Tools:
    """A request's declared tools and how it lets the model use them."""

    tools: tuple[dict[str, Any], ...]  # as the template renders them: {"type": "function", "function": {...}}
    choice: str = "auto"  # auto, required, or a declared function's name
    parallel: bool = True

    @property
    def names(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    def opening(self) -> str:
        """The answer's forced start: nothing (auto), a call's opening (required), or a named call's."""
        if self.choice == "auto":
            return ""
        if self.choice == "required":
            return OPEN + CALL_HEAD
        return OPEN + CALL_HEAD + self.choice + CALL_REST

    def grammar(self, tokenizer: Any) -> Grammar | None:
        """With ``required`` or a named function, what may follow the forced opening: a declared
        name, its arguments as JSON valid against its parameters schema, the closing tag (then more
        calls if parallel calls are on): the call cannot come out broken. None for ``auto``."""
        if self.choice == "auto":
            return None
        end = _lark("}\n") + " " + _tag(tokenizer, CLOSE)
        rules = []
        for i, (name, fn) in enumerate(self.names.items()):
            schema = {**fn["parameters"], "x-guidance": JSON_OPTIONS}
            rules.append(f"args{i}: %json {json.dumps(schema)}")
            rules.append(f"call{i}: {_lark(name + CALL_REST)} args{i} {end}")
        rules.append("call: " + " | ".join(f"call{i}" for i in range(len(self.tools))))
        if self.choice == "required":  # (any declared function, each call; a named one: that one only)
            first, target = "call", "call"
        else:
            at = list(self.names).index(self.choice)
            first, target = f"args{at} {end}", f"call{at}"
        another = f"{_lark(chr(10))} {_tag(tokenizer, OPEN)} {_lark(CALL_HEAD)} {target}"
        more = f" ({another})*" if self.parallel else ""
        # (the model may end its line before it ends its turn: a newline with no call after it)
        return Grammar("lark", "\n".join([f"start: {first}{more} {_lark(chr(10))}?"] + rules))


def _tag(tokenizer: Any, tag: str) -> str:
    """A tag as the grammar names it: the tokenizer's own token for it where it has one (Qwen's
    ``<tool_call>`` is a single added token, not its letters), else its text."""
    tid = tokenizer.convert_tokens_to_ids(tag) if hasattr(tokenizer, "convert_tokens_to_ids") else None
    if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None) and tokenizer.decode([tid]) == tag:
        return f"<[{tid}]>"
    return _lark(tag)


def _lark(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def supports_tools(tokenizer: Any) -> bool:
    """The chat template renders tools and speaks the Hermes call format."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template and OPEN in template


def parse_tools(tools: Any, tool_choice: Any, parallel: bool | None) -> Tools | None:
    """The request's tools checked (None: no tools, or ``tool_choice`` none)."""
    if tools in (None, []):
        if tool_choice not in (None, "none", "auto"):
            raise FieldError("tool_choice", "tool_choice: names a tool, but the request declares no tools")
        return None
    if not isinstance(tools, list):
        raise FieldError("tools", "tools: must be a list of {'type': 'function', 'function': {...}} objects")
    checked: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise FieldError("tools", f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise FieldError("tools", f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'")
        if name in (t["function"]["name"] for t in checked):
            raise FieldError("tools", f"{where}: the function {name!r} is declared twice")
        if "description" in fn and not isinstance(fn["description"], str):
            raise FieldError("tools", f"{where}.function.description must be a string")
        schema = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise FieldError("tools", f"{where}.function.parameters must be a JSON schema of type 'object'")
        if not isinstance(schema.get("properties", {}), dict) or not isinstance(schema.get("required", []), list):
            raise FieldError("tools", f"{where}.function.parameters: 'properties' must be an object, 'required' a list")
        kept = {"name": name, "parameters": schema}
        if fn.get("description"):
            kept["description"] = fn["description"]
        checked.append({"type": "function", "function": kept})
    if tool_choice in (None, "auto"):
        choice = "auto"
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        choice = "required"
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (
            (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), dict) else None
        )
        if name not in {t["function"]["name"] for t in checked}:
            raise FieldError(
                "tool_choice", f"tool_choice: names the function {name!r}, which the request's tools do not declare"
            )
        choice = name
    else:
        raise FieldError(
            "tool_choice",
            "tool_choice: must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
        )
    return Tools(tuple(checked), choice, True if parallel is None else bool(parallel))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's messages as the chat template takes them: an assistant's calls with their
    arguments as objects (OpenAI sends them as JSON text), a tool message only after the call it
    answers."""
    calls: set[str] = set()
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            rendered = []
            for j, call in enumerate(m["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise FieldError("messages", f"messages[{i}].tool_calls[{j}] needs function.name")
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    raise FieldError(
                        "messages", f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON"
                    ) from None
                if isinstance(call.get("id"), str):
                    calls.add(call["id"])
                rendered.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
            m["tool_calls"] = rendered
        elif m["role"] == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or cid not in calls:
                raise FieldError(
                    "messages",
                    f"messages[{i}] is a tool result for call {cid!r}, but no earlier assistant message made that call",
                )
        m["content"] = m.get("content") or ""
        out.append(m)
    return out


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Calls:
    """Reads an answer's text as it comes: the text to show, and the calls it makes.

    ``feed`` returns the text that can be shown now (text that may be the start of a call is held
    back until it is known); ``close`` returns the rest. A call is passed on when its closing tag
    arrives, or at the end of the answer when only the closing tag is missing (the answer may stop
    there), and only if it checks out; otherwise its text is shown as it was written."""

    tools: Tools
    calls: list[dict[str, Any]] = field(default_factory=list)
    held: str = ""
    inside: bool = False
    done: bool = False  # parallel_tool_calls false: the first call ends the answer
    bare: bool | None = None  # the whole answer may be a call without its tags (None: not known yet)

    def __post_init__(self) -> None:
        opening = self.tools.opening()
        if opening:
            self.inside, self.held, self.bare = True, opening[len(OPEN) :], False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        shown, new = [], []
        self.held += text
        if self.bare is not False:
            self.bare = _bare(self.held)
            if self.bare is not False:  # (held to the end, where it is read as a call or shown)
                return "", []
        while self.held and not self.done:
            if not self.inside:
                at = self.held.find(OPEN)
                if at < 0:
                    keep = next((n for n in range(len(OPEN) - 1, 0, -1) if self.held.endswith(OPEN[:n])), 0)
                    shown.append(self.held[: len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep :]
                    break
                shown.append(self.held[:at])
                self.held, self.inside = self.held[at + len(OPEN) :], True
                continue
            end = self.held.find(CLOSE)
            if end < 0:
                break
            body, self.held, self.inside = self.held[:end], self.held[end + len(CLOSE) :], False
            call = self._check(body, len(self.calls) + len(new))
            if call is None:
                shown.append(OPEN + body + CLOSE)
                continue
            new.append(call)
            if not self.tools.parallel:
                self.done = True
        self.calls += new
        return "".join(shown), new

    def close(self) -> tuple[str, list[dict[str, Any]]]:
        """The answer ended: what is still held, shown or passed on as a call missing its close."""
        if self.done:
            return "", []
        held, self.held = self.held, ""
        if self.inside or self.bare:
            self.inside = False
            call = self._check(held, len(self.calls))
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return ("" if self.bare else OPEN) + held, []
        return held, []

    def _check(self, body: str, index: int) -> dict[str, Any] | None:
        doc = _json(body.strip())
        if not isinstance(doc, dict) or doc.get("name") not in self.tools.names:
            return None
        if self.tools.choice not in ("auto", "required") and doc["name"] != self.tools.choice:
            return None
        args = doc.get("arguments", {})
        if isinstance(args, str):  # (some models write the arguments as JSON text)
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        required = self.tools.names[doc["name"]]["parameters"].get("required", [])
        if any(key not in args for key in required):
            return None
        return {
            "index": index,
            "id": call_id(),
            "type": "function",
            "function": {"name": doc["name"], "arguments": json.dumps(args, ensure_ascii=False)},
        }


def _bare(text: str) -> bool | None:
    """Whether an answer that starts with ``text`` is a call without its tags: True where it starts
    like one, False where it cannot, None while it is too short to say."""
    start = "".join(text.split())[:8]
    if any(start.startswith(form) for form in BARE):
        return True
    return None if any(form.startswith(start) for form in BARE) else False


def _json(body: str) -> Any:
    """A call's JSON as written, or in the doubled-brace form a broken template example taught
    (``{{"name": ..., "arguments": {...}}}``, its last brace doubled or not); None if neither."""
    for text in (body, body[1:-1], body[1:]) if body.startswith("{{") else (body,):
        try:
            return json.loads(text)
        except ValueError:
            continue
    return None
