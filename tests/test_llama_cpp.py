"""The llama.cpp backend on tiny GGUF files written in-process (tests/gguf_helpers.py): the runner
against a fresh full-sequence forward, greedy speculation equal to greedy plain decoding with
every drafter, SpS lossless end to end, the backend choice, the token-id check, and bad files.
Needs llama-cpp-python (the `demo` extra, which the README's test command installs)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cactus_cli.core.errors import ContextLimitError, ModelError
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.core.stats import SpecStats
from cactus_cli.infer.backends import registry
from cactus_cli.infer.backends.llama_cpp import gguf
from cactus_cli.infer.backends.llama_cpp import runner as llama_cpp
from cactus_cli.infer.backends.llama_cpp.runner import LlamaCppRunner
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.draft import Free
from cactus_cli.infer.load.sources import Source
from cactus_cli.infer.pair import plan
from cactus_cli.infer.pair.loader import load_pair
from tests.gguf_helpers import write_tiny_gguf
from tests.stats_helpers import assert_matches

if gguf.available() is not None:
    if os.environ.get("CI"):
        raise RuntimeError(f"llama-cpp-python is missing in CI: {gguf.available()}")
    pytest.skip(f"llama.cpp backend unavailable: {gguf.available()}", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
PROMPT = "the cat sat on the mat and then the cat sat"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf")
    return {
        "verifier": str(write_tiny_gguf(root / "verifier.gguf", seed=0)),
        "close": str(write_tiny_gguf(root / "close.gguf", seed=0, noise=0.05)),
        "other": str(write_tiny_gguf(root / "other.gguf", seed=7)),
        "short": str(write_tiny_gguf(root / "short.gguf", seed=0, context=32)),
    }


@pytest.fixture(scope="module")
def pairs(files):
    def load(draft):
        return load_pair(
            files["verifier"], files[draft] if draft else None, None, "cpu", dtype="auto", backend="llama.cpp"
        )

    return {"close": load("close"), "other": load("other"), "alone": load(None)}


def encode(pair, text=PROMPT) -> list[int]:
    return list(pair.tokenizer(text)["input_ids"])


def run(engine, ids, params):
    stats, tokens = SpecStats(), []
    for ev in engine.generate(ids, params):
        stats.update(ev)
        tokens += ev.emitted
    return tokens, stats


def full_logits(pair, ids: list[int]) -> torch.Tensor:
    """Every position's logits from a fresh context, one forward."""
    runner = LlamaCppRunner(pair.verifier, pair.vocab_size, pair.verifier.context_length)
    return runner.forward(ids, len(ids)).clone()


def test_the_pair_runs_on_llama_cpp_and_says_why(pairs):
    pair = pairs["close"]
    assert pair.verifier.backend == pair.draft.backend == "llama.cpp"
    assert pair.backend_reason == "backend llama.cpp (asked for)"
    assert "all F32" in pair.verifier.quantize_note and pair.verifier.quantize == "gguf"
    runner = registry.backend_of(pair.verifier.backend).runner(pair.verifier, pair.vocab_size, False, 512, "verifier")
    assert isinstance(runner, LlamaCppRunner)


def test_forward_crop_reset_and_prefill_agree_with_one_full_forward(pairs):
    pair = pairs["alone"]
    ids = encode(pair)
    full = full_logits(pair, ids)
    runner = LlamaCppRunner(pair.verifier, pair.vocab_size, 512)
    a = runner.forward(ids[:5], keep=5).clone()
    b = runner.forward(torch.tensor(ids[5:]), keep=len(ids) - 5).clone()  # (ids as a tensor too)
    assert runner.cache_len == len(ids) and runner.forward_passes == 2
    torch.testing.assert_close(torch.cat([a, b]), full, atol=1e-4, rtol=1e-4)
    runner.crop(7)  # back to 7 tokens, then the rest again: the same logits
    assert runner.cache_len == 7
    torch.testing.assert_close(runner.forward(ids[7:], keep=3), full[-3:], atol=1e-4, rtol=1e-4)
    runner.reset()
    assert runner.cache_len == 0
    torch.testing.assert_close(runner.forward(ids, keep=1), full[-1:], atol=1e-4, rtol=1e-4)
    # prefill keeps the prefix a new prompt shares with the last sequence, and only that
    longer = ids + encode(pair, " and the dog")
    kept = runner.prefill(longer, ids, reuse=True)
    assert kept == len(ids) and runner.cache_len == len(longer) - 1
    torch.testing.assert_close(
        runner.forward(longer[-1:], keep=1), full_logits(pair, longer)[-1:], atol=1e-4, rtol=1e-4
    )
    assert runner.prefill(longer, ids, reuse=False) == 0 and runner.cache_len == len(longer) - 1


