"""The suffix drafter: the tree (counts, longest useful match, most frequent continuation,
eviction at the budget, a chat counted once, persistence and damaged files), greedy equality
with the verifier and exact caches, SpS exactness with one-hot and sampled drafts, histories
kept apart per bench row and out of warm-ups, the CLI."""

from __future__ import annotations

import json
import os
import random
import stat

import pytest
import torch
from typer.testing import CliRunner

from cactus_cli.cli.main import app
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.draft import Free
from cactus_cli.infer.draft.suffix import SUFFIX, SuffixDrafter
from cactus_cli.infer.draft.suffix_tree import History, SuffixTree, follow
from cactus_cli.infer.kpolicy.costs import WINDOW
from cactus_cli.infer.kpolicy.store import CostStore
from cactus_cli.infer.pair.loader import load_pair
from tests.helpers import assert_one_line_error, pair_args
from tests.stats_helpers import assert_matches, exact_two_tokens
from tests.test_engine import hf_greedy, run

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


def tree(*docs):
    t = SuffixTree()
    for i, d in enumerate(docs):
        t.add(i + 1, d)
    return t


def test_the_tree_counts_continuations_and_drafts_the_most_frequent_path():
    t = tree([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3])
    node = t.best([9, 1, 2], 4, 0.1)
    # after "1 2": 3 three times, 4 once (the tail "1 2 3" itself counts; the context's own 1 2 is not in the tree)
    assert node.tokens[:1] == [3]
    tokens, dists, score = follow(node.node, 1, 0.0, matched=node.length)
    assert tokens == [3] and dists[0] == pytest.approx({3: 0.75, 4: 0.25})  # the counts are the distribution
    assert score == pytest.approx(3 / (4 + 1 / node.length))  # the estimate keeps room for the unseen
    lone = tree([1, 2, 3, 4, 5, 6, 7, 8, 9])  # one occurrence: trusted more the longer the match
    assert follow(lone.best([1], 1, 0.0).node, 1, 0.0, matched=1)[2] == pytest.approx(1 / 2)
    assert follow(lone.best([1, 2, 3, 4], 1, 0.0).node, 1, 0.0, matched=4)[2] == pytest.approx(4 / 5)
    # a longer match wins when it predicts better: after "1 2", 5 x3 and 6 x2; after "7 1 2", 5 x3
    t2 = tree([7, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2, 5])
    assert t2.best([0, 1, 2], 1, 0.1).length == 2 and t2.best([7, 1, 2], 1, 0.1).length == 3
    assert follow(t2.best([7, 1, 2], 1, 0.1).node, 1, 0.0)[1][0] == {5: 1.0}
    assert t.best([7, 8], 4, 0.1) is None  # never seen
    assert t.best([], 4, 0.1) is None


def test_the_draft_stops_where_the_path_becomes_unlikely():
    t = tree([5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 1, 2])  # after 5 6: 7 (2 of 3) then 8 or 9 (1 of 2 each)
    # estimates 2 / (3 + 1/2) = 0.57, then x 1 / (2 + 1/3) = 0.245
    assert t.best([5, 6], 8, 0.5).tokens == [7]
    assert t.best([5, 6], 8, 0.2).tokens[:2] == [7, 9]  # (ties: the most recent occurrence's)
    assert len(t.best([5, 6], 1, 0.0).tokens) == 1  # k caps it


def test_sampled_drafts_are_drawn_from_the_counts_kept_above_the_threshold():
    t = tree([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 3])
    node = t.best([1, 2], 1, 0.3).node  # after 1 2: 3 x3, 4 x1, 5 x1 (the tail's occurrence has no next token)
    draws = [follow(node, 1, 0.3, random.Random(s)) for s in range(400)]
    assert {tuple(d[0]) for d in draws if d[0]} == {(3,)}  # 4 and 5 (1/5 each) fall below 0.3: they end the draft
    assert all(d[1][0] == {3: 1.0} for d in draws if d[0])  # ... so the draft's true distribution is 3 alone
    ended = sum(1 for d in draws if not d[0])
    assert 0.2 < ended / 400 < 0.6  # drawn 4 or 5: 2/5 of the time (binomial sd 0.025)
    tokens, dists, _ = follow(node, 1, 0.1, random.Random(0))
    assert dists[0] == pytest.approx({3: 0.6, 4: 0.2, 5: 0.2})


