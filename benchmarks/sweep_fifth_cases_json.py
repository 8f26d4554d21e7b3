"""The fifth round's JSON-output and log-probability cases (``json``, ``logprobs``): json_object
and json_schema under every decoding setting, schemas nothing satisfies or that are costly to
compile, and top_logprobs / logprobs on both routes, each with the statuses it may get and the
check of a 200 answer.
"""

from __future__ import annotations

from sweep_fifth_checks import PET, C, P, X, chat, comp, json_answer, logprobs_ok, schema_fmt


def json_cases() -> list[tuple]:
    """(surface, name, path, body, accepted statuses, check of a 200 body or None)."""
    return [
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
    ]


def logprob_cases() -> list[tuple]:
    """(surface, name, path, body, accepted statuses, check of a 200 body or None)."""
    return [
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