def test_the_context_grows_with_the_request_and_keeps_the_cache(pairs, monkeypatch):
    monkeypatch.setattr(llama_cpp, "FIRST_CONTEXT", 16)
    monkeypatch.setattr(llama_cpp, "MAX_OUTPUTS", 2)
    pair = pairs["alone"]
    ids = (encode(pair) * 30)[:400]
    full = full_logits(pair, ids)
    runner = LlamaCppRunner(pair.verifier, pair.vocab_size, 512)
    first = runner.n_ctx  # (llama.cpp rounds a context up to 256)
    runner.forward(ids[:350], keep=1)
    rows = runner.forward(ids[350:], keep=50)  # past the first context and past the outputs it was made for
    assert runner.n_ctx > first and runner.cache_len == 400
    # (hundreds of positions in float16 KV, batched in other splits: equal up to rounding, same argmax)
    torch.testing.assert_close(rows, full[350:], atol=0.1, rtol=0.01)
    assert torch.equal(rows.argmax(-1), full[350:].argmax(-1))
    runner.reserve(10_000)  # (room is capped at the model's window: the engine stops there)
    with pytest.raises(ContextLimitError, match="600 tokens do not fit the model's context window of 512"):
        runner.forward(ids[:200], keep=1)
    assert runner.cache_len == 400


@pytest.mark.parametrize("k", [1, 4, "auto"])
@pytest.mark.parametrize("draft", ["close", "other", "ngram", "suffix"])
def test_greedy_speculative_equals_greedy_plain_decoding(pairs, draft, k):
    model = pairs["alone"] if draft in ("ngram", "suffix") else pairs[draft]
    engine = SpeculativeEngine(model, Free(draft) if draft in ("ngram", "suffix") else None)
    plain = SpeculativeEngine(pairs["alone"])
    ids = encode(model)
    n = 40
    params = GenerationParams(
        sampling=GREEDY, num_draft_tokens=8 if k == "auto" else k, adaptive_k=k == "auto", max_tokens=n, ignore_eos=True
    )
    expected, _ = run(plain, ids, GenerationParams(sampling=GREEDY, num_draft_tokens=0, max_tokens=n, ignore_eos=True))
    for _ in range(2):  # twice: the second run of the suffix drafter drafts from the first's answer
        tokens, stats = run(engine, ids, params)
        assert tokens == expected
    if draft == "close" and k == 4:
        assert stats.num_accepted_tokens > 0  # the pair does speculate


def test_sps_on_llama_cpp_reproduces_the_verifier_distribution_of_two_tokens(pairs):
    # The first two generated tokens' joint distribution over many seeds must equal the verifier's
    # exact one (top-k 3 sampling: 9 cells), computed from one-row forwards of a fresh context.
    # N = 1500 runs; L1 bound at false-failure odds 1e-4 (the torch runners' test, same odds).
    from cactus_cli.core.sampling import probs_from_logits

    pair = pairs["other"]
    sp = SamplingParams(temperature=1.5, top_k=3, top_p=1.0)
    ids = encode(pair, "the dog")
    q1 = probs_from_logits(full_logits(pair, ids)[-1], sp).double()
    exact = {}
    for t1 in q1.nonzero().flatten().tolist():
        q2 = probs_from_logits(full_logits(pair, ids + [t1])[-1], sp).double()
        for t2 in q2.nonzero().flatten().tolist():
            exact[(t1, t2)] = (q1[t1] * q2[t2]).item()
    cells = sorted(exact)
    index = {c: i for i, c in enumerate(cells)}
    engine = SpeculativeEngine(pair)
    samples = []
    for seed in range(1500):
        params = GenerationParams(sampling=sp, rule="sps", num_draft_tokens=2, max_tokens=2, ignore_eos=True, seed=seed)
        tokens, _ = run(engine, ids, params)
        samples.append(index[tuple(tokens[:2])])  # KeyError = a token the verifier cannot emit
    assert_matches(torch.tensor(samples), torch.tensor([exact[c] for c in cells]), false_failure_odds=1e-4)