def test_history_evicts_the_least_recently_used_document_at_its_budget():
    h = History(budget=10)
    h.add([1, 2, 3, 4])
    h.add([5, 6, 7, 8])
    h.touch(1)  # the first document drafted something: now the most recent
    h.add([9, 10, 11])  # 11 tokens: the least recently used (5 6 7 8) goes
    assert h.tokens == 7 and sorted(list(d) for d in h.tree.docs.values()) == [[1, 2, 3, 4], [9, 10, 11]]
    assert h.tree.best([5, 6], 2, 0.1) is None and h.tree.best([1, 2], 2, 0.1).tokens == [3, 4]
    h.add(list(range(20, 40)))  # longer than the budget: its last 10 tokens, alone
    assert h.tokens == 10 and list(h.tree.docs.values())[0].tolist() == list(range(30, 40))
    for _ in range(200):  # removed documents' index entries are dropped, not accumulated
        h.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
        h.add([11, 12, 13, 14, 15, 16])
    assert h.tree.stale <= h.tree.entries + 18


def test_a_chat_is_one_growing_document_not_counted_again_each_turn():
    h = History()
    turn1 = [1, 2, 3, 4, 5]
    h.add(turn1)
    h.add(turn1 + [6, 7, 1, 2])  # the next turn repeats the conversation so far
    assert h.tokens == 9 and len(h.tree.docs) == 1
    tokens, dists, _ = follow(h.tree.best([1, 2], 1, 0.0).node, 1, 0.0)
    assert dists[0] == {3: 1.0}  # "1 2" occurred twice, one occurrence followed by 3: not 3 counted twice


