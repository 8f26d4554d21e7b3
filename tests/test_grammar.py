"""Constrained output (infer/decode/grammar.py): every emitted token keeps the grammar, SpS emits exactly the
masked verifier distribution and Cactus exactly its own emitted distribution over the masked rows
(drafts the grammar refuses cut, as grammar.py argues), greedy speculation equals the greedy
verifier under the same grammar, and JSON answers validate against their schema (a byte-level
tokenizer, so JSON's characters are tokens)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from cactus_cli.core.errors import ConfigError
from cactus_cli.core.exact import emitted_distribution
from cactus_cli.core.sampling import SamplingParams, probs_from_logits
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.decode.grammar import Grammar
from cactus_cli.infer.pair.loader import load_pair
from tests.conftest import WORDS, make_byte_pair
from tests.stats_helpers import assert_matches

try:
    import llguidance  # noqa: F401
except ImportError as err:
    if os.environ.get("CI"):
        raise RuntimeError('the grammar tests need the serve extra: install ".[demo,test,eval,serve]"') from err
    pytest.skip(f"llguidance is not installed ({err})", allow_module_level=True)

WORDS3 = "(cat|dog|the)+"  # over the tiny word tokenizer: any run of these three words, nothing else
SCHEMA = {
    "type": "object",
    "properties": {"animal": {"enum": ["cat", "dog", "bird"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["animal", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def far(tiny):
    return load_pair(tiny["verifier"], tiny["draft"], None, "cpu", dtype="float32")


@pytest.fixture(scope="module")
def close(tiny):
    return load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32")


def ids(pair, text):
    return pair.tokenizer(text)["input_ids"]


def tok(pair, word):
    return pair.tokenizer.convert_tokens_to_ids(word)


def run(pair, prompt, params):
    events = list(SpeculativeEngine(pair).generate(ids(pair, prompt), params))
    return [t for ev in events for t in ev.emitted], events


def verifier_q(pair, context, sp, allowed):
    """The verifier's next-token distribution after ``context`` under ``sp``, restricted to
    ``allowed`` (the masked distribution the rules see)."""
    with torch.no_grad():
        logits = pair.verifier.model(torch.tensor([context])).logits[0, -1, : pair.vocab_size]
    mask = torch.zeros(pair.vocab_size, dtype=torch.bool)
    mask[allowed] = True
    return probs_from_logits(logits.masked_fill(~mask, float("-inf")), sp).double()


def test_sps_under_a_grammar_emits_the_masked_verifier_distribution(far):
    """The draft model disagrees often, so its drafts leave the grammar often and are cut. The first
    two tokens over N = 1500 seeds against the exact joint masked distribution: the first among
    {cat, dog, the}, the second among those or EOS (the grammar may end after one word); L1 bound
    at false-failure odds 1e-6 over the 12 cells."""
    pair = far
    sp = SamplingParams(temperature=1.5, top_k=0, top_p=1.0)
    prompt = ids(pair, "a red bird")
    words = [tok(pair, w) for w in ("cat", "dog", "the")]
    eos = 2
    q1 = verifier_q(pair, prompt, sp, words)
    exact = {}
    for t1 in words:
        q2 = verifier_q(pair, prompt + [t1], sp, words + [eos])
        for t2 in words + [eos]:
            exact[(t1, t2)] = (q1[t1] * q2[t2]).item()
    cells = sorted(exact)
    index = {c: i for i, c in enumerate(cells)}
    samples, cut = [], 0
    engine = SpeculativeEngine(pair)
    for seed in range(1500):
        params = GenerationParams(
            sampling=sp, rule="sps", num_draft_tokens=3, max_tokens=2, seed=seed, grammar=Grammar("regex", WORDS3)
        )
        events = list(engine.generate(prompt, params))
        got = [t for ev in events for t in ev.emitted]
        samples.append(index[tuple(got[:2])])
        cut += sum(3 - ev.num_drafted for ev in events if ev.num_drafted)
    assert cut > 0  # (drafts the grammar refused were cut: the case this test is about)
    assert_matches(torch.tensor(samples), torch.tensor([exact[c] for c in cells]), false_failure_odds=1e-6)


def test_cactus_under_a_grammar_emits_its_exact_distribution_over_the_masked_rows(far):
    """The first token of Cactus (delta 0.5, k = 2) under the grammar, N = 3000 seeds: a draft the
    grammar keeps was drawn from p masked and renormalized (p~), one it refuses leaves the position
    to the verifier, so the position emits P(valid) emitted(cactus, p~, q~) + P(invalid) q~; and its
    KL from q~ stays within the rule's bound. L1 bound at false-failure odds 1e-6 over the vocabulary."""
    pair = far
    sp = SamplingParams(temperature=1.5, top_k=0, top_p=1.0)
    prompt = ids(pair, "a red bird")
    words = [tok(pair, w) for w in ("cat", "dog", "the")]
    q = verifier_q(pair, prompt, sp, words)
    with torch.no_grad():
        p = probs_from_logits(pair.draft.model(torch.tensor([prompt])).logits[0, -1, : pair.vocab_size], sp).double()
    valid = p[words].sum()
    p_masked = torch.zeros_like(p)
    p_masked[words] = p[words] / valid
    exact = valid * emitted_distribution("cactus", p_masked, q, delta=0.5) + (1 - valid) * q
    assert 0.05 < valid.item() < 0.95  # (both branches happen)
    engine = SpeculativeEngine(pair)
    first = []
    for seed in range(3000):
        params = GenerationParams(
            sampling=sp,
            rule="cactus",
            rule_kwargs={"delta": 0.5},
            num_draft_tokens=2,
            max_tokens=1,
            seed=seed,
            grammar=Grammar("regex", WORDS3),
        )
        first.append(next(t for ev in engine.generate(prompt, params) for t in ev.emitted))
    assert set(first) <= set(words)
    assert_matches(torch.tensor(first), exact, false_failure_odds=1e-6)
    support = exact > 0
    kl = (exact[support] * (exact[support] / q[support]).log()).sum().item()
    assert kl <= math.log1p(2 * 0.5) + 1e-9  # (the closed form's bound; mixing with q~ only shrinks the KL)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculation_under_a_grammar_equals_the_greedy_verifier_under_it(close, far, k):
    """Every word but five (none of which starts another word), so the greedy path differs from
    the unconstrained one and drafts are both kept and refused."""
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    banned = ("the", "then", "a", "ate", "and")
    regex = "(" + "|".join(sorted((w for w in WORDS if w not in banned), key=len, reverse=True)) + ")+"
    for pair in (close, far):
        base = GenerationParams(sampling=greedy, max_tokens=24, grammar=Grammar("regex", regex))
        free, _ = run(pair, "the cat sat on the mat", dataclasses.replace(base, grammar=None, num_draft_tokens=0))
        alone, _ = run(pair, "the cat sat on the mat", dataclasses.replace(base, num_draft_tokens=0))
        spec, events = run(pair, "the cat sat on the mat", dataclasses.replace(base, num_draft_tokens=k))
        assert spec == alone
        assert alone != free  # (the grammar changed the answer)
        assert not {tok(pair, w) for w in banned} & set(alone)
        assert sum(ev.num_drafted for ev in events) > 0
        if pair is close:
            assert sum(len(ev.accepted) for ev in events) > 0


