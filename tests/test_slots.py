"""Many runs, one verify: slots stepped together. Each run in a batch gets the answer it gets
alone (greedy, token for token, on the tiny pair in float32: mixed lengths, shared prefixes,
stop strings, different k and drafters); the verifier runs one forward per step for all of them;
rows of different rules and k decided in one ``verify_rows`` call keep each rule exact; a run that
fails ends alone; a prefix another slot holds is adopted, not prefilled again."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cactus_cli.core.errors import ModelError
from cactus_cli.core.exact import emitted_distribution
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.core.verify import Row, verify, verify_rows
from cactus_cli.infer.decode.batch import Batch, next_width
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.draft import Free
from cactus_cli.infer.kpolicy.costs import CostModel, best_k
from cactus_cli.infer.kpolicy.policy import Want, allocate
from cactus_cli.infer.pair.loader import load_pair
from tests.stats_helpers import assert_matches, exact_two_tokens

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
PROMPTS = [
    "the cat sat on the mat and then",
    "the cat sat on the mat and then the dog ran fast",  # (shares the first prompt's prefix)
    "a red bird",
    "one two three four five six seven eight nine ten the sun was big and the moon",
    "the cat sat on the mat and then",  # (the same prompt twice, in two slots)
    "blue sky",
    "the sea was green and the fish swam up and down",
    "a car on the road",
]


@pytest.fixture(scope="module")
def close(tiny):
    return load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32")


def ids(pair, text):
    return pair.tokenizer(text)["input_ids"]


def alone(pair, prompt, params, free=None):
    return [t for ev in SpeculativeEngine(pair, free).generate(ids(pair, prompt), params) for t in ev.emitted]


def together(engine, jobs):
    """Run (prompt ids, params) jobs in one batch, one slot each; their tokens and text, and the
    number of steps the batch took."""
    batch = Batch(engine)
    entries = [batch.add(engine.start(p, params, slot=i), reuse=True) for i, (p, params) in enumerate(jobs)]
    tokens = {id(e): [] for e in entries}
    texts = {id(e): "" for e in entries}
    steps = 0
    while len(batch):
        steps += 1
        for entry, ev in batch.step():
            assert not isinstance(ev, BaseException), ev
            tokens[id(entry)] += ev.emitted
            texts[id(entry)] += ev.text
    return [tokens[id(e)] for e in entries], [texts[id(e)] for e in entries], steps


def jobs_for(pair):
    base = GenerationParams(sampling=GREEDY, num_draft_tokens=3, max_tokens=20, ignore_eos=True)
    out = []
    for i, prompt in enumerate(PROMPTS):
        params = dataclasses.replace(base, num_draft_tokens=[3, 1, 4, 0, 2, 3, 4, 1][i], max_tokens=8 + 3 * i)
        out.append((prompt, params))
    return out


@pytest.mark.parametrize("free", [None, "suffix"])
def test_eight_runs_stepped_together_each_give_the_answer_they_give_alone(close, free):
    jobs = jobs_for(close)
    first_alone = alone(close, jobs[0][0], jobs[0][1])
    text = close.tokenizer.decode(first_alone)
    words = text.split()
    stop = f"{words[2]} {words[3]}"  # a stop string over two tokens, for two of the runs
    jobs[0] = (jobs[0][0], dataclasses.replace(jobs[0][1], stop=(stop,)))
    jobs[4] = (jobs[4][0], dataclasses.replace(jobs[4][1], stop=(stop,)))
    kind = Free(free) if free else None
    expected = [alone(close, p, params, kind) for p, params in jobs]
    engine = SpeculativeEngine(close, kind, sequences=8)
    calls = []
    model = engine.pair.verifier.model
    real = model.forward
    model.forward = lambda *a, **kw: (calls.append(kw["input_ids"].shape[0]), real(*a, **kw))[1]
    try:
        got, texts, steps = together(engine, [(ids(close, p), params) for p, params in jobs])
    finally:
        del model.forward
    assert got == expected
    assert texts[0].endswith(text[: text.index(stop)].split()[-1] + " ") or stop not in texts[0]
    assert stop not in texts[0] and stop not in texts[4]
    # one verifier forward per step for every run in it (the 8 prefills each their own)
    assert len(calls) == 8 + steps
    assert max(calls) == 8  # the first steps verified all eight rows in one forward


def test_runs_with_different_rules_and_k_in_one_batch_keep_sps_exact(close):
    """SpS rows stepped beside a Cactus row and rows of other k: the first two tokens of each SpS
    row follow the verifier's exact joint distribution (N = 1000 seeds, top-k 3: 9 cells; L1
    bound at false-failure odds 1e-4 each)."""
    pair = close
    sp = SamplingParams(temperature=1.5, top_k=3, top_p=1.0)
    prompt = ids(pair, "the dog")
    exact = exact_two_tokens(pair, prompt, sp)
    cells = sorted(exact)
    index = {c: i for i, c in enumerate(cells)}
    engine = SpeculativeEngine(pair, sequences=3)
    rows = {"sps k2": [], "sps k1": []}
    for seed in range(1000):
        base = GenerationParams(sampling=sp, max_tokens=2, ignore_eos=True, seed=seed)
        jobs = [
            (prompt, dataclasses.replace(base, rule="sps", num_draft_tokens=2)),
            (
                prompt,
                dataclasses.replace(base, rule="cactus", rule_kwargs={"delta": 1.0}, num_draft_tokens=1, seed=seed + 7),
            ),
            (prompt, dataclasses.replace(base, rule="sps", num_draft_tokens=1, seed=seed + 99999)),
        ]
        got, _, _ = together(engine, jobs)
        rows["sps k2"].append(index[tuple(got[0][:2])])
        rows["sps k1"].append(index[tuple(got[2][:2])])
    for name, samples in rows.items():
        assert_matches(torch.tensor(samples), torch.tensor([exact[c] for c in cells]), false_failure_odds=1e-4)


def _dists(V, k, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(k, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2 * torch.randn(k + 1, V, generator=g, dtype=torch.float64), -1)
    return p, q, g


RULES = [
    ("sps", {}),
    ("cactus", {"delta": 0.5}),
    ("cactus-exact", {"delta": 0.3}),
    ("topk", {"topk": 2}),
    ("interp", {"alpha": 0.35}),
    ("tas", {"epsilon": 0.09}),
]


def test_verify_rows_gives_each_row_what_verify_gives_it_alone():
    """Bit for bit, each row with its own generator: 14 rows in one call, four rows of each of three
    rules (k from 0 to 6, float32 and float64 rows side by side) and two of a rule again at
    another budget (a second group of it)."""
    for trial in range(12):  # (each rule leads a trial twice)
        rows, singles = [], []
        for r in range(14):
            rule, prm = RULES[(trial + r // 4) % len(RULES)] if r < 12 else ("cactus", {"delta": 0.1})
            k = (trial * 3 + r) % 7
            p, q, g = _dists(30, k, 100 * trial + r)
            n = torch.multinomial(p, 1, generator=g).view(-1) if k else torch.zeros(0, dtype=torch.int64)
            if r % 3:
                p, q = p.float(), q.float()
            rows.append(Row(rule, prm, p, q, n, torch.Generator().manual_seed(trial * 100 + r)))
            singles.append(
                verify(rule, p[None], q[None], n[None], generator=torch.Generator().manual_seed(trial * 100 + r), **prm)
            )
        for got, want in zip(verify_rows(rows), singles):
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
            assert torch.equal(got.acceptance_probs, want.acceptance_probs)
            assert got.acceptance_probs.dtype == want.acceptance_probs.dtype


def test_ragged_rows_of_every_rule_emit_their_exact_distributions():
    """One verify_rows call over 6 x 3000 rows (every rule, k 1 to 3, each row its generator):
    each rule's first emitted token follows its exact emitted distribution (exact.py); L1 bound
    at false-failure odds 1e-6 per rule."""
    V, N = 6, 3000
    p1, q1, _ = _dists(V, 3, 5)
    draw = torch.Generator().manual_seed(6)
    rows = []
    for i in range(N):
        for j, (rule, prm) in enumerate(RULES):
            k = 1 + (i + j) % 3
            n = torch.multinomial(p1[:k], 1, generator=draw).view(-1)
            rows.append(Row(rule, prm, p1[:k], q1[: k + 1], n, torch.Generator().manual_seed(i * 10 + j)))
    verdicts = verify_rows(rows)
    for j, (rule, prm) in enumerate(RULES):
        first = torch.stack([v.tokens[0, 0] for v in verdicts[j :: len(RULES)]])
        exact = emitted_distribution(rule, p1[0], q1[0], **prm)
        assert_matches(first, exact, false_failure_odds=1e-6)


def test_a_run_that_fails_ends_alone_and_the_others_go_on(close):
    jobs = jobs_for(close)[:3]
    expected = [alone(close, p, params) for p, params in jobs]
    bad = dataclasses.replace(jobs[1][1], sampling=SamplingParams(1e-38, 0, 1.0))  # overflows to non-finite
    engine = SpeculativeEngine(close, sequences=3)
    batch = Batch(engine)
    entries = [
        batch.add(engine.start(ids(close, p), params, slot=i))
        for i, (p, params) in enumerate([jobs[0], (jobs[1][0], bad), jobs[2]])
    ]
    tokens = {id(e): [] for e in entries}
    errors = []
    while len(batch):
        for entry, ev in batch.step():
            if isinstance(ev, BaseException):
                errors.append((entry, ev))
            else:
                tokens[id(entry)] += ev.emitted
    assert [e for e, _ in errors] == [entries[1]] and isinstance(errors[0][1], ModelError)
    assert tokens[id(entries[0])] == expected[0] and tokens[id(entries[2])] == expected[2]
    assert engine.slots[1].tokens == [] and engine.slots[1].verifier.cache_len == 0  # its caches were dropped


def test_a_prefix_another_slot_holds_is_adopted_not_prefilled(close):
    engine = SpeculativeEngine(close, sequences=2)
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=3, max_tokens=6, ignore_eos=True)
    long = ids(close, PROMPTS[3])
    list(engine.generate(long, params))  # slot 0 now holds it
    follow = long + ids(close, "and the dog")[1:]
    batch = Batch(engine)
    batch.add(engine.start(follow, params, slot=1), reuse=True, donor=engine.slots[0])
    events = []
    while len(batch):
        events += [ev for _, ev in batch.step()]
    assert events[0].reused_tokens >= len(long) - 1 and events[0].prefill_tokens < len(follow) - len(long) + 2
    cold = [t for ev in SpeculativeEngine(close).generate(follow, params) for t in ev.emitted]
    assert [t for ev in events for t in ev.emitted] == cold


def test_k_for_the_whole_step_is_best_k_for_one_run_and_fills_a_cheap_width_for_several():
    costs = CostModel()
    for w in range(1, 66):
        costs.add_verify(w, 0.030 + 0.009 * max(0, w - 4))  # flat to width 4, then linear
    costs.add_draft(0.001)
    rates = [0.8] * 8
    one = Want(8, "model", rates)
    assert allocate(costs, [one]) == [best_k(costs, rates, 8, "model")]
    four = allocate(costs, [one] * 4)
    # four rows already fill the flat part of the curve: drafting more costs a linear price
    assert sum(k + 1 for k in four) <= 8 and max(four) < allocate(costs, [one])[0]
    fixed = Want(3, "model", rates, fixed=True)
    assert allocate(costs, [fixed, one])[0] == 3


@pytest.mark.parametrize("chunk,free", [(1, None), (5, None), (16, None), (5, "suffix")])
def test_a_prompt_joining_running_streams_is_fed_in_chunks_and_answers_as_alone(close, chunk, free):
    """A long prompt that joins while another run decodes is read ``chunk`` tokens a step, in the
    running run's verifier calls (and the draft model's, which reads the prompt too unless it sits
    behind a lookup); both answers stay the ones each gets alone (a chunk boundary that dropped,
    repeated or reordered a token would change the joining run's answer)."""
    kind = Free(free) if free else None
    running, joining = ids(close, PROMPTS[3]), ids(close, " ".join(PROMPTS) + " and the bird sang")
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=3, max_tokens=400, ignore_eos=True)
    short = dataclasses.replace(params, max_tokens=12)
    expected = [
        alone(close, PROMPTS[3], params, kind),
        alone(close, " ".join(PROMPTS) + " and the bird sang", short, kind),
    ]
    got, steps_to_first = join_in_chunks(SpeculativeEngine(close, kind, sequences=2), running, joining, params, chunk)
    assert got == expected
    assert steps_to_first == -(-(len(joining) - 1) // chunk)  # the prompt minus its last token, then its first step


def join_in_chunks(engine, running: list[int], joining: list[int], params: GenerationParams, chunk: int):
    """``running`` decodes (``params``: long enough to outlast the join); at its third step
    ``joining`` joins (12 tokens) in a batch that feeds prompts ``chunk`` tokens a step. Both
    runs' tokens, and the steps from the join to the joining run's first event."""
    batch = Batch(engine, chunk=chunk)
    first = batch.add(engine.start(running, params, slot=0))
    got, second, steps_to_first, step = {id(first): []}, None, None, 0
    while len(batch):
        step += 1
        if step == 3:
            second = batch.add(engine.start(joining, dataclasses.replace(params, max_tokens=12), slot=1))
            got[id(second)], joined = [], step
        for entry, ev in batch.step():
            assert not isinstance(ev, BaseException), ev
            got[id(entry)] += ev.emitted
            if entry is second and steps_to_first is None:
                steps_to_first = step - joined
    return [got[id(first)], got[id(second)]], steps_to_first


def test_a_request_goes_waiting_prefilling_decoding_done(close):
    """A request's state as the batch moves it: its prompt prefilled whole while nothing decodes,
    a joining one read chunk by chunk beside it, each done at its end."""
    engine = SpeculativeEngine(close, sequences=2)
    batch = Batch(engine, chunk=4)
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=2, max_tokens=12, ignore_eos=True)
    first = batch.add(engine.start(ids(close, PROMPTS[0]), params, slot=0))
    assert first.state == "waiting"
    batch.step()
    assert first.state == "decoding"  # (alone: prefilled whole, then its first step)
    joining = batch.add(engine.start(ids(close, PROMPTS[3]), params, slot=1))
    batch.step()
    assert joining.state == "prefilling" and first.state == "decoding"  # (a 4-token chunk of its 17 words read)
    while len(batch):
        batch.step()
    assert first.state == joining.state == "done"


