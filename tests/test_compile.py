"""The compiled fast path (backends/torch/compiled.py's CompiledLM): static KV caches, fixed-width compiled steps,
rollback by rewinding the cache length. Checked on CPU in float32 against the eager engine:
greedy output token for token, logits after rewinds, SpS exactness (test_engine), no
recompilation after warm-up, and a clean fall back to eager when compiling fails."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cactus_cli.cli.main import app
from cactus_cli.core.paths import cache_path
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.backends.torch.compiled import CompiledLM, compile_problem
from cactus_cli.infer.backends.torch.eager import CachedLM
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.kpolicy.store import CostStore
from cactus_cli.infer.pair import plan as plan_mod
from cactus_cli.infer.pair.keys import cost_key
from cactus_cli.infer.pair.loader import load_pair
from tests.test_engine import GREEDY, hf_greedy, prompt_ids, run

needs_compiler = pytest.mark.skipif(
    compile_problem(torch.device("cpu")) is not None,
    reason=f"torch.compile cannot run here: {compile_problem(torch.device('cpu'))}",
)
K_MAX = 8


@pytest.fixture(scope="module")
def close_pair(tiny):
    return load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32")


@pytest.fixture(scope="module")
def compiled(close_pair):
    """One compiled engine for the module: widths for k = 1, 4 and auto (k_max 8) and the draft's."""
    engine = SpeculativeEngine(close_pair, compiled=True)
    engine.prepare(64, {2, 5, K_MAX + 1})
    assert engine.compiled and engine.compile_note is None
    return engine


def greedy(k, adaptive=False, n=40):
    return GenerationParams(
        sampling=GREEDY,
        rule="cactus",
        rule_kwargs={"delta": 1.0},
        num_draft_tokens=k,
        adaptive_k=adaptive,
        max_tokens=n,
        ignore_eos=True,
    )


@needs_compiler
@pytest.mark.parametrize("k,adaptive", [(1, False), (4, False), (K_MAX, True)])
def test_compiled_greedy_equals_eager_greedy(close_pair, compiled, k, adaptive):
    ids = prompt_ids(close_pair)
    eager_tokens, _, _ = run(SpeculativeEngine(close_pair), ids, greedy(k, adaptive))
    tokens, stats, _ = run(compiled, ids, greedy(k, adaptive))
    assert tokens == eager_tokens == hf_greedy(close_pair, ids, 40)
    if not adaptive:  # (auto mostly picks k = 0 on this pair: every step padded to k_max + 1)
        assert 0 < stats.draft_acceptance_rate < 1  # rejections happened: rewinds were exercised
    lengths = compiled.cache_lengths()
    assert lengths["verifier"] == lengths["sequence"] - 1


@needs_compiler
def test_w8a8_runs_compiled_and_gives_the_eager_greedy_tokens(tiny):
    """fbgemm's packed weights cannot be traced: compiled graphs call them as one opaque op
    (qlayers.w8a8_linear), q/k/v and gate/up still stacked. The compiled engine gives the eager
    engine's greedy tokens, with rejections and rewinds on the way (float32 activations: in
    bfloat16, compiled steps of different widths may round a near-tie differently)."""
    pair = load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32", quantize="w8a8")
    engine = SpeculativeEngine(pair, compiled=True)
    engine.prepare(64, {3})
    assert engine.compiled and engine.compile_note is None
    ids = prompt_ids(pair)
    eager, _, _ = run(SpeculativeEngine(pair), ids, greedy(2))
    tokens, stats, _ = run(engine, ids, greedy(2))
    assert tokens == eager
    assert 0 < stats.draft_acceptance_rate < 1


@needs_compiler
def test_rewound_cache_gives_the_logits_of_a_fresh_prefill(close_pair, compiled):
    # a 5-token verify step, then a rejection at every position j: rewind to the prompt + j
    # drafts, feed a correction token through the compiled (padded) step, and compare with a
    # fresh full pass over the same sequence
    v = compiled.slots[0].verifier
    assert isinstance(v, CompiledLM) and 5 in v.widths
    ids = prompt_ids(close_pair)
    drafts, correction = [10, 11, 12, 13], 20
    for j in range(5):
        v.prefill(ids, [], reuse=False)  # the cache holds ids[:-1]; the step feeds ids[-1]
        v.forward([ids[-1]] + drafts, keep=5)
        v.crop(len(ids) + j)
        got = v.forward([correction], keep=1)[0]
        seq = ids + drafts[:j] + [correction]
        with torch.no_grad():
            want = close_pair.verifier.model(torch.tensor([seq])).logits[0, -1, : close_pair.vocab_size]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert v.cache_len == len(seq)
    compiled.reset()