def test_a_grammar_that_does_not_compile_is_a_clear_error(far):
    engine = SpeculativeEngine(far)
    for grammar, needle in (
        (Grammar("json_schema", "{not json"), "json_schema"),
        (Grammar("regex", "(unclosed"), "regex"),
        (Grammar("lark", "start: nothing_defined"), "lark"),
    ):
        with pytest.raises(ConfigError, match=needle):
            engine.grammars.check(grammar)


# -- JSON, on a byte-level tokenizer -------------------------------------------------------------


@pytest.fixture(scope="module")
def json_folders(tmp_path_factory):
    """A tiny pair over a byte-level BPE tokenizer: every character is a token, so a JSON grammar
    can be kept."""
    return make_byte_pair(tmp_path_factory.mktemp("json_pair"))


@pytest.fixture(scope="module")
def json_pair(json_folders):
    return load_pair(json_folders["verifier"], json_folders["draft"], None, "cpu", dtype="float32")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_answers_validate_against_their_schema(json_pair, temperature):
    pair = json_pair
    sp = SamplingParams(temperature=temperature, top_k=0, top_p=1.0)
    for seed in range(4 if temperature else 1):
        # (any object only greedy: a random model sampled at T = 1 writes strings that never end)
        for grammar in (Grammar.json_schema(SCHEMA),) + ((Grammar.json_schema(),) if not temperature else ()):
            params = GenerationParams(sampling=sp, num_draft_tokens=4, max_tokens=400, seed=seed, grammar=grammar)
            tokens, events = run(pair, "the cat", params)
            assert events[-1].finish_reason == "eos", pair.tokenizer.decode(tokens)
            answer = json.loads(pair.tokenizer.decode(tokens, skip_special_tokens=True))
            assert isinstance(answer, dict)
            if grammar.text != '{"type": "object"}':
                assert set(answer) == {"animal", "n"} and answer["animal"] in ("cat", "dog", "bird")
                assert isinstance(answer["n"], int) and 0 <= answer["n"] <= 9