def test_the_same_file_on_torch_gives_nearly_the_same_logits(files, pairs):
    """transformers reads the same GGUF: the two backends compute one model (llama.cpp keeps its
    KV cache in float16, hence the tolerance) and pick the same greedy tokens."""
    pair = pairs["alone"]
    ids = encode(pair)
    on_torch = load_pair(files["verifier"], None, None, "cpu", dtype="float32", backend="torch")
    assert on_torch.backend_reason == "backend torch (asked for)"
    with torch.no_grad():
        theirs = on_torch.verifier.model(torch.tensor([ids])).logits[0, :, : pair.vocab_size]
    ours = full_logits(pair, ids)
    assert (theirs - ours).abs().max() < 0.05 * ours.abs().max()
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_auto_picks_llama_cpp_for_gguf_on_a_cpu_and_torch_otherwise(files, tiny, monkeypatch):
    g = Source("gguf", files["verifier"])
    cpu = torch.device("cpu")

    def choose(asked, sources, **settings):
        backend, why, note = registry.choose(asked, sources, plan.LoadRequest(verifier="v", **settings), cpu)
        return backend.name, why, note

    assert choose("auto", [("v", g)])[:2] == ("llama.cpp", "backend auto: llama.cpp (GGUF files on a CPU)")
    assert choose("auto", [("v", g)], quantize="none")[0] == "llama.cpp"
    folder = Source("folder", tiny["verifier"])
    assert choose("auto", [("v", g), ("d", folder)])[:2] == (
        "torch",
        "backend auto: torch (not llama.cpp: d is a folder)",
    )
    for settings, flag, owner in (
        ({"quantize": "int8"}, "--quantize int8", " (it is a torch setting)"),
        ({"dtype": "float32"}, "--dtype float32", ""),
        ({"compile": "on"}, "--compile on", ""),
        ({"tp": 2}, "--tp 2", ""),
    ):
        assert choose("auto", [("v", g)], **settings)[:2] == ("torch", f"backend auto: torch (not llama.cpp: {flag})")
        with pytest.raises(
            ModelError, match=f"^{flag} does not apply to the llama.cpp backend{re.escape(owner)}; drop"
        ):
            choose("llama.cpp", [("v", g)], **settings)
    with pytest.raises(ModelError, match="--quantize q4_0 does not apply to the torch backend .it is a llama.cpp"):
        choose("torch", [("v", g)], quantize="q4_0")
    with pytest.raises(ModelError, match="--backend llama.cpp cannot run 'v', a folder; use another --backend"):
        choose("llama.cpp", [("v", folder)])
    monkeypatch.setattr(gguf, "available", lambda: "the llama.cpp backend needs llama-cpp-python (...); install it")
    backend, why, note = choose("auto", [("v", g)])
    assert backend == "torch" and why.startswith("backend auto: torch (not llama.cpp: the llama.cpp backend needs")
    assert note.startswith("llama.cpp is not available: ")
    with pytest.raises(ModelError, match="needs llama-cpp-python"):
        choose("llama.cpp", [("v", g)])


