"""Tool calls and log-probabilities through `cactus serve`: the request checks, the
rendering through the chat template, the reading of the model's calls (whole and streamed), and
each token's log-probability against the verifier's own full forward."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")  # (the serve extra; test_serve says so on CI)
openai = pytest.importorskip("openai")

from cactus_cli.app.serve import tools as T  # noqa: E402
from cactus_cli.app.serve.serving import FieldError, Server  # noqa: E402
from cactus_cli.app.session import Session  # noqa: E402
from cactus_cli.core.events import Piece  # noqa: E402

from .test_serve import PROMPT, httpx, start  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# a template with a tools section in the Hermes format (the tiny tokenizer's words, and the tags)
TOOLS_TEMPLATE = (
    "{% if tools %}<s> system {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<tool_call> </s> {% endif %}"
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %} <tool_call> {{ c['function']['arguments'] | tojson }} </tool_call>{% endfor %}"
    " </s> {% endfor %}{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def tools(**kw) -> T.Tools:
    return T.parse_tools([WEATHER], kw.get("choice"), kw.get("parallel"))


# --- the request's tools, checked -------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, choice, param, words",
    [
        ([{"type": "function"}], None, "tools", "tools[0] must be"),
        ([{"type": "function", "function": {"name": "no spaces"}}], None, "tools", "function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, "tools", "object"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}],
            None,
            "tools",
            "properties",
        ),
        ([WEATHER, WEATHER], None, "tools", "declared twice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "'nope'"),
        ([WEATHER], "sometimes", "tool_choice", "must be 'auto'"),
        (None, "required", "tool_choice", "declares no tools"),
    ],
)
def test_bad_tools_are_a_field_error(given, choice, param, words):
    with pytest.raises(FieldError) as err:
        T.parse_tools(given, choice, None)
    assert err.value.param == param and words in str(err.value)


def test_tool_choice_none_renders_no_tools_and_a_named_call_is_forced():
    assert T.parse_tools([WEATHER], "none", None) is None
    named = T.parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, False)
    assert named.choice == "get_weather" and not named.parallel
    assert named.opening() == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert tools().opening() == "" and tools(choice="required").opening() == '<tool_call>\n{"name": "'


def test_history_calls_become_objects_and_a_tool_result_needs_its_call():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    out = T.template_messages(history)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    with pytest.raises(FieldError, match=r"messages\[2\] is a tool result for call 'c2'"):
        T.template_messages(history[:2] + [{"role": "tool", "tool_call_id": "c2", "content": "rain"}])
    with pytest.raises(FieldError, match="not valid JSON"):
        bad = {**call, "function": {"name": "get_weather", "arguments": "{city"}}
        T.template_messages([history[0], {"role": "assistant", "content": "", "tool_calls": [bad]}])


# --- the model's calls, read from its text ------------------------------------------------------------


def read(parser: T.Calls, pieces: list[str]) -> tuple[str, list[dict]]:
    shown, calls = [], []
    for piece in pieces:
        text, new = parser.feed(piece)
        shown.append(text)
        calls += new
    text, new = parser.close()
    return "".join(shown) + text, calls + new


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 1000])
def test_a_call_is_read_whole_however_the_text_arrives(cut):
    answer = "Let me look." + CALL + "\n" + CALL.replace("Paris", "Rome")
    text, calls = read(T.Calls(tools()), [answer[i : i + cut] for i in range(0, len(answer), cut)])
    assert text.strip() == "Let me look."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert [c["index"] for c in calls] == [0, 1] and all(c["id"].startswith("call_") for c in calls)
    assert all(c["function"]["name"] == "get_weather" for c in calls)


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris"',  # not JSON
        '{"name": "get_time", "arguments": {}}',  # not declared
        '{"name": "get_weather", "arguments": {"town": "Paris"}}',  # a required key missing
        '{"name": "get_weather", "arguments": [1]}',  # not an object
    ],
)
def test_a_call_that_does_not_check_out_stays_text(body):
    answer = "<tool_call>\n" + body + "\n</tool_call>"
    assert read(T.Calls(tools()), [answer]) == (answer, [])


DOUBLED = '{{"name": "get_weather", "arguments": {"city": "Paris"}}}'


@pytest.mark.parametrize(
    "answer",
    [
        "<tool_call>\n" + DOUBLED + "\n</tool_call>",  # as the broken template example taught
        "<tool_call>\n" + DOUBLED[:-1] + "\n</tool_call>",  # (its last brace not doubled)
        DOUBLED,  # no tags: the whole answer is the call
        "\n" + DOUBLED[1:-1] + "\n",
        DOUBLED[:-1],
    ],
)
@pytest.mark.parametrize("cut", [1, 3, 1000])
def test_a_call_in_the_doubled_brace_form_or_without_tags_is_read(answer, cut):
    text, calls = read(T.Calls(tools()), [answer[i : i + cut] for i in range(0, len(answer), cut)])
    assert text.strip() == "" and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]


@pytest.mark.parametrize(
    "answer",
    [
        '{"name": "Bob", "age": 3}',  # JSON, not a call
        '{"name": "get_weather", "arguments": {"city": "Paris"}} and more',  # a call's JSON, then text
        'It is {"name": "get_weather", "arguments": {"city": "Paris"}}',  # text, then a call's JSON
        "{{ not json",
    ],
)
def test_json_that_is_not_a_whole_call_stays_text(answer):
    assert read(T.Calls(tools()), [answer[i : i + 2] for i in range(0, len(answer), 2)]) == (answer, [])


def test_text_that_cannot_be_a_call_is_shown_at_once():
    parser = T.Calls(tools())
    assert parser.feed("\n") == ("", [])  # (undecided)
    assert parser.feed("{") == ("", [])
    assert parser.feed('"city"') == ('\n{"city"', [])
    assert T.Calls(tools()).feed("Sunny") == ("Sunny", [])


def test_one_call_when_parallel_calls_are_off_and_a_forced_opening_is_read_back():
    parser = T.Calls(tools(parallel=False))
    text, calls = parser.feed(CALL + CALL)
    assert len(calls) == 1 and parser.done
    forced = T.Calls(tools(choice="required"))  # the prompt ended with the opening: the text continues it
    assert read(forced, ['get_weather", "arguments": {"city": "Paris"}}\n'])[1][0]["function"]["name"] == "get_weather"
    text, calls = read(T.Calls(tools()), ["ok <tool", "_call", "> no"])  # the end without a close
    assert calls == [] and text == "ok <tool_call> no"


def test_the_embedded_models_template_renders_tools_calls_and_results(tiny):
    """The embedded Qwen2.5's chat template (tests/data, as its GGUF carries it) renders the
    declared tools, an earlier call with its arguments as an object, and the call's result."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["verifier"])
    tok.chat_template = (Path(__file__).parent / "data" / "qwen2.5_chat_template.jinja").read_text()
    assert T.supports_tools(tok)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = T.template_messages(
        [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        ]
    )
    text = tok.apply_chat_template(history, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert json.dumps(WEATHER) in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nrain\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_the_embedded_templates_tool_call_example_is_single_braced_json(tiny, tmp_path):
    """Rendered with tools, the embedded Qwen2.5's template (as its GGUF carries it) taught the call
    format as ``{{"name": <function-name>, "arguments": <args-json-object>}}``, and the model wrote
    its calls that way: the tokenizer is loaded with that example corrected; other templates are
    loaded as they are."""
    from transformers import AutoTokenizer

    from cactus_cli.infer.load.sources import Source, load_tokenizer

    tok = AutoTokenizer.from_pretrained(tiny["verifier"])
    tok.chat_template = (Path(__file__).parent / "data" / "qwen2.5_chat_template.jinja").read_text()
    tok.save_pretrained(tmp_path / "qwen")
    loaded = load_tokenizer(Source("folder", str(tmp_path / "qwen")))
    messages = [{"role": "user", "content": "weather?"}]
    text = loaded.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    example = text.split("XML tags:\n<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0]
    filled = example.replace("<function-name>", '"get_weather"').replace("<args-json-object>", '{"city": "Paris"}')
    assert json.loads(filled) == {"name": "get_weather", "arguments": {"city": "Paris"}}, example
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )  # (without tools: the same prompt)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(tmp_path / "other")
    assert load_tokenizer(Source("folder", str(tmp_path / "other"))).chat_template == TOOLS_TEMPLATE


# --- through the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny):
    session = Session.load(
        verifier=tiny["verifier"],
        draft=tiny["draft_close"],
        device="cpu",
        dtype="float32",
        num_draft_tokens=3,
        max_tokens=12,
        temperature=0.0,
        seed=0,
    )
    server = Server(session, max_queue=4)
    url, stop = start(server)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield session, server, url, client
    stop()
    server.stop()


@pytest.fixture
def scripted(served, monkeypatch):
    """The model's answer replaced by ``said["text"]`` (its first step carries it all; the rest
    of the steps say nothing), and a template with a tools section."""
    session, server, url, client = served
    monkeypatch.setattr(session.tokenizer, "chat_template", TOOLS_TEMPLATE)
    said = {"text": CALL, "prompts": []}
    real = server.batch.step

    def step():
        out = []
        for entry, ev in real():
            if not isinstance(ev, BaseException):
                first = ev.pieces and not said.get("sent")
                text = said["text"] if first else ""
                said["sent"] = said.get("sent") or bool(first)
                ev = dataclasses.replace(ev, pieces=(Piece(text, "verifier"),))
            out.append((entry, ev))
        return out

    monkeypatch.setattr(server.batch, "step", step)
    yield said
    said["sent"] = False


def test_a_call_comes_back_as_tool_calls_whole_and_streamed(served, scripted):
    session, server, url, client = served
    messages = [{"role": "user", "content": "the weather in paris"}]
    r = client.chat.completions.create(model=server.model_id, messages=messages, tools=[WEATHER], max_tokens=4)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    scripted["sent"] = False
    stream = client.chat.completions.create(
        model=server.model_id, messages=messages, tools=[WEATHER], max_tokens=4, stream=True
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the next turn: the call and its result in the history
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    scripted["sent"], scripted["text"] = False, "it is sunny"
    r = client.chat.completions.create(model=server.model_id, messages=history, tools=[WEATHER], max_tokens=4)
    assert r.choices[0].message.content == "it is sunny" and r.choices[0].finish_reason != "tool_calls"


@pytest.mark.parametrize(
    "said, content",
    [
        ("\n" + CALL + "\n", None),  # (the Qwen2.5 template puts a newline before each call)
        ("Let me look.\n" + CALL, "Let me look."),
        (" Sunny.\n\n", " Sunny.\n\n"),  # no call: the text as written
    ],
)
def test_the_streamed_text_of_an_answer_with_tools_is_the_whole_answers(served, scripted, said, content):
    session, server, url, client = served
    scripted["text"] = said
    body = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [WEATHER],
        "max_tokens": 4,
    }
    whole = client.chat.completions.create(**body).choices[0].message
    assert whole.content == content and bool(whole.tool_calls) == (CALL in said)
    scripted["sent"] = False
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**body, stream=True) if c.choices]
    assert "".join(d.content or "" for d in deltas) == (content or "")
    assert all(d.content != "\n" for d in deltas)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools", "parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "'g'"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c9", "content": "y"}]},
            "messages",
            "no earlier assistant message made that call",
        ),
        ({"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0 to 20"),
    ],
)
def test_bad_tool_requests_are_a_400_naming_the_field(served, scripted, body, param, words):
    session, server, url, client = served
    payload = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2} | body
    r = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"], (
        r.text
    )
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_a_template_without_tools_refuses_them(served):
    session, server, url, client = served
    payload = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "tools": [WEATHER]}
    r = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "tools section" in r.text


