"""Prompt-lookup drafting: the lookup itself, greedy equality with the verifier, exact SpS with
one-hot drafts, the draft model's cache in sync when lookup and model take turns, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cactus_cli.app.config.parsing import parse_draft
from cactus_cli.cli.main import app
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.draft import Free
from cactus_cli.infer.draft.ngram import NgramDrafter
from cactus_cli.infer.pair.loader import load_pair
from tests.helpers import assert_one_line_error, pair_args
from tests.stats_helpers import assert_matches, exact_two_tokens
from tests.test_engine import hf_greedy, run

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
REPEATS = "the cat sat on the mat and the dog sat on the mat and the cat"


def drafter(seq, n_max=4, n_min=1):
    d = NgramDrafter(vocab_size=100, device=torch.device("cpu"), n_max=n_max, n_min=n_min)
    d.start(seq, [])
    return d


def lookup(seq, k, **kwargs):
    return drafter(seq, **kwargs).lookup(seq, k)  # drafters are handed the verified sequence


def test_lookup_takes_the_longest_then_most_recent_match():
    assert lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]  # the 3-gram 1 2 3
    assert lookup([5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # the latest 5 6 wins
    assert lookup([1, 2, 3, 7, 3], 5) == [7, 3]  # only a 1-gram matches; the copy stops at the end
    assert lookup([1, 2, 3, 7, 3], 5, n_min=2) == []  # ... which n_min 2 refuses
    assert lookup([1, 2, 3], 4) == []  # nothing repeats
    seq = [1, 2, 3, 4]
    d = drafter(seq)
    seq = seq + [1, 2]  # the sequence grows: 1 2 3 4 1 2
    d.accept(seq, 0)
    assert d.lookup(seq, 2) == [3, 4] and d.peek(seq).source == "ngram"
    probs = d.propose(seq, 2, SamplingParams(1.0, 0, 1.0), None).probs
    assert probs.shape == (2, 100) and probs[0, 3] == 1.0 and probs.sum() == 2.0  # one-hot rows


def test_parse_draft():
    assert parse_draft("ngram") == ("ngram", None)
    assert parse_draft("ngram+embedded:x") == ("ngram", "embedded:x")
    assert parse_draft("suffix") == ("suffix", None)
    assert parse_draft("suffix+embedded:x") == ("suffix", "embedded:x")
    assert parse_draft("some/model") == (None, "some/model")
    assert parse_draft(None) == (None, None)


@pytest.fixture(scope="module")
def pairs(tiny):
    return {
        "alone": load_pair(tiny["verifier"], None, None, "cpu", dtype="float32"),
        "close": load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32"),
    }


@pytest.mark.parametrize("which", ["alone", "close"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_with_lookup_equals_the_verifier_and_caches_stay_exact(pairs, which, adaptive):
    pair = pairs[which]
    engine = SpeculativeEngine(pair, Free("ngram", {"ngram_max": 3, "ngram_min": 1}))
    ids = pair.tokenizer(REPEATS)["input_ids"]
    n = 40
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=4, adaptive_k=adaptive, max_tokens=n, ignore_eos=True)
    tokens, sources, emitted = [], set(), 0
    for ev in engine.generate(ids, params):
        tokens += ev.emitted
        emitted += len(ev.emitted)
        sources.add(ev.draft_source)
        lengths = engine.cache_lengths()
        assert lengths["verifier"] == lengths["sequence"] - 1 == len(ids) + emitted - 1
        if which == "close":  # the model's cache holds the sequence minus what it has yet to be fed
            assert lengths["draft"] + lengths["draft_pending"] == lengths["sequence"]
    assert tokens == hf_greedy(pair, ids, n)
    assert "ngram" in sources
    if which == "close" and not adaptive:
        assert "model" in sources  # both drafted, and the model caught up after sitting out


def test_sps_with_lookup_drafts_reproduces_the_verifier_distribution(pairs):
    # Same test as for the draft model (test_engine), with one-hot n-gram drafts: the first two
    # tokens' joint distribution over 1500 seeds equals the verifier's exact one (L1 bound,
    # false-failure odds 1e-4). The prompt repeats, so the lookup drafts at both positions.
    pair = pairs["alone"]
    sp = SamplingParams(temperature=1.5, top_k=3, top_p=1.0)
    ids = pair.tokenizer("the dog sat the dog sat the dog")["input_ids"]
    exact = exact_two_tokens(pair, ids, sp)
    cells = sorted(exact)
    index = {c: i for i, c in enumerate(cells)}
    engine = SpeculativeEngine(pair, Free("ngram", {"ngram_max": 2, "ngram_min": 1}))
    samples, drafted = [], 0
    for seed in range(1500):
        params = GenerationParams(sampling=sp, rule="sps", num_draft_tokens=2, max_tokens=2, ignore_eos=True, seed=seed)
        tokens, stats, _ = run(engine, ids, params)
        drafted += stats.num_draft_tokens
        samples.append(index[tuple(tokens[:2])])
    assert drafted > 1000  # the lookup really drafted
    assert_matches(torch.tensor(samples), torch.tensor([exact[c] for c in cells]), false_failure_odds=1e-4)


def test_cli_lookup_drafting(tiny):
    runner = CliRunner()
    args = ["--verifier", tiny["verifier"], "--device", "cpu", "--dtype", "float32"]
    r = runner.invoke(
        app,
        [
            "generate",
            REPEATS,
            *args,
            "--draft",
            "ngram",
            "-n",
            16,
            "-k",
            "auto",
            "--temperature",
            0,
            "--no-chat-template",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["stats"]["draft_sources"]["ngram"]["drafted"] > 0
    assert doc["stats"]["draft_forward_passes"] == 0  # no draft model at all
    assert doc["cost_model"]["draft_source"] == "ngram"
    r = runner.invoke(
        app,
        [
            "bench",
            *pair_args(tiny, "draft_close"),
            "--draft",
            f"ngram+{tiny['draft_close']}",
            "--category",
            "grounded",
            "--limit",
            1,
            "-n",
            8,
            "--rules",
            "sps,cactus",
            "-k",
            "2,auto",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["results"]
    assert {row["config"] for row in rows} >= {"verifier alone", "sps k=2", "cactus δ=1 k=auto"}
    assert_one_line_error(
        runner.invoke(app, ["generate", "hi", *args, "--draft", "ngram+"]), "ngram+MODEL needs a model"
    )
    assert_one_line_error(
        runner.invoke(app, ["bench", *args, "--draft", "ngram", "--category", "poems"]), "nothing in category 'poems'"
    )
