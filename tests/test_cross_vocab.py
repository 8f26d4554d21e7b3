"""Drafting across vocabularies: the spelling match (byte-level, SentencePiece, plain), greedy
equality with the verifier for both methods at k = 1, 4 and auto, the draft's cache holding a
prefix of the verified text in its own tokens after every step, SpS exactness, Cactus within
its budget, edge cases (EOS, a character split across tokens, an empty re-tokenization), the CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch
from typer.testing import CliRunner

from cactus_cli.cli.main import app
from cactus_cli.core.errors import ModelError
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.load.vocab import _byte_decoder, spelling_scheme, token_bytes
from cactus_cli.infer.pair.loader import load_pair
from tests.conftest import SPECIALS, WORDS, make_model
from tests.stats_helpers import assert_matches, exact_two_tokens
from tests.test_engine import hf_greedy, run

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
TEXT = "the cat sat on the mat and the dog sat on the mat and the cat"


def word_tokenizer(folder, words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + list(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def cross(tiny, tmp_path_factory):
    """A draft with its own vocabulary: the verifier's words but 6 of them, shuffled (other ids),
    plus 3 of its own; a model with other weights."""
    folder = tmp_path_factory.mktemp("cross") / "draft"
    words = list(WORDS[:-6]) + ["zebra", "yak", "ox"]
    random.Random(0).shuffle(words)
    make_model(
        folder, "llama", 7, len(SPECIALS) + len(words)
    )  # (a qwen2 config makes transformers swap in its own tokenizer class)
    word_tokenizer(folder, words)
    return {
        method: load_pair(tiny["verifier"], str(folder), None, "cpu", dtype="float32", cross_vocab=method)
        for method in ("string", "intersection")
    } | {"folder": str(folder)}


def test_spellings_match_by_bytes_across_conventions():
    table = {v: k for k, v in _byte_decoder().items()}  # byte -> the character GPT-2 spells it with

    class Fake:
        def __init__(self, vocab, decoder):
            self.vocab, self.all_special_ids = vocab, [0]
            self.backend_tokenizer = type("B", (), {"to_str": lambda _: json.dumps({"decoder": decoder})})()

        def get_vocab(self):
            return self.vocab

    gpt2 = {"<eos>": 0, table[32] + "world": 1, "\u00e9".encode()[:1].decode("latin-1"): 2}
    sp = {"<eos>": 0, "\u2581world": 1, "<0x0A>": 2, "caf\u00e9": 3}
    assert spelling_scheme(Fake(gpt2, {"type": "ByteLevel"})) == "bytelevel"
    assert (
        spelling_scheme(
            Fake(sp, {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}}]})
        )
        == "sentencepiece"
    )
    g = token_bytes(Fake({"<eos>": 0, "\u0120world": 1, "\u00c3\u00a9": 2}, {"type": "ByteLevel"}))
    s = token_bytes(Fake(sp, {"type": "Metaspace"}))
    assert g[1] == s[1] == b" world"  # Ġworld and ▁world are the same text
    assert g[2] == "\u00e9".encode() and s[3] == "caf\u00e9".encode() and s[2] == b"\n"
    assert 0 not in g and 0 not in s  # special tokens are never matched by spelling


def test_the_vocab_map_pairs_tokens_spelled_alike(cross):
    pair = cross["intersection"]
    vmap = pair.cross.vmap
    vocab_v, vocab_d = pair.tokenizer.get_vocab(), pair.cross.tokenizer.get_vocab()
    for d, v in vmap.to_verifier.items():
        if d != pair.cross.tokenizer.eos_token_id:
            assert [w for w, i in vocab_d.items() if i == d] == [w for w, i in vocab_v.items() if i == v]
    assert vmap.to_verifier[pair.cross.tokenizer.eos_token_id] == pair.tokenizer.eos_token_id
    assert vmap.shared == len(WORDS) - 6 + 1  # the shared words, and EOS


@pytest.mark.parametrize("method", ["string", "intersection"])
@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_across_vocabularies_equals_the_verifier(cross, method, k):
    pair = cross[method]
    engine = SpeculativeEngine(pair)
    ids = pair.tokenizer(TEXT)["input_ids"]
    n = 30
    params = GenerationParams(
        sampling=GREEDY, num_draft_tokens=8 if k == "auto" else k, adaptive_k=k == "auto", max_tokens=n, ignore_eos=True
    )
    tokens, emitted, drafted = [], 0, 0
    slot = engine.slots[0]
    drafter = slot.drafter
    for ev in engine.generate(ids, params):
        tokens += ev.emitted
        emitted += len(ev.emitted)
        drafted += ev.num_drafted
        assert engine.cache_lengths()["verifier"] == len(ids) + emitted - 1
        # the draft's cache holds a prefix of the verified text in its own tokens, nothing else
        drafter._sync(slot.tokens)
        assert drafter.cached == drafter.target[: len(drafter.cached)]
        assert slot.draft_runner.cache_len == len(drafter.cached)
    assert tokens == hf_greedy(pair, ids, n)
    assert drafted > 0


@pytest.mark.parametrize("method", ["string", "intersection"])
def test_sps_across_vocabularies_reproduces_the_verifier_distribution(cross, method):
    # The two-token test of test_engine with cross-vocabulary drafts: 1500 seeds, L1 bound,
    # false-failure odds 1e-4.
    pair = cross[method]
    sp = SamplingParams(temperature=1.5, top_k=3, top_p=1.0)
    ids = pair.tokenizer("the dog sat on the")["input_ids"]
    exact = exact_two_tokens(pair, ids, sp)
    cells = sorted(exact)
    index = {c: i for i, c in enumerate(cells)}
    engine = SpeculativeEngine(pair)
    samples, drafted = [], 0
    for seed in range(1500):
        params = GenerationParams(sampling=sp, rule="sps", num_draft_tokens=3, max_tokens=2, ignore_eos=True, seed=seed)
        tokens, stats, _ = run(engine, ids, params)
        drafted += stats.num_draft_tokens
        samples.append(index[tuple(tokens[:2])])
    assert drafted > 1000
    assert_matches(torch.tensor(samples), torch.tensor([exact[c] for c in cells]), false_failure_odds=1e-4)


def realized_kl(pair, delta):
    params = GenerationParams(
        sampling=SamplingParams(1.0, 0, 1.0),
        rule="cactus-exact",
        rule_kwargs={"delta": delta},
        num_draft_tokens=4,
        max_tokens=40,
        ignore_eos=True,
        measure=True,
        seed=3,
    )
    _, stats, events = run(SpeculativeEngine(pair), pair.tokenizer(TEXT)["input_ids"], params)
    assert stats.num_draft_tokens > 0
    return [x for ev in events for x in ev.realized_kl]


def test_cactus_across_vocabularies_stays_within_its_budget(cross):
    # String drafts are one-hot: given the drafted token the emitted distribution is the rule's
    # h, whose KL to q is KL_bern(g || q_n) <= delta exactly under cactus-exact; the meter's
    # realized KL per position stays within the budget.
    assert max(realized_kl(cross["string"], 0.5)) <= 0.5 + 1e-4
    # Intersection drafts are a distribution p: the emitted distribution is a mixture over the
    # drafted token, whose divergence delta does not bound (docs/algorithm.md, "What the budget does
    # not say"; the same holds for a same-vocabulary draft model). delta = 0 is SpS: nothing moves.
    assert max(realized_kl(cross["intersection"], 0.0)) < 1e-6
    assert sum(realized_kl(cross["intersection"], 0.5)) > 0


def test_string_drafts_stop_at_eos_and_skip_what_they_cannot_spell(cross):
    pair = cross["string"]
    engine = SpeculativeEngine(pair)
    d = engine.slots[0].drafter
    seq = pair.tokenizer("the cat sat")["input_ids"]
    d.start(seq, [])
    dt = pair.cross.tokenizer
    word = lambda w: dt.convert_tokens_to_ids(w)  # noqa: E731
    eos_v = pair.tokenizer.eos_token_id
    # the draft wrote "on the </s>": both words, then EOS (text complete: nothing left out)
    p = d._string(seq, [word("on"), word("the"), dt.eos_token_id], 4, GREEDY, 1)
    assert p.tokens.tolist() == pair.tokenizer(" on the")["input_ids"] + [eos_v]
    # "on the mat": the last word may continue (the draft's text could end inside it): left out
    p = d._string(seq, [word("on"), word("the"), word("mat")], 4, GREEDY, 1)
    assert p.tokens.tolist() == pair.tokenizer(" on the")["input_ids"]
    # a word the verifier does not have re-tokenizes to <unk>; only what precedes it is proposed
    p = d._string(seq, [word("zebra")], 4, GREEDY, 1)
    assert p.tokens.tolist() == []
    p = d._string(seq, [dt.eos_token_id], 4, GREEDY, 1)  # EOS first: the verifier's EOS alone
    assert p.tokens.tolist() == [eos_v]


def test_string_drafts_write_the_drafts_most_likely_text_at_any_temperature(cross):
    # Any one-hot draft keeps SpS lossless, so the string method drafts the draft model's argmax
    # text: the same proposal whatever the temperature and the generator's seed.
    pair = cross["string"]
    seq = pair.tokenizer("the cat sat on the")["input_ids"]
    hot = SamplingParams(temperature=2.0, top_k=0, top_p=1.0)
    proposals = []
    for sp, seed in ((GREEDY, 0), (hot, 1), (hot, 2), (hot, 3)):
        d = SpeculativeEngine(pair).slots[0].drafter
        d.start(seq, [])
        proposals.append(d.propose(seq, 4, sp, torch.Generator().manual_seed(seed)).tokens.tolist())
    assert proposals[0] and all(p == proposals[0] for p in proposals)
    # intersection samples from its (restricted) distribution: p is the draft's, at the run's temperature
    drawn = set()
    for seed in range(8):
        d = SpeculativeEngine(cross["intersection"]).slots[0].drafter
        d.start(seq, [])
        drawn.add(tuple(d.propose(seq, 4, hot, torch.Generator().manual_seed(seed)).tokens.tolist()))
    assert len(drawn) > 1


def test_intersection_refuses_a_pair_that_shares_too_little(tiny, tmp_path):
    folder = tmp_path / "alien"
    words = [f"w{i}" for i in range(60)]
    make_model(folder, "llama", 9, len(SPECIALS) + len(words))
    word_tokenizer(folder, words)
    with pytest.raises(ModelError, match="share too little vocabulary"):
        load_pair(tiny["verifier"], str(folder), None, "cpu", dtype="float32", cross_vocab="intersection")
    pair = load_pair(tiny["verifier"], str(folder), None, "cpu", dtype="float32")  # string works with any overlap
    assert pair.cross.method == "string"


def test_cli_across_vocabularies(tiny, cross):
    runner = CliRunner()
    args = [
        "--verifier",
        tiny["verifier"],
        "--draft",
        cross["folder"],
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--no-chat-template",
        "-t",
        0,
        "-n",
        12,
        "-k",
        3,
        "--json",
    ]
    for method in ("auto", "intersection"):
        r = runner.invoke(app, ["generate", TEXT, *args, "--cross-vocab", method])
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        assert doc["settings"]["cross_vocab_resolved"]["method"] == ("string" if method == "auto" else method)
        assert doc["stats"]["draft_sources"]["model"]["drafted"] > 0  # counted in verifier tokens


def test_bench_compares_a_same_family_and_a_cross_family_draft_in_one_run(tiny, cross):
    r = CliRunner().invoke(
        app,
        [
            "bench",
            "--verifier",
            tiny["verifier"],
            "--draft",
            f"{tiny['draft_close']},{cross['folder']},suffix+{cross['folder']}",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--category",
            "grounded",
            "--limit",
            1,
            "-n",
            8,
            "--rules",
            "sps",
            "-k",
            "2",
            "-t",
            0,
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["results"]
    assert [row["draft"] for row in rows] == [None, tiny["draft_close"], cross["folder"], f"suffix+{cross['folder']}"]
    assert all(row["draft_sources"] for row in rows[1:])  # each drafted, in verifier tokens
    # --cross-vocab applies to the drafts of another vocabulary; the same-family one drafts as before
    r = CliRunner().invoke(
        app,
        [
            "bench",
            "--verifier",
            tiny["verifier"],
            "--draft",
            f"{tiny['draft_close']},{cross['folder']}",
            "--cross-vocab",
            "intersection",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--category",
            "grounded",
            "--limit",
            1,
            "-n",
            8,
            "--rules",
            "sps",
            "-k",
            "2",
            "-t",
            0,
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["results"]) == 3  # (refused before: the same-family draft shares the vocabulary)
    r = CliRunner().invoke(
        app,
        [
            "bench",
            "--verifier",
            tiny["verifier"],
            "--draft",
            f"{tiny['draft_close']},{tiny['draft']}",
            "--cross-vocab",
            "string",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--limit",
            1,
            "-n",
            4,
            "--rules",
            "sps",
            "-k",
            "2",
        ],
    )
    assert r.exit_code != 0 and "every --draft model shares the verifier's vocabulary" in r.output


def test_bench_times_each_cross_vocabulary_method_side_by_side(tiny, cross):
    args = [
        "bench",
        "--verifier",
        tiny["verifier"],
        "--draft",
        f"{tiny['draft_close']},{cross['folder']}",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--category",
        "grounded",
        "--limit",
        1,
        "-n",
        8,
        "--rules",
        "sps",
        "-k",
        "2",
        "-t",
        0,
        "--json",
    ]
    r = CliRunner().invoke(app, [*args, "--cross-vocab", "string,intersection"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = doc["results"]
    assert [(row["draft"], row["cross_vocab"]) for row in rows] == [
        (None, None),
        (tiny["draft_close"], None),
        (cross["folder"], "string"),
        (cross["folder"], "intersection"),
    ]
    assert len({row["config"] for row in rows}) == 4  # the method is in the label
    # the settings name every method asked for, the environment every one that ran
    assert doc["settings"]["cross_vocab"] == doc["environment"]["cross_vocab"] == "string,intersection"
    assert all(row["draft_sources"] for row in rows[1:])
    cross_only = [cross["folder"] if a == f"{tiny['draft_close']},{cross['folder']}" else a for a in args]
    r = CliRunner().invoke(app, [*cross_only, "--cross-vocab", "intersection"])  # its baseline row drafts nothing
    assert r.exit_code == 0, r.output
    assert [row["cross_vocab"] for row in json.loads(r.stdout)["results"]] == [None, "intersection"]
    r = CliRunner().invoke(app, [*args, "--cross-vocab", "auto,string"])  # auto is string: one row, not two
    assert r.exit_code == 0, r.output
    assert [row["cross_vocab"] for row in json.loads(r.stdout)["results"]] == [None, None, "string"]
    r = CliRunner().invoke(app, [*args, "--cross-vocab", "string,letters"])
    assert r.exit_code != 0 and "--cross-vocab: each value must be one of auto, string, intersection" in r.output


def byte_level_tokenizer(vocab_size=262):
    """A byte-level BPE with almost no merges: "é" and emoji stay several byte tokens."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["the cat sat on the mat"] * 50,
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=["<eos>"],
        show_progress=False,
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")


def test_a_character_split_across_byte_level_tokens_is_never_half_read():
    from cactus_cli.infer.load.vocab import visible_text

    tok = byte_level_tokenizer()
    assert spelling_scheme(tok) == "bytelevel"
    text = "caf\u00e9 \U0001f600 the cat"
    ids = tok(text)["input_ids"]
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))  # the split really happens
    cut = [visible_text(tok, ids[:i]) for i in range(1, len(ids) + 1)]
    assert all("\ufffd" not in t for t in cut) and cut[-1] == text
    assert all(text.startswith(t) for t in cut)  # each is the text so far, never a half character
    spelled = token_bytes(tok)
    assert b"".join(spelled[i] for i in ids) == text.encode()  # spelled by bytes, exactly