# --- logprobs ---------------------------------------------------------------------------------------------


def full_forward_logprobs(session, prompt_ids: list[int], out: list[int]) -> torch.Tensor:
    """log q(token) of each output token from one full forward of the verifier (no cache)."""
    lm = session.engine.pair.verifier.model
    ids = torch.tensor([prompt_ids + out])
    with torch.no_grad():
        logits = lm(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("draft", [True, False])
def test_each_tokens_logprob_is_the_verifiers_drafted_or_not(served, draft):
    session, server, url, client = served
    messages = [{"role": "user", "content": PROMPT}]
    extra = {} if draft else {"draft": "none"}
    body = {"messages": messages, "max_tokens": 10, "logprobs": True, "top_logprobs": 3, "temperature": 0} | extra
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    entries = r["choices"][0]["logprobs"]["content"]
    assert len(entries) == r["usage"]["completion_tokens"] > 0
    if draft:
        assert r["speculative"]["accepted"] > 0  # (some of these tokens were drafted)
    tok = session.tokenizer
    out = [tok.convert_tokens_to_ids(tok.tokenize(e["token"]))[0] for e in entries]
    want = full_forward_logprobs(session, session.encode(messages), out)
    for i, e in enumerate(entries):
        assert e["logprob"] == pytest.approx(want[i, out[i]].item(), abs=1e-4)
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]  # (greedy: the argmax)
        assert [a["logprob"] for a in e["top_logprobs"]] == pytest.approx(want[i].topk(3).values.tolist(), abs=1e-4)
    streamed = httpx.post(f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=60).text
    lines = [json.loads(x[6:]) for x in streamed.splitlines() if x.startswith("data: {")]
    got = [e for c in lines for ch in c["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in got] == [e["token"] for e in entries]
    plain = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "logprobs": 2}, timeout=60)
    lp = plain.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0