def test_a_tokenizer_that_gives_other_ids_is_refused_at_load(files, tiny, monkeypatch):
    with pytest.raises(ModelError, match="do not share a vocabulary"):  # another vocabulary: the --tokenizer check
        load_pair(files["verifier"], None, tiny["verifier"], "cpu", dtype="auto", backend="llama.cpp")
    # the same vocabulary, other ids for the probe text (llama.cpp's tokenizer would split it otherwise)
    real = gguf.GGUFModel.tokenize
    monkeypatch.setattr(gguf.GGUFModel, "tokenize", lambda self, text: real(self, text)[:-2] + real(self, text)[-1:])
    with pytest.raises(
        ModelError,
        match=r"verifier .*: llama.cpp's vocabulary and the tokenizer give different token "
        r"ids for the same text \(first at token \d+",
    ):
        load_pair(files["verifier"], None, None, "cpu", dtype="auto", backend="llama.cpp")


def cactus(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cactus_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )


def test_generate_json_says_which_backend_ran_and_why(files):
    r = cactus(
        "generate",
        PROMPT,
        "--verifier",
        files["verifier"],
        "--draft",
        files["close"],
        "-n",
        "12",
        "-t",
        "0",
        "-k",
        "4",
        "--json",
        "--threads",
        "1",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)["settings"]
    assert (s["backend"], s["backend_resolved"], s["threads"]) == ("auto", "llama.cpp", 1)
    assert s["backend_reason"] == "backend auto: llama.cpp (GGUF files on a CPU)"
    r = cactus("generate", PROMPT, "--verifier", files["verifier"], "--backend", "llama.cpp", "--quantize", "w8a8")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: --quantize w8a8 does not apply to the llama.cpp backend (it is a torch setting); "
        "drop it, or use --backend torch"
    )