def test_a_request_waits_without_a_slot_until_the_engine_places_it(close):
    """``engine.request`` makes a request with no slot (serve makes it in the handler, before a
    slot is free); a batch refuses it until ``engine.place`` gives it one."""
    engine = SpeculativeEngine(close, sequences=2)
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=2, max_tokens=4, ignore_eos=True)
    req = engine.request(ids(close, PROMPTS[0]), params)
    assert req.state == "waiting" and req.slot is None and req.tokens == []
    batch = Batch(engine)
    with pytest.raises(ValueError, match="engine.place"):
        batch.add(req)
    batch.add(engine.place(req, slot=1))
    out = [ev for _, ev in batch.step()]
    assert req.slot is engine.slots[1] and req.state == "decoding"
    while len(batch):
        out += [ev for _, ev in batch.step()]
    assert req.stats.num_output_tokens == sum(len(ev.emitted) for ev in out) == 4  # (its own stats, as they came)


@pytest.mark.parametrize(
    "width, seconds, block, expected",
    [
        (64, 0.4, 1, 128),  # torch: any width, toward STEP_SECONDS
        (100, 0.8, 1, 100),
        (64, 0.7, 64, 64),  # llama.cpp: 73 fit, in whole blocks of 64
        (64, 0.3, 64, 128),
        (40, 0.5, 64, 64),  # a step off the blocks grows into one
        (64, 0.9, 64, 37),  # the blocks no longer fit: off them, OFF_BLOCK fewer (56 / 1.5)
        (30, 0.9, 64, 26),  # off the blocks already: by time alone
        (10, 0.1, 64, 20),  # at most double at once
    ],
)
def test_a_chunked_step_is_sized_by_its_time_in_whole_blocks(width, seconds, block, expected):
    """The next chunked step's width follows the last one's time toward STEP_SECONDS, in whole
    blocks where it holds one (llama.cpp's CPU attention: 64 queries at a time on its fast path)."""
    assert next_width(width, seconds, block) == expected


def test_a_prompts_short_last_chunk_leaves_the_step_width_as_it_was(close):
    """A chunked step's time sizes the next one only when its chunks filled the width: a prompt's
    last, shorter chunk reads as a cheap step and would swing the next joining prompt's chunks."""
    engine = SpeculativeEngine(close, sequences=2)
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=2, max_tokens=60, ignore_eos=True)
    short, long = ids(close, PROMPTS[1]), ids(close, " ".join(PROMPTS) + " and the bird sang")
    for prompt, width, resized in ((short, len(short) + 8, False), (long, 16, True)):
        batch = Batch(engine)
        batch.add(engine.start(ids(close, PROMPTS[0]), params, slot=0))
        batch.step()  # (alone: prefilled whole, then decoding)
        batch.width = width
        batch.add(engine.start(prompt, dataclasses.replace(params, max_tokens=2), slot=1))
        batch.step()  # (a chunk of the joining prompt beside the decoding run)
        assert (batch.width != width) == resized, (len(prompt), width, batch.width)
        while len(batch):
            batch.step()
