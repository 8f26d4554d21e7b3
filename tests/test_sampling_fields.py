"""min_p and logit_bias (serve's vLLM / OpenAI fields): per-row transforms of the logits, applied to
the verifier's q (what every rule targets) and to the draft's p alike. Hand-built logits for the
transforms, then the engine: greedy speculative output equals the verifier's greedy argmax of the
biased logits token for token, and SpS's first two tokens follow the verifier's warped joint
distribution."""

from __future__ import annotations

import math

import pytest
import torch

from cactus_cli.core.sampling import SamplingParams, biased, probs_from_logits, top_probs
from cactus_cli.core.stats import SpecStats
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.pair.loader import load_pair
from tests.stats_helpers import assert_matches, exact_two_tokens


def test_min_p_keeps_the_tokens_within_a_share_of_the_most_likely_and_renormalizes():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))  # [2, 4]
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5)
    q = probs_from_logits(logits, sp)
    assert torch.allclose(q, torch.tensor([[0.625, 0.375, 0.0, 0.0], [0.0, 0.0, 0.375, 0.625]]))
    small, ids = top_probs(logits, SamplingParams(1.0, 3, 1.0, min_p=0.5))  # the top-k path alike
    assert torch.allclose(small, torch.tensor([[0.625, 0.375, 0.0], [0.625, 0.375, 0.0]]))
    assert ids[:, :2].tolist() == [[0, 1], [3, 2]]
    assert torch.equal(probs_from_logits(logits, SamplingParams(1.0, 0, 1.0)), torch.softmax(logits, -1))


def test_logit_bias_is_added_before_the_softmax_and_skips_ids_past_the_row():
    logits = torch.zeros(2, 3)  # [2, 3]
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, logit_bias=((1, math.log(2.0)), (2, -100.0), (7, 5.0)))
    assert biased(logits, SamplingParams()) is logits  # (no bias: no copy)
    assert torch.allclose(biased(logits, sp)[0], torch.tensor([0.0, math.log(2.0), -100.0]))
    assert torch.equal(logits, torch.zeros(2, 3))  # (a new tensor)
    q = probs_from_logits(logits, sp)
    assert torch.allclose(q, torch.tensor([[1 / 3, 2 / 3, 0.0]] * 2), atol=1e-6)


@pytest.fixture(scope="module")
def pairs(tiny):
    def load(draft):
        return load_pair(tiny["verifier"], tiny[draft] if draft else None, None, "cpu", dtype="float32")

    return {"disagree": load("draft"), "close": load("draft_close"), "padded": load("draft_padded")}


def run(engine, ids, params):
    stats, tokens = SpecStats(), []
    for ev in engine.generate(ids, params):
        stats.update(ev)
        tokens += ev.emitted
    return tokens, stats


def verifier_greedy(pair, ids, n, sp):
    """The verifier alone, one argmax of the biased logits at a time."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = pair.verifier.model(torch.tensor([ids + out])).logits[0, -1, : pair.vocab_size]
            out.append(int(biased(logits, sp).argmax()))
    return out


@pytest.mark.parametrize("draft", ["disagree", "close", "padded"])
def test_greedy_speculative_with_a_logit_bias_equals_the_biased_verifier_greedy(pairs, draft):
    pair = pairs[draft]
    ids = pair.tokenizer("the cat sat on the mat and then")["input_ids"]
    plain = verifier_greedy(pair, ids, 12, SamplingParams(0.0, 0, 1.0))
    bias = ((plain[0], -100.0), (plain[1], -100.0), (plain[2], 3.0))  # banned, banned, favoured
    sp = SamplingParams(0.0, 0, 1.0, logit_bias=bias)
    expected = verifier_greedy(pair, ids, 12, sp)
    assert expected != plain and plain[0] not in expected and plain[1] not in expected  # (the bias bites)
    params = GenerationParams(sampling=sp, rule="sps", num_draft_tokens=3, max_tokens=12, ignore_eos=True)
    tokens, stats = run(SpeculativeEngine(pair), ids, params)
    assert tokens == expected
    assert stats.num_draft_tokens > 0


def test_sps_with_min_p_and_a_logit_bias_reproduces_the_warped_verifier_distribution_of_two_tokens(pairs):
    # The first two tokens' joint distribution over 1000 seeds must equal the verifier's exact one
    # after the bias, T = 1.5 and min_p 0.3 (the draft's p warped alike): L1 bound at false-failure
    # odds 1e-4 (stats_helpers). min_p and the bias must change that distribution, or it tests nothing.
    pair = pairs["disagree"]
    ids = pair.tokenizer("the dog")["input_ids"]
    plain = SamplingParams(temperature=1.5, top_k=0, top_p=1.0)
    first = int(
        probs_from_logits(pair.verifier.model(torch.tensor([ids])).logits[0, -1, : pair.vocab_size], plain).argmax()
    )
    sp = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.3, logit_bias=((first, -2.0),))
    exact = exact_two_tokens(pair, ids, sp)
    assert len(exact) < len(exact_two_tokens(pair, ids, plain))  # (min_p cuts)
    cells = sorted(exact)
    index = {c: i for i, c in enumerate(cells)}
    engine = SpeculativeEngine(pair)
    samples = []
    for seed in range(1000):
        params = GenerationParams(sampling=sp, rule="sps", num_draft_tokens=2, max_tokens=2, ignore_eos=True, seed=seed)
        tokens, _ = run(engine, ids, params)
        samples.append(index[tuple(tokens[:2])])  # KeyError = a token the warped verifier cannot emit
    assert_matches(torch.tensor(samples), torch.tensor([exact[c] for c in cells]), false_failure_odds=1e-4)