def test_a_remembered_history_round_trips_and_a_bad_file_is_a_warning(tmp_path):
    path = tmp_path / "history.json"
    h, note = History.load(path, "vocab-A", 100)
    assert note is None and h.tokens == 0
    h.add([1, 2, 3, 4, 1, 2])
    h.add([7, 8, 9])
    again, note = History.load(path, "vocab-A", 100)
    assert note is None and again.tokens == 9
    assert again.tree.best([1, 2], 2, 0.1).tokens == [3, 4]
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # what the user typed is theirs alone
    good = path.read_text()
    for text, needle in (
        (good[: len(good) // 2], "cannot be read"),
        ('{"format": "other"}', "not a cactus"),
        (good.replace('"schema":1', '"schema":99'), "another version"),
        (good.replace("[7,8,9]", "[7,8,900]"), "outside this vocabulary"),
        (good.replace("[7,8,9]", '[7,"x",9]'), "outside this vocabulary"),
        (b"\xff\xfe".decode("latin-1"), "cannot be read"),
    ):
        path.write_text(text, encoding="latin-1" if "\xff" in text else "utf-8")
        empty, note = History.load(path, "vocab-A", 100)
        assert empty.tokens == 0 and needle in note and "empty history" in note, (needle, note)
    path.write_text(good)
    empty, note = History.load(path, "vocab-B", 100)
    assert empty.tokens == 0 and "another tokenizer" in note


def test_a_history_that_cannot_be_saved_says_so_once_and_keeps_going(tmp_path):
    path = tmp_path / "gone" / "history.json"  # the folder disappeared after the start-up check
    h = History(path=path)
    said = []
    h.on_error = said.append
    h.add([1, 2, 3])
    h.add([4, 5, 6])
    assert len(said) == 1 and "cannot save" in said[0] and h.tokens == 6


def fixed_costs(engine, verify):
    """The engine's -k auto gets its own costs, fixed: seconds per verify width."""
    engine.costs = CostStore()
    for _ in range(WINDOW):
        for width, seconds in verify.items():
            engine.costs.costs.add_verify(width, seconds)
    engine.costs.costs.add_verify = lambda width, seconds: None


@pytest.fixture(scope="module")
def pairs(tiny):
    return {
        "alone": load_pair(tiny["verifier"], None, None, "cpu", dtype="float32"),
        "close": load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32"),
    }


@pytest.mark.parametrize("which", ["alone", "close"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_with_suffix_drafts_equals_the_verifier_and_caches_stay_exact(pairs, which, adaptive):
    pair = pairs[which]
    engine = SpeculativeEngine(pair, Free("suffix"))
    if adaptive:  # whether drafting pays must not hang on the timings that other tests (or a
        fixed_costs(engine, {1: 0.1, 5: 0.1, 9: 0.2})  # loaded machine) left in the session's cost cache
    ids = pair.tokenizer("the cat sat on the mat and the dog sat on the mat and the cat")["input_ids"]
    n = 40
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=4, adaptive_k=adaptive, max_tokens=n, ignore_eos=True)
    expected = hf_greedy(pair, ids, n)
    accepted, seen = [], set()
    for attempt in range(2):  # the second time, the history holds the first answer
        tokens, sources, emitted, acc = [], set(), 0, 0
        for ev in engine.generate(ids, params):
            tokens += ev.emitted
            emitted += len(ev.emitted)
            acc += len(ev.accepted) if ev.draft_source == SUFFIX else 0
            sources.add(ev.draft_source)
            lengths = engine.cache_lengths()
            assert lengths["verifier"] == lengths["sequence"] - 1 == len(ids) + emitted - 1
            if which == "close":
                assert lengths["draft"] + lengths["draft_pending"] == lengths["sequence"]
        assert tokens == expected
        assert SUFFIX in sources
        accepted.append(acc)
        seen |= sources
    assert accepted[1] > accepted[0]  # the history drafted what the request alone could not
    if which == "close" and not adaptive:
        assert "model" in seen  # the model drafted where the trees had nothing likely


def test_histories_are_kept_apart_per_memory_and_out_of_warm_ups(pairs):
    pair = pairs["alone"]
    engine = SpeculativeEngine(pair, Free("suffix"))
    ids = pair.tokenizer("one two three four")["input_ids"]
    base = GenerationParams(sampling=GREEDY, num_draft_tokens=4, max_tokens=24, ignore_eos=True)
    run(engine, ids, GenerationParams(**{**base.__dict__, "learn": False}))  # a warm-up: remembered nowhere
    run(engine, ids, GenerationParams(**{**base.__dict__, "memory": "row A"}))
    histories = engine.slots[0].drafter.histories
    assert histories[""].tokens == 0 and histories["row A"].tokens == len(ids) + 24
    _, stats_b, _ = run(engine, ids, GenerationParams(**{**base.__dict__, "memory": "row B"}))
    _, stats_a, _ = run(engine, ids, GenerationParams(**{**base.__dict__, "memory": "row A"}))
    assert stats_a.num_accepted_tokens > stats_b.num_accepted_tokens  # only row A had seen this answer


@pytest.mark.parametrize("sampled, adaptive", [(False, False), (True, False), (True, True)])
def test_sps_with_suffix_drafts_reproduces_the_verifier_distribution(pairs, sampled, adaptive):
    # As for the draft model and prompt lookup: the first two tokens' joint distribution over 1500
    # seeds equals the verifier's exact one (L1 bound, false-failure odds 1e-4). The prompt
    # repeats with different continuations, so the trees draft at both positions, one-hot or
    # drawn from their counts; the history grows as the seeds run (each run is exact on its own).
    # adaptive: -k auto sizes each draft by the tree's estimates (known before the step's draws).
    pair = pairs["alone"]
    sp = SamplingParams(temperature=1.5, top_k=3, top_p=1.0)
    ids = pair.tokenizer("the dog sat the dog sat the dog ran the dog")["input_ids"]
    exact = exact_two_tokens(pair, ids, sp)
    cells = sorted(exact)
    index = {c: i for i, c in enumerate(cells)}
    engine = SpeculativeEngine(pair, Free("suffix", {"sampled": sampled}))
    samples, drafted, firsts, ks = [], 0, set(), set()
    if adaptive:  # a draft pays where its acceptance, as calibrated, is over 5% (not this machine's timings)
        fixed_costs(engine, {1: 0.1, 2: 0.105})
    for seed in range(1500):
        params = GenerationParams(
            sampling=sp, rule="sps", num_draft_tokens=2, max_tokens=2, ignore_eos=True, seed=seed, adaptive_k=adaptive
        )
        tokens, stats, events = run(engine, ids, params)
        drafted += stats.num_draft_tokens
        ks.add(events[0].num_drafted)
        firsts.update((events[0].accepted + events[0].rejected)[:1])
        samples.append(index[tuple(tokens[:2])])
    assert drafted > 1000  # the trees really drafted
    assert 1 in ks  # (max_tokens 2: one draft at most; the sizing itself: test_policy.py)
    if sampled:
        assert len(firsts) > 1  # drawn, not always the most frequent path
    assert_matches(torch.tensor(samples), torch.tensor([exact[c] for c in cells]), false_failure_odds=1e-4)


def test_a_suffix_proposal_is_one_hot_or_the_counts(pairs):
    history = History()
    for doc in ([1, 2, 3, 5], [7, 1, 2, 3, 5], [1, 2, 4]):  # earlier requests: after 1 2, 3 twice and 4 once
        history.add(doc)
    d = SuffixDrafter(10, torch.device("cpu"), history, sampled=False)
    seq = [1, 2]
    d.start(seq, [])
    sp = SamplingParams(1.0, 0, 1.0)
    p = d.propose(seq, 2, sp, torch.Generator().manual_seed(0))
    assert p.source == SUFFIX and p.tokens.tolist() == [3, 5] and p.probs[0, 3] == 1.0 and p.probs.sum() == 2
    d = SuffixDrafter(10, torch.device("cpu"), history, sampled=True)
    d.start(seq, [])
    p = d.propose(seq, 1, sp, torch.Generator().manual_seed(0))
    assert p.probs[0, 3] == pytest.approx(2 / 3) and p.probs[0, 4] == pytest.approx(1 / 3)
    assert d.propose(seq, 0, sp, None).tokens.numel() == 0


def test_cli_suffix_drafting_and_remember(tiny, tmp_path):
    runner = CliRunner()
    args = ["--verifier", tiny["verifier"], "--device", "cpu", "--dtype", "float32", "--no-chat-template"]
    prompt = "the cat sat on the mat and the dog sat on the mat and the cat"
    path = tmp_path / "history.json"
    docs = []
    for _ in range(2):
        r = runner.invoke(
            app,
            [
                "generate",
                prompt,
                *args,
                "--draft",
                "suffix",
                "-n",
                16,
                "-k",
                "4",
                "-t",
                0,
                "--json",
                "--remember",
                str(path),
            ],
        )
        assert r.exit_code == 0, r.output
        docs.append(json.loads(r.stdout))
    assert docs[0]["settings"]["draft_params"]["remember"] == str(path)
    s0, s1 = (d["stats"]["draft_sources"]["suffix"] for d in docs)
    assert s1["accepted"] > s0["accepted"]  # the second run drafted from the first one's answer
    assert docs[0]["stats"]["draft_forward_passes"] == 0
    path.write_text("{ truncated")
    r = runner.invoke(app, ["generate", prompt, *args, "--draft", "suffix", "-n", 4, "--json", "--remember", str(path)])
    assert r.exit_code == 0 and "cannot be read" in r.stderr and "Traceback" not in r.output
    assert json.loads(path.read_text())["format"] == "cactus-suffix-history"  # replaced by a good one
    assert_one_line_error(
        runner.invoke(app, ["generate", "hi", *args, "--draft", "ngram", "--remember", str(path)]),
        "--remember applies only to the suffix trees",
    )
    assert_one_line_error(
        runner.invoke(app, ["generate", "hi", *args, "--draft", "suffix+"]), "suffix+MODEL needs a model"
    )
    assert_one_line_error(
        runner.invoke(
            app, ["generate", "hi", *args, "--draft", "suffix", "--remember", str(tmp_path / "no" / "h.json")]
        ),
        "does not exist",
    )


def test_bench_takes_drafts_as_grid_values(tiny):
    runner = CliRunner()
    r = runner.invoke(
        app,
        [
            "bench",
            *pair_args(tiny, "draft_close")[:2],
            "--draft",
            f"ngram,suffix,{tiny['draft_close']}",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--category",
            "grounded",
            "--limit",
            2,
            "-n",
            8,
            "--rules",
            "sps",
            "-k",
            "2",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["results"]
    assert [row["config"] for row in rows] == [
        "verifier alone",
        "sps k=2 · ngram",
        "sps k=2 · suffix",
        f"sps k=2 · {tiny['draft_close']}",
    ]
    assert [row["draft"] for row in rows] == [None, "ngram", "suffix", tiny["draft_close"]]
    assert set(rows[2]["draft_sources"]) == {"suffix"} and set(rows[3]["draft_sources"]) == {"model"}
    assert_one_line_error(
        runner.invoke(app, ["bench", *pair_args(tiny), "--draft", "ngram,suffix+"]), "suffix+MODEL needs a model"
    )


def _remember(path, n, tag, barrier):
    from cactus_cli.infer.draft.suffix_tree import History

    h, _ = History.load(path, "vocab-A", 1000)
    barrier.wait(30)  # both runs have read the file before either writes
    for i in range(n):
        h.add([tag, i % 900 + 1, tag])


def test_runs_sharing_a_remember_file_merge_under_a_lock(tmp_path):
    import json
    import multiprocessing

    path = tmp_path / "history.json"
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_remember, args=(path, 25, t, barrier)) for t in (7, 8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    docs = json.loads(path.read_text())["docs"]
    assert sorted(d[0] for d in docs) == [7] * 25 + [8] * 25  # both runs' documents, none lost


def test_a_chat_document_that_grows_is_kept_once(tmp_path):
    import json

    from cactus_cli.infer.draft.suffix_tree import History

    path = tmp_path / "history.json"
    other, _ = History.load(path, "vocab-A", 100)
    other.add([9, 9, 9])
    chat, _ = History.load(path, "vocab-A", 100)  # holds the other run's document too
    chat.add([1, 2, 3])
    chat.add([1, 2, 3, 4, 5])  # the next turn repeats the conversation so far
    assert sorted(json.loads(path.read_text())["docs"]) == [[1, 2, 3, 4, 5], [9, 9, 9]]


@pytest.mark.parametrize(
    "content, why",
    [("{ truncated", "cannot be read"), ('{"format": "other"}', "not a cactus"), (None, "another tokenizer")],
)
def test_a_history_file_that_cannot_be_used_is_moved_aside_not_destroyed(tmp_path, content, why):
    import json

    from cactus_cli.infer.draft.suffix_tree import History

    path = tmp_path / "history.json"
    if content is None:
        h, _ = History.load(path, "vocab-B", 100)
        h.add([5, 6, 7])
        content = path.read_text()
    else:
        path.write_text(content)
    h, warning = History.load(path, "vocab-A", 100)
    assert why in warning and "moved aside" in warning and path.read_text() == content  # nothing touched yet
    notes = []
    h.on_note = notes.append
    h.add([1, 2, 3])
    aside = list(tmp_path.glob("history.json.bad-*"))
    assert len(aside) == 1 and aside[0].read_text() == content
    assert len(notes) == 1 and aside[0].name in notes[0]
    assert json.loads(path.read_text())["docs"] == [[1, 2, 3]]


def test_a_device_as_the_remember_file_is_written_in_place_never_moved(tmp_path):
    from pathlib import Path

    from cactus_cli.infer.draft.suffix_tree import History

    h, warning = History.load(Path("/dev/null"), "vocab-A", 100)
    assert warning is None
    h.add([1, 2, 3])
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and not list(Path("/dev").glob("null.bad-*"))


def test_a_history_file_is_bounded_and_loaded_in_one_pass(tmp_path, monkeypatch):
    import json

    from cactus_cli.infer.draft import suffix_tree
    from cactus_cli.infer.draft.suffix_tree import History, SuffixTree

    path = tmp_path / "history.json"
    docs = [[d % 50 + 1, *range(1, 100)] for d in range(3000)]  # 300k tokens for a 10k budget
    path.write_text(json.dumps({"format": suffix_tree.FORMAT, "schema": suffix_tree.SCHEMA, "key": "k", "docs": docs}))
    adds, removes = [], []
    monkeypatch.setattr(SuffixTree, "remove", lambda self, doc: removes.append(doc))
    real_add = SuffixTree.add
    monkeypatch.setattr(SuffixTree, "add", lambda self, doc, t: (adds.append(doc), real_add(self, doc, t)))
    h, warning = History.load(path, "k", 200, budget=10_000)
    assert warning is None and h.tokens == 10_000 and len(adds) == 100 and removes == []  # the newest 100, once
    assert h.tree.docs[h.next_id - 1].tolist() == docs[-1]
    big = tmp_path / "big.json"
    big.write_text(" " * (suffix_tree.MAX_FILE_BYTES + 1))
    _, warning = History.load(big, "k", 200)
    assert "over the 16 MB" in warning
    many = tmp_path / "many.json"
    many.write_text(json.dumps({"format": suffix_tree.FORMAT, "schema": 1, "key": "k", "docs": [[1]] * 5000}))
    _, warning = History.load(many, "k", 200)
    assert "5000 documents, over the 4096" in warning
