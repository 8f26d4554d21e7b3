"""The fifth round's tool-call cases (``tools``): tool_choice auto, required, named and none under
every decoding setting, malformed and oversized tool declarations, and histories with calls and
their results, each with the statuses it may get and the check of a 200 answer.
"""

from __future__ import annotations

import json

from sweep_fifth_checks import CITY, PET, TOOLS, C, P, X, chat, check_calls, comp, fn, forced, no_calls


def tool_cases() -> list[tuple]:
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
    return [
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
    ]