def test_bench_runs_both_backends_side_by_side_each_with_its_own_baseline(files):
    r = cactus(
        "bench",
        "--verifier",
        files["verifier"],
        "--draft",
        files["close"],
        "--backend",
        "torch,llama.cpp",
        "--rules",
        "sps",
        "-k",
        "2",
        "--limit",
        "1",
        "-n",
        "8",
        "--json",
        "--dtype",
        "auto",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["results"]
    assert [(row["backend"], row["kind"]) for row in rows] == [
        ("torch", "autoregressive"),
        ("torch", "speculative"),
        ("llama.cpp", "autoregressive"),
        ("llama.cpp", "speculative"),
    ]
    assert len({row["config"] for row in rows}) == 4


@pytest.mark.parametrize("damage", ["random bytes", "truncated", "unknown architecture"])
def test_a_bad_gguf_is_one_line(files, tmp_path, damage):
    bad = tmp_path / "bad.gguf"
    if damage == "random bytes":
        bad.write_bytes(os.urandom(4096))
    elif damage == "truncated":
        bad.write_bytes(Path(files["verifier"]).read_bytes()[:200_000])
    else:
        write_tiny_gguf(bad, architecture="nosucharch")
    r = cactus("generate", "hi", "--verifier", str(bad), "--backend", "llama.cpp", "-n", "4")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and lines[-1].startswith("error: ") and str(bad) in lines[-1], lines[-3:]


def test_a_prompt_longer_than_the_context_is_one_line(files):
    r = cactus(
        "generate", "the cat sat on the mat " * 20, "--verifier", files["short"], "--backend", "llama.cpp", "-n", "4"
    )
    assert r.returncode == 2 and "context window is 32" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


def test_without_the_bindings_auto_runs_a_gguf_on_torch_and_says_how_to_install_them(files, monkeypatch):
    monkeypatch.setattr(gguf, "available", lambda: gguf.INSTALL_HINT)
    said = []

    class Reporter:
        def task(self, description, total=None):
            return lambda n: None

        def done(self, description):
            pass

        def warn(self, message):
            said.append(message)

    pair = load_pair(files["verifier"], None, None, "cpu", dtype="auto", reporter=Reporter(), backend="auto")
    assert pair.verifier.backend == "torch" and pair.backend_reason.startswith("backend auto: torch (not llama.cpp: ")
    assert said == [f"running the models on torch (slower on a CPU): llama.cpp is not available: {gguf.INSTALL_HINT}"]


def test_several_sequences_in_one_decode_each_get_their_own_logits(pairs):
    """forward_rows: three sequences of different lengths and widths in one llama_decode, each
    row's logits those of its sequence alone; crop and reset touch one sequence only; adopt
    shares a prefix another sequence holds (seq_cp) and decodes on from it correctly."""
    pair = pairs["alone"]
    texts = [PROMPT, "the dog ran fast and the cat", "a red bird sang on the tree and then the sun"]
    seqs = [encode(pair, t) for t in texts]
    full = [full_logits(pair, ids) for ids in seqs]
    first = LlamaCppRunner(pair.verifier, pair.vocab_size, 512, sequences=3)
    runners = [first.sequence(i) for i in range(3)]
    for r, ids in zip(runners, seqs):  # prefixes of different lengths, one call each
        r.forward(ids[:-4], keep=1)
    calls = first.shared.forward_passes
    rows = first.forward_rows([(r, ids[-4:], keep) for r, ids, keep in zip(runners, seqs, (4, 1, 2))])
    assert first.shared.forward_passes == calls + 1  # one decode for all three
    for got, want, keep in zip(rows, full, (4, 1, 2)):
        torch.testing.assert_close(got, want[-keep:], atol=1e-4, rtol=1e-4)
    assert [r.cache_len for r in runners] == [len(s) for s in seqs]
    runners[1].crop(3)
    runners[2].reset()
    assert [r.cache_len for r in runners] == [len(seqs[0]), 3, 0]
    # (the new token lands in a cell sequence 1 freed: attention runs over the cells in another
    # order and llama.cpp's float16 accumulation rounds differently; the same token wins)
    after = runners[0].forward([seqs[1][0]], 1)
    alone = full_logits(pair, seqs[0] + seqs[1][:1])[-1:]
    torch.testing.assert_close(after, alone, atol=2e-2, rtol=1e-2)
    assert torch.equal(after.argmax(-1), alone.argmax(-1))
    # adopt: sequence 2 takes sequence 0's first 6 tokens without decoding them
    assert runners[2].adopt(runners[0], 6) == 6 and runners[2].cache_len == 6
    before = first.shared.forward_passes
    got = runners[2].forward(seqs[0][6:9], keep=3)
    assert first.shared.forward_passes == before + 1
    torch.testing.assert_close(got, full[0][6:9], atol=1e-4, rtol=1e-4)


def test_batched_greedy_speculation_on_llama_cpp_equals_each_run_alone(pairs):
    from cactus_cli.infer.decode.batch import Batch

    pair = pairs["close"]
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=3, max_tokens=16, ignore_eos=True)
    prompts = [PROMPT, "the dog ran fast and the cat", PROMPT + " on the mat", "a red bird"]
    alone = [run(SpeculativeEngine(pair), encode(pair, p), params)[0] for p in prompts]
    engine = SpeculativeEngine(pair, sequences=4)
    batch = Batch(engine)
    entries = [batch.add(engine.start(encode(pair, p), params, slot=i)) for i, p in enumerate(prompts)]
    got = {id(e): [] for e in entries}
    while len(batch):
        for entry, ev in batch.step():
            got[id(entry)] += ev.emitted
    assert [got[id(e)] for e in entries] == alone


