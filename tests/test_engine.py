"""The engine on tiny model pairs: greedy equality with the verifier's own generate(), lossless
SpS end to end, cache bookkeeping, forward-pass counts, stops."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from cactus_cli.core.errors import ContextLimitError, ModelError
from cactus_cli.core.sampling import SamplingParams, probs_from_logits
from cactus_cli.core.stats import SpecStats
from cactus_cli.infer.backends.torch.compiled import compile_problem
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.kpolicy.policy import AdaptiveK
from cactus_cli.infer.pair.loader import load_pair
from tests.stats_helpers import assert_matches, exact_two_tokens

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def pairs(tiny):
    def load(draft):
        return load_pair(tiny["verifier"], tiny[draft] if draft else None, None, "cpu", dtype="float32")

    return {
        "disagree": load("draft"),
        "close": load("draft_close"),
        "padded": load("draft_padded"),
        "self": load("verifier"),
        "alone": load(None),
    }


def prompt_ids(pair, text="the cat sat on the mat and then"):
    return pair.tokenizer(text)["input_ids"]


def run(engine, ids, params):
    stats, tokens, events = SpecStats(), [], []
    for ev in engine.generate(ids, params):
        stats.update(ev)
        tokens += ev.emitted
        events.append(ev)
    return tokens, stats, events


def hf_greedy(pair, ids, n):
    out = pair.verifier.model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=3
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("draft", ["disagree", "close", "padded", "self", "alone"])
def test_greedy_speculative_equals_verifier_generate(pairs, k, draft):
    pair = pairs[draft]
    ids = prompt_ids(pair)
    n = 40
    params = GenerationParams(
        sampling=GREEDY,
        rule="cactus",
        rule_kwargs={"delta": 1.0},
        num_draft_tokens=k if pair.draft else 0,
        max_tokens=n,
        ignore_eos=True,
    )
    tokens, stats, _ = run(SpeculativeEngine(pair), ids, params)
    assert tokens == hf_greedy(pair, ids, n)
    assert stats.num_output_tokens == n


def test_draft_equal_to_verifier_accepts_every_draft(pairs):
    pair = pairs["self"]
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=4, max_tokens=41, ignore_eos=True)
    _, stats, _ = run(SpeculativeEngine(pair), prompt_ids(pair), params)
    assert stats.draft_acceptance_rate == 1.0
    assert stats.mean_acceptance_length == 5.0
    # sampling: p and q agree up to float rounding, so acceptance is (almost surely) total
    params = GenerationParams(
        sampling=SamplingParams(1.0, 0, 1.0), rule="sps", num_draft_tokens=4, max_tokens=41, ignore_eos=True, seed=5
    )
    _, stats, _ = run(SpeculativeEngine(pair), prompt_ids(pair), params)
    assert stats.draft_acceptance_rate >= 0.99


def test_test_drafts_cover_rejection_and_partial_acceptance(pairs):
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=4, max_tokens=60, ignore_eos=True)
    _, stats, _ = run(SpeculativeEngine(pairs["disagree"]), prompt_ids(pairs["disagree"]), params)
    assert stats.draft_acceptance_rate < 0.5
    _, stats, _ = run(SpeculativeEngine(pairs["close"]), prompt_ids(pairs["close"]), params)
    assert 0.2 < stats.draft_acceptance_rate < 0.95  # so crops land mid-proposal
    assert sum(stats.acceptance_histogram[1:4]) > 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_sps_end_to_end_reproduces_the_verifier_distribution_of_two_tokens(pairs, adaptive, monkeypatch):
    # The first two generated tokens' joint distribution over many seeds must equal the verifier's
    # exact one (top-k 3 sampling: 9 cells). N = 1500 runs; L1 bound at false-failure odds 1e-4.
    # With -k auto the k of each step comes from the policy: here its real choice on the first run
    # of each seed's step, overridden on every third step by a scripted 0/1/2 cycle so all three k
    # (and the draft's catch-up after k = 0) are exercised; the choice never sees the current step.
    # The compiled engine's twin is the next test (longer sequences, fewer prefills).
    pair = pairs["disagree"]
    sp = SamplingParams(temperature=1.5, top_k=3, top_p=1.0)
    ids = prompt_ids(pair, "the dog")
    exact = exact_two_tokens(pair, ids, sp)
    cells = sorted(exact)
    index = {c: i for i, c in enumerate(cells)}
    engine = SpeculativeEngine(pair)
    if adaptive:
        real_settle, calls = AdaptiveK.settle, itertools.count()
        script = itertools.cycle([0, 1, 2, 2, 0, 1])

        def settle(self, want, k):
            k = real_settle(self, want, k)
            return min(next(script), want.k_max) if next(calls) % 3 else k

        monkeypatch.setattr(AdaptiveK, "settle", settle)
    samples, ks = [], set()
    for seed in range(1500):
        params = GenerationParams(
            sampling=sp,
            rule="sps",
            num_draft_tokens=2,
            adaptive_k=adaptive,
            max_tokens=3 if adaptive else 2,
            ignore_eos=True,
            seed=seed,
        )
        tokens, _, events = run(engine, ids, params)
        ks.update(ev.num_drafted for ev in events)
        samples.append(index[tuple(tokens[:2])])  # KeyError = a token the verifier cannot emit
    if adaptive:
        assert ks == {0, 1, 2}
    assert_matches(torch.tensor(samples), torch.tensor([exact[c] for c in cells]), false_failure_odds=1e-4)


def test_sps_compiled_emits_every_token_from_the_verifier_distribution(pairs):
    """The compiled engine (static caches, compiled steps, rewinds) under SpS: every emitted token
    of 50 sequences of 30 tokens must be a draw from the verifier's own distribution given the
    tokens before it. Randomized PIT (Rosenblatt): u = F(x-) + U q_x is i.i.d. uniform on [0, 1)
    exactly when each token is drawn from q; 1500 u's in 10 bins, L1 bound at false-failure odds
    1e-4 (the eager test above: 1500 samples in 9 cells, the same odds). Few, long sequences
    keep the compiled graphs busy instead of re-prefilling 1500 times."""
    if compile_problem(torch.device("cpu")) is not None:
        pytest.skip(f"torch.compile cannot run here: {compile_problem(torch.device('cpu'))}")
    pair = pairs["disagree"]
    sp = SamplingParams(temperature=1.5, top_k=3, top_p=1.0)
    ids = prompt_ids(pair, "the dog")
    engine = SpeculativeEngine(pair, compiled=True)
    length, u, drafted = 30, [], set()
    uniform = torch.Generator().manual_seed(0)
    for seed in range(50):
        params = GenerationParams(
            sampling=sp, rule="sps", num_draft_tokens=2, max_tokens=length, ignore_eos=True, seed=seed
        )
        tokens, _, events = run(engine, ids, params)
        drafted.update(len(ev.accepted) for ev in events if ev.num_drafted)
        with torch.no_grad():  # teacher-forced: q at every generated position, given the tokens before it
            logits = pair.verifier.model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :, : pair.vocab_size]
        q = probs_from_logits(logits, sp).double()  # [length, V]
        x = torch.tensor(tokens)
        qx = q.gather(1, x.view(-1, 1)).squeeze(1)
        assert (qx > 0).all(), "the engine emitted a token the verifier cannot emit"
        below = torch.where(torch.arange(q.shape[1]).view(1, -1) < x.view(-1, 1), q, 0.0).sum(1)
        u += (below + torch.rand(length, generator=uniform, dtype=torch.float64) * qx).tolist()
    assert drafted >= {0, 1, 2}  # rejections at both positions and full acceptances (bonus tokens)
    bins = (torch.tensor(u) * 10).long().clamp(max=9)
    assert_matches(bins, torch.full((10,), 0.1), false_failure_odds=1e-4)


@pytest.mark.parametrize(
    "draft,k,temperature",
    [("disagree", 3, 1.0), ("self", 4, 0.7), ("close", 4, 0.8), ("close", 3, 0.0), ("padded", 2, 0.0)],
)
def test_caches_track_the_sequence_after_every_step(pairs, draft, k, temperature):
    pair = pairs[draft]
    engine = SpeculativeEngine(pair)
    ids = prompt_ids(pair)
    params = GenerationParams(
        sampling=SamplingParams(temperature, 0, 1.0),
        rule="cactus",
        rule_kwargs={"delta": 0.5},
        num_draft_tokens=k,
        max_tokens=30,
        ignore_eos=True,
        seed=1,
    )
    emitted = 0
    for ev in engine.generate(ids, params):
        emitted += len(ev.emitted)
        lengths = engine.cache_lengths()
        assert lengths["sequence"] == len(ids) + emitted
        assert lengths["verifier"] == lengths["sequence"] - 1  # all but the token the next step feeds
        assert lengths["draft"] + lengths["draft_pending"] == lengths["sequence"]
        assert 1 <= lengths["draft_pending"] <= 2  # never more than the bonus and the last draft


def test_forward_passes_one_verifier_call_per_step(pairs):
    pair = pairs["disagree"]
    k = 4
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=k, max_tokens=40, ignore_eos=True)
    _, stats, events = run(SpeculativeEngine(pair), prompt_ids(pair), params)
    assert stats.verifier_forward_passes == 1 + stats.num_steps  # prefill + one per step
    assert stats.draft_forward_passes == 1 + sum(ev.num_drafted for ev in events)  # prefill + k per step
    assert all(ev.verifier_forward_passes == 1 for ev in events[1:])


def test_stop_conditions(pairs):
    pair = pairs["disagree"]
    engine = SpeculativeEngine(pair)
    ids = prompt_ids(pair)
    base = GenerationParams(sampling=GREEDY, num_draft_tokens=3, max_tokens=30, ignore_eos=True)
    tokens, stats, events = run(engine, ids, base)
    assert len(tokens) == 30 and stats.finish_reason == "length"
    text = "".join(ev.text for ev in events)
    # a stop string cuts the text where it starts
    word = text.split()[5]
    stop = GenerationParams(**{**base.__dict__, "stop": (" " + word,)})
    _, stats, events = run(engine, ids, stop)
    assert stats.finish_reason == "stop"
    assert "".join(ev.text for ev in events) == text[: text.index(" " + word)]
    # EOS: make the 4th greedy token the end-of-sequence token
    engine.eos = {tokens[3]}
    eos = GenerationParams(**{**base.__dict__, "ignore_eos": False})
    got, stats, _ = run(engine, ids, eos)
    assert stats.finish_reason == "eos" and got == tokens[: tokens.index(tokens[3]) + 1]


def test_context_limit(tiny):
    pair = load_pair(tiny["short_context"], tiny["draft"], None, "cpu", dtype="float32")  # 16 positions
    engine = SpeculativeEngine(pair)
    ids = pair.tokenizer("the cat sat on the mat")["input_ids"]
    tokens, stats, _ = run(
        engine, ids, GenerationParams(sampling=GREEDY, num_draft_tokens=4, max_tokens=100, ignore_eos=True)
    )
    assert stats.finish_reason == "context" and len(ids) + len(tokens) == 16
    with pytest.raises(ContextLimitError, match="context window is 16"):
        engine.generate(list(itertools.islice(itertools.cycle(ids), 16)), GenerationParams())


def test_same_seed_same_text(pairs):
    pair = pairs["disagree"]
    engine = SpeculativeEngine(pair)
    params = GenerationParams(
        sampling=SamplingParams(1.0, 10, 0.9),
        rule="cactus-exact",
        rule_kwargs={"delta": 0.5, "divergence": "kl"},
        num_draft_tokens=3,
        max_tokens=25,
        ignore_eos=True,
        seed=11,
    )
    a, _, _ = run(engine, prompt_ids(pair), params)
    b, _, _ = run(engine, prompt_ids(pair), params)
    c, _, _ = run(engine, prompt_ids(pair), GenerationParams(**{**params.__dict__, "seed": 12}))
    assert a == b and a != c


def test_another_vocabulary_drafts_across_vocabularies(tiny):
    pair = load_pair(tiny["verifier"], tiny["odd_vocab"], None, "cpu", dtype="float32")
    assert pair.cross is not None and pair.cross.method == "string" and pair.cross.vmap.coverage > 0.9


def test_missing_models_are_clear_errors(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_pair(str(tmp_path / "nope"), None, None, "cpu", dtype="float32")
    with pytest.raises(
        ModelError, match="no Hugging Face model someone/some-model-that-is-not-cached in the local cache"
    ):
        load_pair("someone/some-model-that-is-not-cached", None, None, "cpu", dtype="float32")


def test_non_finite_probabilities_are_an_error_not_garbage(tiny):
    from cactus_cli.core.errors import ModelError
    from cactus_cli.core.sampling import SamplingParams
    from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
    from cactus_cli.infer.pair.loader import load_pair

    pair = load_pair(tiny["verifier"], None, None, "cpu", dtype="float32")
    params = GenerationParams(sampling=SamplingParams(1e-38, 0, 1.0), num_draft_tokens=0, max_tokens=4)
    with pytest.raises(ModelError, match="non-finite"):
        list(SpeculativeEngine(pair).generate(pair.tokenizer("the cat")["input_ids"], params))


def test_a_plain_step_says_it_drafted_from_nowhere(pairs, monkeypatch):
    # -k auto choosing k = 0: a plain step, whose draft_source is None (core/events.py)
    engine = SpeculativeEngine(pairs["close"])
    monkeypatch.setattr(AdaptiveK, "settle", lambda self, want, k: 0)
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=4, adaptive_k=True, max_tokens=12, ignore_eos=True)
    _, stats, events = run(engine, prompt_ids(pairs["close"]), params)
    assert {ev.num_drafted for ev in events} == {0}
    assert {ev.draft_source for ev in events} == {None}


def test_tokens_past_a_stop_inside_a_verified_block_are_neither_counted_nor_remembered(pairs):
    from cactus_cli.infer.draft import Free

    pair = pairs["self"]  # the verifier drafts for itself: whole blocks are accepted
    ids = prompt_ids(pair)
    free = GenerationParams(sampling=GREEDY, num_draft_tokens=7, max_tokens=40, ignore_eos=True)
    full, _, _ = run(SpeculativeEngine(pair), ids, free)
    cut_at = next(i for i in range(3, len(full)) if pair.tokenizer.decode([full[i]]).strip())  # a token with text
    stop = pair.tokenizer.decode([full[cut_at]]).strip()
    engine = SpeculativeEngine(pair, Free("suffix"))
    params = dataclasses.replace(free, stop=(stop,))
    tokens, stats, events = run(engine, ids, params)
    assert stats.finish_reason == "stop" and len(tokens) <= cut_at + 1
    assert stats.num_accepted_tokens == sum(len(ev.accepted) for ev in events) <= stats.num_output_tokens
    assert all(len(ev.accepted) <= len(ev.emitted) for ev in events)
    history = engine.slots[0].drafter.primary.histories[""]
    remembered = list(history.tree.docs[history.last])
    assert remembered == ids + tokens  # what was output, not the rest of the block the verifier kept


def test_a_later_generation_takes_the_caches_and_the_earlier_one_stops_with_an_error(pairs):
    """The engine keeps no generation between calls: each run's state lives in the generator the
    caller holds. Two interleaved generators on one engine would decode from each other's caches;
    the earlier one is refused at its next step instead, and the later one is still exact."""
    pair = pairs["disagree"]
    ids = prompt_ids(pair)
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=3, max_tokens=24, ignore_eos=True)
    engine = SpeculativeEngine(pair)
    first = engine.generate(ids, params)
    next(first)
    second = [t for ev in engine.generate(ids[:-2], params) for t in ev.emitted]
    with pytest.raises(RuntimeError, match="taken by a later one"):
        next(first)
    assert second == hf_greedy(pair, ids[:-2], 24)
    assert engine.slots[0].owner is None  # (no generation holds the caches once it ends)
    assert run(engine, ids, params)[0] == hf_greedy(pair, ids, 24)
