"""`cactus serve` and the request fields other servers take (app/serve/http_fields.py): what does
not change the answer is taken and named in the x-cactus-ignored header, min_p and logit_bias
reach the sampling, a final assistant message is continued (prefill) as the template renders it
with continue_final_message, chat_template_kwargs reach the template, and what cactus cannot honour
is a 400 naming the field. On the tiny pair through httpx (test_serve.py's server)."""

from __future__ import annotations

import pytest

from cactus_cli.app.serve.serving import Server
from tests.test_serve import PROMPT, httpx, load_session, start

USER = [{"role": "user", "content": PROMPT}]
IGNORED = {
    "store": True,
    "metadata": {"run": "7"},
    "service_tier": "auto",
    "prediction": {"type": "content", "content": "the cat"},
    "cache_prompt": True,
    "reasoning_effort": "low",
}


@pytest.fixture(scope="module")
def session(tiny):
    return load_session(tiny)


@pytest.fixture(scope="module")
def served(session):
    server = Server(session, max_queue=4)
    url, stop = start(server)
    yield server, url
    stop()
    server.stop()


def post(url, path="/v1/chat/completions", **body):
    return httpx.post(f"{url}{path}", json={"max_tokens": 8} | body, timeout=60)


def test_fields_that_do_not_change_the_answer_are_taken_and_named_in_a_header(served):
    server, url = served
    plain = post(url, messages=USER)
    r = post(url, messages=USER, modalities=["text"], **IGNORED)
    assert r.status_code == 200, r.text
    assert r.headers["x-cactus-ignored"] == "store, metadata, service_tier, prediction, cache_prompt, reasoning_effort"
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert "x-cactus-ignored" not in plain.headers
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={"messages": USER, "stream": True, "store": False}
    ) as s:
        assert s.status_code == 200 and s.headers["x-cactus-ignored"] == "store"
        assert s.headers["cache-control"] == "no-cache"
        s.read()
    done = post(url, "/v1/completions", prompt=PROMPT, cache_prompt=True)
    assert done.status_code == 200 and done.headers["x-cactus-ignored"] == "cache_prompt"


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"modalities": ["text", "audio"]}, "modalities", "text only"),
        ({"repetition_penalty": 1.1}, "repetition_penalty", "each drafted token before the position"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported yet"),
        ({"presence_penalty": -0.5}, "presence_penalty", "not supported yet"),
        ({"logit_bias": {"cat": 1}}, "logit_bias", "is not a token id"),
        ({"logit_bias": {"100000": 1}}, "logit_bias", "is not a token id"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias", "is not a token id"),
        ({"logit_bias": {"\u0663": 1}}, "logit_bias", "is not a token id"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "from -100 to 100"),
        ({"logit_bias": {"5": "1"}}, "logit_bias", "from -100 to 100"),
        ({"min_p": 1.5}, "min_p", "min_p"),
        ({"prediction": {"type": "text"}}, "prediction", "content"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort"),
        ({"metadata": {"run": 7}}, "metadata", "metadata"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs", "does not read"),
        ({"chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs", "not a template variable"),
        ({"chat_template_kwargs": {"eos_token": "x"}}, "chat_template_kwargs", "not a template variable"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "not a template variable"),
        ({"chat_template_kwargs": {"m": {"a": 1}}}, "chat_template_kwargs", "strings, numbers, booleans"),
        ({"continue_final_message": True}, "continue_final_message", "must be an assistant's"),
        ({"max_completion_tokens": 100000}, "max_completion_tokens", "max_completion_tokens 100000 does not fit"),
    ],
)
def test_what_cactus_cannot_honour_is_a_400_naming_the_field(served, body, param, words):
    server, url = served
    r = post(url, messages=USER, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert "max_tokens" not in err["message"]  # (max_completion_tokens is named as the client sent it)
    assert post(url, messages=USER).status_code == 200


def test_the_completions_endpoint_takes_no_chat_fields(served):
    server, url = served
    r = post(url, "/v1/completions", prompt=PROMPT, continue_final_message=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_min_p_and_logit_bias_reach_the_sampling(served, session):
    server, url = served
    greedy = post(url, messages=USER, temperature=0).json()["choices"][0]["message"]["content"]
    # min_p 1 keeps only the most likely token: sampling at T = 1 gives the greedy answer
    for seed in (1, 2, 3):
        kept = post(url, messages=USER, temperature=1.0, min_p=1.0, seed=seed)
        assert kept.json()["choices"][0]["message"]["content"] == greedy
    mat = session.tokenizer.convert_tokens_to_ids("mat")
    forced = post(url, messages=USER, temperature=0, max_tokens=5, logit_bias={str(mat): 100})
    assert forced.json()["choices"][0]["message"]["content"].split() == ["mat"] * 5
    first = session.tokenizer(greedy)["input_ids"][1]  # (after <s>)
    banned = post(url, messages=USER, temperature=0, logit_bias={str(first): -100})
    assert first not in session.tokenizer(banned.json()["choices"][0]["message"]["content"])["input_ids"]
    done = post(url, "/v1/completions", prompt=PROMPT, temperature=0, max_tokens=3, logit_bias={str(mat): 100})
    assert done.json()["choices"][0]["text"].split() == ["mat"] * 3


def test_a_final_assistant_message_is_continued_not_closed(served, session):
    """As llama-server does, and vLLM with continue_final_message: the prompt is the template
    rendered with continue_final_message (the assistant's text left open), the answer only what
    follows it (it never repeats the prefill)."""
    server, url = served
    prefill = "the dog sat"
    messages = USER + [{"role": "assistant", "content": prefill}]
    tok = session.tokenizer
    ids = list(tok.apply_chat_template(messages, continue_final_message=True, tokenize=True)["input_ids"])
    closed = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert tok.decode(ids).endswith("</s> <s> <unk> the dog sat") and len(closed) > len(ids)
    for extra in (
        {},
        {"continue_final_message": True},
        {"continue_final_message": True, "add_generation_prompt": False},
    ):
        r = post(url, messages=messages, temperature=0, **extra).json()
        assert r["usage"]["prompt_tokens"] == len(ids), extra
        session.engine.reset()
        assert r["choices"][0]["message"]["content"] == session.text(ids, max_tokens=8)
        assert not r["choices"][0]["message"]["content"].startswith(prefill)
    new_turn = post(url, messages=messages, temperature=0, continue_final_message=False).json()
    assert new_turn["usage"]["prompt_tokens"] == len(closed)
    assert post(url, messages=messages, add_generation_prompt=True).json()["usage"]["prompt_tokens"] == len(closed)
    bare = list(tok.apply_chat_template(messages, tokenize=True)["input_ids"])
    assert post(url, messages=messages, add_generation_prompt=False).json()["usage"]["prompt_tokens"] == len(bare)
    both = post(url, messages=messages, continue_final_message=True, add_generation_prompt=True)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_chat_template_kwargs_and_reasoning_effort_reach_a_template_that_reads_them(served, session, monkeypatch):
    server, url = served
    template = session.tokenizer.chat_template
    monkeypatch.setattr(
        session.tokenizer,
        "chat_template",
        template + "{% if mood %}{{ mood }} {% endif %}{% if reasoning_effort %}{{ reasoning_effort }} {% endif %}",
    )
    plain = post(url, messages=USER).json()["usage"]["prompt_tokens"]
    r = post(url, messages=USER, chat_template_kwargs={"mood": "happy sad"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == plain + 2
    r = post(url, messages=USER, reasoning_effort="low")
    assert r.json()["usage"]["prompt_tokens"] == plain + 1 and "x-cactus-ignored" not in r.headers