def test_the_server_answers_response_format_with_valid_json_whole_and_streamed(json_folders):
    from cactus_cli.app.serve.serving import Server
    from cactus_cli.app.session import Session
    from tests.test_serve import httpx, start  # (skipped there, with its reason, without the serve extra)

    session = Session.load(
        verifier=json_folders["verifier"],
        draft=json_folders["draft"],
        device="cpu",
        dtype="float32",
        num_draft_tokens=4,
        temperature=0.0,
        seed=0,
    )
    server = Server(session, max_queue=4)
    url, stop = start(server)
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
        body = {"prompt": "the cat", "max_tokens": 300, "response_format": fmt}
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        text = whole["choices"][0]["text"]
        assert whole["choices"][0]["finish_reason"] == "stop", whole
        assert json.loads(text)["animal"] in ("cat", "dog", "bird")
        assert whole["usage"]["completion_tokens"] == len(session.tokenizer(text)["input_ids"]) + 1  # (and EOS)
        streamed = ""
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        assert streamed == text
        obj = httpx.post(
            f"{url}/v1/completions", json=body | {"response_format": {"type": "json_object"}}, timeout=120
        ).json()
        assert isinstance(json.loads(obj["choices"][0]["text"]), dict)
        bad = httpx.post(
            f"{url}/v1/completions",
            json=body
            | {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            timeout=120,
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text
    finally:
        stop()
        server.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_pet"}}])
@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_tool_call_keeps_its_schema(json_pair, choice, parallel):
    """tool_choice required or named: after the forced opening the grammar holds the answer to a
    declared name, arguments valid against its schema and the closing tag, so the call checks out
    (read back by the server's own parser); with parallel calls off, the answer ends after one."""
    from cactus_cli.app.serve.tools import Calls, parse_tools

    pet = {"type": "function", "function": {"name": "set_pet", "parameters": SCHEMA}}
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    strict = {"type": "object", "properties": {"n": digit}, "required": ["n"], "additionalProperties": False}
    count = {"type": "function", "function": {"name": "count", "parameters": strict}}
    tools = parse_tools([pet, count], choice, parallel)
    pair = json_pair
    opening = pair.tokenizer(tools.opening(), add_special_tokens=False)["input_ids"]
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    for seed in range(3):
        params = GenerationParams(
            sampling=sp, num_draft_tokens=3, max_tokens=300, seed=seed, grammar=tools.grammar(pair.tokenizer)
        )
        events = list(SpeculativeEngine(pair).generate(ids(pair, "the cat") + opening, params))
        text = "".join(ev.text for ev in events)
        ended = events[-1].finish_reason == "eos"
        assert ended or parallel, text  # (a random model may go on calling, until max_tokens)
        parser = Calls(tools)
        shown, calls = parser.feed(text)
        rest, more = parser.close()
        calls += more
        assert calls and (not (shown + rest).strip() or not ended), text
        for call in calls:
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "set_pet":
                assert set(args) == {"animal", "n"} and 0 <= args["n"] <= 9
            else:
                assert choice == "required" and call["function"]["name"] == "count"
        if not parallel:
            assert len(calls) == 1
        if choice != "required":
            assert calls[0]["function"]["name"] == "set_pet"


def test_tokens_the_grammar_forces_are_free_drafts_and_the_rest_stays_exact(far):
    """The grammar forces "the cat" then allows dog or mat: the forced words come as drafts of
    source grammar (accepted: the masked verifier has nothing else), and the third word follows
    the masked verifier distribution over {dog, mat} (N = 800 seeds, false-failure odds 1e-6)."""
    pair = far
    sp = SamplingParams(temperature=1.5, top_k=0, top_p=1.0)
    prompt = ids(pair, "a red bird")
    forced = [tok(pair, "the"), tok(pair, "cat")]
    choices = [tok(pair, "dog"), tok(pair, "mat")]
    q3 = verifier_q(pair, prompt + forced, sp, choices)
    engine = SpeculativeEngine(pair)
    third = []
    for seed in range(800):
        params = GenerationParams(
            sampling=sp, num_draft_tokens=3, max_tokens=3, seed=seed, grammar=Grammar("regex", "thecat(dog|mat)")
        )
        events = list(engine.generate(prompt, params))
        got = [t for ev in events for t in ev.emitted]
        assert got[:2] == forced
        assert events[0].draft_source == "grammar" and events[0].accepted == tuple(forced)
        third.append(got[2])
    assert_matches(torch.tensor(third), q3, false_failure_odds=1e-6)


def test_greedy_under_a_grammar_that_allows_everything_equals_greedy_without_one(close, far):
    """(On the word pairs: the random byte-level pair writes broken UTF-8, which no text grammar
    allows; benchmarks/json_output.py checks the same on the embedded pair.)"""
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    # any text, and the special tokens too (a text grammar never allows them: the random tiny models
    # write <s> mid-answer)
    anything = Grammar("lark", "start: item*\nitem: /(?s:.)/ | <[0-3]>")
    for pair, prompt in ((close, "the cat sat on the mat"), (far, "a red bird")):
        for k in (0, 3):
            base = GenerationParams(sampling=greedy, num_draft_tokens=k, max_tokens=40)
            free, _ = run(pair, prompt, base)
            held, _ = run(pair, prompt, dataclasses.replace(base, grammar=anything))
            assert held == free