@needs_compiler
def test_no_recompilation_after_warm_up(close_pair, compiled):
    from torch._dynamo.utils import counters

    ids = prompt_ids(close_pair)
    sampled = GenerationParams(
        sampling=SamplingParams(0.8, 0, 1.0),
        rule="cactus",
        rule_kwargs={"delta": 0.5},
        num_draft_tokens=4,
        max_tokens=30,
        ignore_eos=True,
        seed=3,
    )
    run(compiled, ids, greedy(4))  # anything left to trace is traced here
    before = (dict(counters["stats"]), dict(counters["frames"]))
    for params in (greedy(1), greedy(4), greedy(K_MAX, True), sampled):
        run(compiled, ids, params)
        run(compiled, prompt_ids(close_pair, "the dog ran on the road and"), params)
    assert (dict(counters["stats"]), dict(counters["frames"])) == before


@needs_compiler
def test_chat_reuse_keeps_working_compiled(close_pair, compiled):
    ids = prompt_ids(close_pair)
    first, _, _ = run(compiled, ids, greedy(4, n=10))
    turn2 = ids + first + prompt_ids(close_pair, "the cat")
    params = greedy(4, n=12)
    reused = list(compiled.generate(turn2, params, reuse_cache=True))
    assert reused[0].reused_tokens == len(ids) + len(first) - 1
    tokens = [t for ev in reused for t in ev.emitted]
    assert tokens == hf_greedy(close_pair, turn2, 12)


def test_a_failing_compiler_falls_back_to_eager_with_one_line(close_pair, monkeypatch):
    def broken(*args, **kwargs):
        def step(*a, **k):
            raise RuntimeError("InductorError: no working C++ compiler\nlong traceback text")

        return step

    monkeypatch.setattr(torch, "compile", broken)
    engine = SpeculativeEngine(close_pair, compiled=True)
    lines = []
    engine.prepare(64, {5}, lines.append)
    v = engine.slots[0].verifier
    assert not engine.compiled and isinstance(v, CachedLM) and not isinstance(v, CompiledLM)
    assert (
        engine.compile_note
        == "compiling failed (RuntimeError: InductorError: no working C++ compiler); running eagerly"
    )
    assert lines[-1] == engine.compile_note
    ids = prompt_ids(close_pair)
    assert run(engine, ids, greedy(4))[0] == hf_greedy(close_pair, ids, 40)


def resolve_compile(mode: str, pair) -> tuple[bool, str]:
    """The plan's compile choice had ``--compile mode`` been given."""
    plan = plan_mod.with_compile(pair.plan, mode)
    return plan.compiled, plan.compile_reason


def test_compile_auto_is_off_on_cpu_until_measured_faster(close_pair):
    off_here = compile_problem(torch.device("cpu"))
    assert resolve_compile("auto", close_pair) == (False, f"auto: {off_here}" if off_here else "auto: off on a CPU")
    assert resolve_compile("off", close_pair) == (False, "off (as asked)")
    for compiled, seconds in ((False, 0.010), (True, 0.004)):  # what two earlier runs measured
        key = cost_key(close_pair, compiled)
        policy = CostStore(cache_path(key), key)
        for _ in range(3):
            policy.costs.add_verify(1, seconds)
        policy.dirty = True
        policy.save()
    assert resolve_compile("auto", close_pair)[0] == (off_here is None)  # (the plan reads the same cost key)


def test_compile_on_without_a_compiler_warns_and_runs_eagerly(close_pair, monkeypatch):
    monkeypatch.setattr(
        plan_mod, "compile_problem", lambda device: "no C++ compiler (g++ or clang++) for torch.compile's CPU backend"
    )
    assert resolve_compile("on", close_pair) == (
        False,
        "--compile on: no C++ compiler (g++ or clang++) for torch.compile's CPU backend; running eagerly",
    )