def test_a_prompt_joining_in_chunks_on_llama_cpp_answers_as_alone(pairs):
    """The chunked prefill on llama.cpp: prompt chunks (no logits) in the same llama_decode as
    the running run's verify rows, greedy answers unchanged (tests/test_slots.py: on torch)."""
    from tests.test_slots import join_in_chunks

    pair = pairs["close"]
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=3, max_tokens=120, ignore_eos=True)
    running, joining = encode(pair, "a red bird"), encode(pair, " ".join([PROMPT] * 4))
    expected = [
        run(SpeculativeEngine(pair), running, params)[0],
        run(SpeculativeEngine(pair), joining, dataclasses.replace(params, max_tokens=12))[0],
    ]
    got, steps_to_first = join_in_chunks(SpeculativeEngine(pair, sequences=2), running, joining, params, 7)
    assert got == expected
    assert steps_to_first == -(-(len(joining) - 1) // 7)


def test_repack_patterns_name_only_the_matmul_weights_the_x86_repack_has_kernels_for():
    tensors = [
        ("token_embd.weight", "Q4_K", 2, 151936),  # a lookup (GET_ROWS), never repacked
        ("output.weight", "Q6_K", 2, 151936),  # no x86 kernel for Q6_K
        ("blk.0.attn_q.weight", "Q4_K", 2, 1536),
        ("blk.0.attn_v.weight", "Q6_K", 2, 256),
        ("blk.0.attn_q.bias", "F32", 1, 1),
        ("blk.0.ffn_down.weight", "Q4_0", 2, 1536),
        ("blk.1.ffn_up.weight", "Q4_0", 2, 12),  # rows not a multiple of 8
        ("blk.1.ffn_gate.weight", "Q2_K", 2, 64),  # AVX-512 only
    ]
    flags = {"avx2", "avx512f"}
    assert gguf.repack_patterns(tensors, flags) == [
        r"^blk\.0\.(attn_q|ffn_down)\.weight$",
        r"^blk\.1\.(ffn_gate)\.weight$",
    ]
    assert gguf.repack_patterns(tensors, {"avx2"}) == [r"^blk\.0\.(attn_q|ffn_down)\.weight$"]
    assert gguf.repack_patterns(tensors, {"neon"}) == []  # (the table is x86's)
    assert gguf.repack_patterns([("output.weight", "Q4_0", 2, 64)], flags) == [r"^output\.weight$"]


def test_on_an_amx_build_the_repackable_weights_run_on_the_repacked_kernels(tmp_path, monkeypatch):
    """AMX's matmul crashes on batches, so on an AMX build the extra buffer types stay off; the Q4_0
    weights still go to CPU_REPACK by name, and the logits are the plain buffers' up to rounding."""
    from cactus_cli.infer.load.devices import cpu_flags
    from cactus_cli.infer.load.sources import LoadedModel

    if "avx2" not in cpu_flags():
        pytest.skip("the repack table is x86's (AVX2)")
    path = str(write_tiny_gguf(tmp_path / "q4_0.gguf", q4_0=True))
    monkeypatch.setattr(gguf, "amx_in_use", lambda: True)
    repacked = gguf.GGUFModel.load(path, 1)
    monkeypatch.setattr(gguf, "repack_overrides", lambda p: None)
    plain = gguf.GGUFModel.load(path, 1)
    assert repacked.buffers == "repacked, AMX left out" and repacked.buffer_mib.get("CPU_REPACK", 0) > 0
    assert plain.buffers == "plain" and "CPU_REPACK" not in plain.buffer_mib
    ids = [(5 + 13 * i) % plain.n_vocab for i in range(24)]
    logits = []
    for model in (repacked, plain):
        lm = LoadedModel(model, path, path, torch.device("cpu"), torch.float32, model.n_ctx_train, model.n_vocab)
        runner = LlamaCppRunner(lm, model.n_vocab, 64)
        logits.append(runner.forward(ids, keep=8).float().clone())
        runner.close()
        model.close()
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
    assert torch.allclose(logits[0], logits[1], atol=0.05), (logits[0] - logits[1]).abs().max()


def test_a_server_makes_every_slots_room_at_start_so_requests_never_replay_the_caches(files, monkeypatch):
    """A llama.cpp context grown mid-run replays every cached sequence (on the Xeon, 4 requests sent
    together waited 36 s for their first tokens while the context grew twice); the server now makes
    each slot's room when it starts, and requests that fit it never grow the context."""
    pytest.importorskip("fastapi")
    import threading

    from cactus_cli.app.serve.serving import Finished, Server
    from cactus_cli.app.session import Session

    session = Session.load(
        verifier=files["verifier"],
        draft=files["close"],
        device="cpu",
        backend="llama.cpp",
        num_draft_tokens=3,
        max_tokens=16,
        temperature=0.0,
        seed=0,
        sequences=4,
    )
    made = []
    make = llama_cpp.Context.make
    monkeypatch.setattr(llama_cpp.Context, "make", lambda self, *a: (made.append(a), make(self, *a))[1])
    server = Server(session, parallel=4)
    try:
        started = len(made)
        ids = session.tokenizer(PROMPT)["input_ids"]
        done = [threading.Event() for _ in range(4)]
        for i in range(4):
            prompt = ids * (i + 1)  # (different lengths, the longest 4x the prompt)
            deliver = lambda item, e=done[i]: e.set() if isinstance(item, (Finished, Exception)) else None  # noqa: E731
            server.submit(server.request(prompt, {"max_tokens": 24, "temperature": 0}, deliver))
        assert all(e.wait(120) for e in done)
        assert len(made) == started, made[started:]
    finally:
        server.stop()


def test_bench_concurrency_makes_every_slots_room_before_its_rows(files, monkeypatch):
    """bench --concurrency: every slot's room is made when the engines are prepared, so no row
    grows a context mid-run (on the EPYC a row of 4 requests waited 36 s for its first tokens
    where one at a time took 14 s: the context grew as each slot joined, replaying the others)."""
    from tests.helpers import invoke

    made, grown = [], []  # (grown: made again while its sequences held tokens, which it replays)
    make = llama_cpp.Context.make

    def counting(self, *a):
        made.append(a)
        if any(self.ids):
            grown.append((a, [len(ids) for ids in self.ids]))
        return make(self, *a)

    monkeypatch.setattr(llama_cpp.Context, "make", counting)
    # (3 slots of 200 tokens and more: past the 512 cells a first context has)
    args = "bench --backend llama.cpp --rules sps -k 2 --limit 3 -n 200 --concurrency 3 --json".split()
    r = invoke(*args, "--verifier", files["verifier"], "--draft", files["close"])
    assert r.exit_code == 0, r.output
    assert made and not grown, grown


def test_padding_comes_from_the_measured_curve():
    xeon = {1: 0.0775, 2: 0.1091, 3: 0.1456, 4: 0.0972, 16: 0.2949}  # (Q4_0 repacked, AMX Xeon, 2 threads)
    assert llama_cpp.padding(xeon) == {2: 4, 3: 4}
    assert llama_cpp.padding({1: 0.029, 2: 0.046, 3: 0.055, 4: 0.066}) == {}  # (the EPYC: every width cheaper)
    assert llama_cpp.padding({1: 0.03, 4: 0.06, 16: 0.2}) == {}  # (a curve without 2 and 3: nothing known)


def test_a_padded_call_gives_the_rows_logits_and_leaves_no_cells_behind(files):
    """Rows of a sequence no slot uses fill a call of 2 or 3 tokens to 4; the asked rows' logits are
    the unpadded call's, and the padding's cells are gone after it (the next call sees only the slots)."""
    lm = load_pair(files["verifier"], None, None, "cpu", dtype="auto", backend="llama.cpp").verifier
    ids = [5, 17, 29, 41, 53, 65, 77, 89]
    got = []
    for pad in ({}, {2: 4, 3: 4}):
        runner = LlamaCppRunner(lm, lm.model.n_vocab, 64, sequences=2)
        runner.shared.pad = pad
        other = runner.sequence(1)
        runner.forward(ids[:4], keep=1)
        other.forward(ids[2:5], keep=1)
        a = runner.forward(ids[4:6], keep=2).clone()  # (2 tokens: padded to 4)
        assert runner.shared.batch.n_tokens == (4 if pad else 2)
        b = other.forward(ids[5:6], keep=1).clone()
        pair = [x.clone() for x in runner.forward_rows([(runner, ids[6:7], 1), (other, ids[6:8], 2)])]  # (3 tokens)
        assert runner.shared.batch.n_tokens == (4 if pad else 3)
        scratch = runner.shared.sequences
        assert bindings_pos_max(runner, scratch) == -1
        assert (runner.cache_len, other.cache_len) == (7, 6)
        got.append([a, b, *pair])
        runner.close()
    for plain, padded in zip(*got):
        assert torch.allclose(plain, padded, atol=1e-4), (plain - padded).abs().max()


def bindings_pos_max(runner, seq: int) -> int:
    return gguf.bindings().llama_memory_seq_pos_max(runner.shared.memory, seq)