def test_an_answer_that_ends_by_itself_has_one_logprob_per_counted_token(served, monkeypatch):
    """The end token is counted in usage (as vLLM counts it), so it has its entry too (as vLLM
    gives it): one entry per completion token, whole and streamed, chat and completions."""
    session, server, url, client = served
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10, "temperature": 0}
    first = httpx.post(f"{url}/v1/chat/completions", json=body | {"logprobs": True}, timeout=60).json()
    fourth = first["choices"][0]["logprobs"]["content"][3]["token"]
    end = session.tokenizer.convert_tokens_to_ids(fourth)
    monkeypatch.setattr(session.engine, "eos", {*session.engine.eos, end})  # the greedy answer's 4th token ends it
    body |= {"logprobs": True, "top_logprobs": 3}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 4
    entries = r["choices"][0]["logprobs"]["content"]
    assert len(entries) == 4 and entries[-1]["token"] == fourth and len(entries[-1]["top_logprobs"]) == 3
    streamed = httpx.post(
        f"{url}/v1/chat/completions",
        json=body | {"stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    ).text
    lines = [json.loads(x[6:]) for x in streamed.splitlines() if x.startswith("data: {")]
    got = [e for c in lines for ch in c["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in got] == [e["token"] for e in entries] and lines[-1]["usage"]["completion_tokens"] == 4
    plain = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 2}
    third = httpx.post(f"{url}/v1/completions", json=plain, timeout=60).json()["choices"][0]["logprobs"]["tokens"][2]
    monkeypatch.setattr(session.engine, "eos", {*session.engine.eos, session.tokenizer.convert_tokens_to_ids(third)})
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/completions", json=plain | {"stream": stream}, timeout=60)
        if stream:
            chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            tokens = [
                t for c in chunks for ch in c["choices"] for t in ((ch.get("logprobs") or {}).get("tokens") or [])
            ]
        else:
            lp = r.json()["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == r.json()["usage"]["completion_tokens"] == 3
            tokens = lp["tokens"]
        assert len(tokens) == 3 and tokens[-1] == third