@needs_compiler
def test_several_slots_run_eagerly_where_compiling_was_chosen(tiny):
    """Compiled steps hold one sequence: where compile is on (asked, or measured faster) and several
    slots are asked for (serve --parallel, bench --concurrency), the engine runs them eagerly, all of
    them, and says why (it used to get one slot, and serve stepped one request at a time)."""
    from cactus_cli.app.session import Session

    class Lines:  # (a reporter: what the user sees)
        def __init__(self):
            self.warned = []

        def task(self, description, total=None):
            return lambda n: None

        def warn(self, message):
            self.warned.append(message)

    pair = dict(verifier=tiny["verifier"], draft=tiny["draft_close"], device="cpu", dtype="float32", compile="on")
    said = Lines()
    session = Session.load(sequences=4, reporter=said, **pair)
    why = "--compile on: compiled steps hold one sequence, so the 4 slots run eagerly"
    assert len(session.engine.slots) == 4 and not session.engine.compiled
    assert session.engine.pair.plan.compile_reason == why
    assert why in said.warned  # (a warning, not an error: serve --compile on --parallel 4 serves, eagerly)
    assert Session.load(sequences=1, **pair).engine.compiled  # (one sequence: compiled, as asked)


def test_compile_is_off_for_several_sequences_whoever_asks(close_pair, monkeypatch):
    """The plan decides, once, for every caller: several slots run eagerly, with why."""
    monkeypatch.setattr(plan_mod, "compile_problem", lambda device: None)  # (a compiler here or not)
    assert plan_mod.with_compile(close_pair.plan, "on", sequences=1).compiled
    several = plan_mod.with_compile(close_pair.plan, "on", sequences=4)
    assert (several.compiled, several.compile_reason) == (
        False,
        "--compile on: compiled steps hold one sequence, so the 4 slots run eagerly",
    )
    assert plan_mod.choose_compile(several) == (several.compiled, several.compile_reason)
    off = plan_mod.with_compile(close_pair.plan, "off", sequences=4)
    assert (off.compiled, off.compile_reason) == (False, "off (as asked)")  # (its own reason comes first)


def test_the_engine_refuses_a_compiled_engine_of_several_sequences(close_pair):
    with pytest.raises(ValueError, match="compiled steps hold one sequence, not 3"):
        SpeculativeEngine(close_pair, compiled=True, sequences=3)


# --------------------------------------------------------------------------- the CLI

cli = CliRunner()


def pair_args(tiny):
    return ["--verifier", tiny["verifier"], "--draft", tiny["draft_close"], "--device", "cpu", "--dtype", "float32"]


@needs_compiler
def test_generate_compile_on(tiny):
    r = cli.invoke(
        app,
        ["generate", "the cat sat", *pair_args(tiny), "-k", "4", "-n", "12", "-t", "0", "--compile", "on", "--json"],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["settings"]["compiled"] is True and doc["settings"]["compile_seconds"] > 0
    off = json.loads(
        cli.invoke(
            app,
            [
                "generate",
                "the cat sat",
                *pair_args(tiny),
                "-k",
                "4",
                "-n",
                "12",
                "-t",
                "0",
                "--compile",
                "off",
                "--json",
            ],
        ).stdout
    )
    assert off["settings"]["compiled"] is False and off["text"] == doc["text"]


@needs_compiler
def test_bench_times_eager_and_compiled_side_by_side(tiny):
    r = cli.invoke(
        app,
        [
            "bench",
            *pair_args(tiny),
            "--compile",
            "off,on",
            "--rules",
            "sps",
            "-k",
            "2",
            "-t",
            "0",
            "--limit",
            "2",
            "-n",
            "8",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["results"]
    assert [(row["config"], row["compiled"]) for row in rows] == [
        ("verifier alone · eager", False),
        ("sps k=2 · eager", False),
        ("verifier alone · compiled", True),
        ("sps k=2 · compiled", True),
    ]
    assert rows[1]["num_output_tokens"] == rows[3]["num_output_tokens"]
    assert rows[1]["acceptance_histogram"] == rows[3]["acceptance_histogram"]  # greedy: the same steps


def test_bad_compile_values_are_one_line_errors(tiny):
    for cmd in (["generate", "hi"], ["bench"]):
        r = cli.invoke(app, [*cmd, *pair_args(tiny), "--compile", "maybe"])
        assert r.exit_code == 2
        assert "--compile" in r.stderr and "auto, on, off" in r.stderr and "Traceback" not in r.output
