"""`cactus chat` driven by scripted input: turns, slash commands, cache reuse, Ctrl-C."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cactus_cli.app.runtime import encode
from cactus_cli.cli.main import app
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.pair.loader import load_pair
from tests.helpers import invoke, pair_args

runner = CliRunner()


def chat(tiny, script: str, *extra, draft="draft_close"):
    args = [
        "chat",
        "--verifier",
        tiny["verifier"],
        "--draft",
        tiny[draft],
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "-n",
        "10",
        "--seed",
        "1",
        *[str(e) for e in extra],
    ]
    return runner.invoke(app, args, input=script)


def test_multi_turn_and_every_slash_command(tiny, tmp_path):
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    script = (
        "\n".join(
            [
                "/help",
                "the cat sat",
                "/set k=2",
                "/set temperature=0",
                "/set",
                "the dog ran",
                "/stats",
                f"/save {md}",
                f"/save {js}",
                "/reset",
                "one two",
                "/profile default",
                "/nonsense",
                "/exit",
                "never read",
            ]
        )
        + "\n"
    )
    r = chat(tiny, script)
    assert r.exit_code == 0, r.output
    out = r.output
    assert "/set KEY=VALUE" in out  # /help
    assert "k = 2 (from the next turn)" in out and "temperature=0" in out
    assert "num_accepted_tokens" in out and "prefill_tokens_saved" in out  # /stats
    assert "conversation cleared" in out
    assert "profile default: rule=sps" in out  # models are kept: flags override the profile's
    assert "unknown command /nonsense" in out
    doc = json.loads(js.read_text())
    assert [t["user"] for t in doc["turns"]] == ["the cat sat", "the dog ran"]
    assert doc["settings"]["num_draft_tokens"] == 2 and doc["settings"]["temperature"] == 0
    assert "## user\n\nthe dog ran" in md.read_text()
    assert "never read" not in out


@pytest.mark.parametrize(
    "line,needle",
    [
        ("/set k=0", "/set k: must be an integer in 1..64"),
        ("/set delta=-1", "/set delta: must be a number in 0..1e+06"),
        ("/set rule=magic", "/set rule: must be one of"),
        ("/set top_p=2", "/set top_p: must be a number in (0, 1]"),
        ("/set colour=red", "/set expects KEY=VALUE"),
        ("/save", "/save needs a path"),
        ("/profile nope", "unknown profile 'nope'"),
    ],
)
def test_invalid_commands_explain_and_the_session_goes_on(tiny, line, needle):
    r = chat(tiny, f"{line}\nthe cat sat\n/stats\n")
    assert r.exit_code == 0, r.output
    assert needle in r.output
    assert "turns                          1" in r.output  # the next turn still ran


def test_second_turn_reuses_the_whole_first_turn(tiny, tmp_path):
    js = tmp_path / "t.json"
    r = chat(tiny, f"the cat sat\nthe dog ran on the mat\n/save {js}\n/stats\n", "--temperature", "0")
    assert r.exit_code == 0, r.output
    t1, t2 = (t["stats"] for t in json.loads(js.read_text())["turns"])
    assert t1["reused_prefix_tokens"] == 0 and t1["prefill_tokens"] == t1["prompt_tokens"] - 1
    # turn 2's prompt (the whole history) is served from the cache up to where the re-rendered
    # reply diverges from the generated tokens; only the rest is encoded
    assert t2["reused_prefix_tokens"] >= t1["prompt_tokens"]
    assert t2["prefill_tokens"] == t2["prompt_tokens"] - 1 - t2["reused_prefix_tokens"]
    assert t2["prefill_tokens"] < t2["prompt_tokens"] - t1["prompt_tokens"]
    assert f"prefill_tokens_saved           {t2['reused_prefix_tokens']}" in r.output


def test_prefill_on_turn_two_is_exactly_the_new_tokens(tiny):
    pair = load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32")
    engine = SpeculativeEngine(pair)
    params = GenerationParams(sampling=SamplingParams(0.0, 0, 1.0), num_draft_tokens=3, max_tokens=12)
    ids1 = encode(pair.tokenizer, "the cat sat", None)
    reply = [t for ev in engine.generate(ids1, params) for t in ev.emitted]
    new = pair.tokenizer(" </s> <s> user the dog ran </s> <s> assistant")["input_ids"]
    ids2 = ids1 + reply + new
    first = next(iter(engine.generate(ids2, params, reuse_cache=True)))
    assert first.reused_tokens + first.prefill_tokens == len(ids2) - 1
    # everything of turn 1 that the cache holds is reused: the prefill is the new turn (the cache
    # may also hold the verified token after a max_tokens cut, which saves one more)
    assert first.prefill_tokens in (len(new), len(new) - 1)


def test_cache_reuse_gives_the_same_reply_as_a_fresh_prefill(tiny):
    pair = load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32")
    params = GenerationParams(sampling=SamplingParams(0.0, 0, 1.0), num_draft_tokens=3, max_tokens=15)
    engine = SpeculativeEngine(pair)
    msgs = [{"role": "user", "content": "the cat sat"}]
    first = [t for ev in engine.generate(encode(pair.tokenizer, msgs, None), params) for t in ev.emitted]
    msgs += [
        {"role": "assistant", "content": pair.tokenizer.decode(first, skip_special_tokens=True)},
        {"role": "user", "content": "the dog ran"},
    ]
    ids2 = encode(pair.tokenizer, msgs, None)
    reused = [t for ev in engine.generate(ids2, params, reuse_cache=True) for t in ev.emitted]
    assert engine.cache_lengths()["verifier"] == engine.cache_lengths()["sequence"] - 1
    fresh = [t for ev in SpeculativeEngine(pair).generate(ids2, params) for t in ev.emitted]
    assert reused == fresh


def test_interrupt_inside_a_step_drops_the_caches_and_recovers(tiny):
    pair = load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32")
    params = GenerationParams(sampling=SamplingParams(0.0, 0, 1.0), num_draft_tokens=3, max_tokens=20)
    ids = pair.tokenizer("the cat sat")["input_ids"]
    engine = SpeculativeEngine(pair)
    expected = [t for ev in engine.generate(ids, params) for t in ev.emitted]
    slot = engine.slots[0]
    real, calls = slot.verifier.forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    slot.verifier.forward = flaky
    with pytest.raises(KeyboardInterrupt):
        for _ in engine.generate(ids, params, reuse_cache=True):
            pass
    assert slot.tokens == [] and slot.verifier.cache is None  # rolled back to a clean state
    slot.verifier.forward = real
    assert [t for ev in engine.generate(ids, params, reuse_cache=True) for t in ev.emitted] == expected


def test_ctrl_c_during_a_reply_keeps_the_partial_reply(tiny, tmp_path, monkeypatch):
    real = SpeculativeEngine.events
    state = {"turn": 0}

    def interrupted_first_turn(self, *args, **kwargs):
        state["turn"] += 1
        for i, ev in enumerate(real(self, *args, **kwargs)):
            if state["turn"] == 1 and i == 1:
                raise KeyboardInterrupt
            yield ev

    monkeypatch.setattr(SpeculativeEngine, "events", interrupted_first_turn)
    js = tmp_path / "t.json"
    r = chat(tiny, f"the cat sat\nthe dog ran\n/save {js}\n")
    assert r.exit_code == 0, r.output
    assert "reply interrupted" in r.output
    turns = json.loads(js.read_text())["turns"]
    assert turns[0]["interrupted"] is True and turns[0]["reply"]  # partial, kept
    assert turns[1]["interrupted"] is False and turns[1]["reply"]


def test_context_overflow_explains_and_suggests_reset(tiny):
    args = ["chat", "--verifier", tiny["short_context"], "--draft", tiny["draft"], "--device", "cpu", "-n", "4"]
    r = runner.invoke(app, args, input="the cat sat on the mat and then it was very happy and sad\n/reset\none\n")
    assert r.exit_code == 0, r.output
    assert "context window is 16" in r.output and "/reset" in r.output


def test_piped_subprocess(tiny):
    cmd = [
        sys.executable,
        "-m",
        "cactus_cli",
        "chat",
        "--verifier",
        tiny["verifier"],
        "--draft",
        tiny["draft"],
        "--device",
        "cpu",
        "-n",
        "6",
        "--seed",
        "3",
    ]
    proc = subprocess.run(cmd, input="hi\n/stats\n/exit\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].strip() and "num_output_tokens" in proc.stdout and "turns" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "script,turns",
    [
        ('"""\nline one\nline two\n', ["line one\nline two"]),
        ("first \\\nsecond \\\n", ["first \nsecond "]),
        ('hello\n"""\n', ["hello"]),  # an empty unterminated block adds nothing
    ],
)
def test_chat_input_cut_off_at_the_end_keeps_the_turn(monkeypatch, script, turns):
    import io

    from cactus_cli.app.conversation import read_turns

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(script.encode())))
    assert list(read_turns(False)) == turns


def test_chat_set_delta_under_sps_is_rejected(tiny):
    r = invoke("chat", *pair_args(tiny), "--rule", "sps", "-n", 4, input="/set delta=0.5\n/set k=auto\n/set\n/exit\n")
    assert r.exit_code == 0
    assert "error: /set delta: has no effect with rule 'sps'" in r.stderr
    assert "k = auto (from the next turn)" in r.stdout


def test_chat_set_max_draft_tokens_with_a_fixed_k(tiny):
    from tests.test_chat import chat

    r = chat(tiny, "/set max_draft_tokens=5\n", "-k", "2")
    assert "applies only with -k auto" in r.output


def test_chat_keeps_no_typed_history_unless_asked_and_then_only_for_the_user(tmp_path, monkeypatch, isolated_home):
    import builtins

    from cactus_cli.app.conversation import read_turns

    def typed(lines):
        feed = iter(lines)

        def fake_input(prompt=""):
            try:
                return next(feed)
            except StopIteration:
                raise EOFError from None

        monkeypatch.setattr(builtins, "input", fake_input)

    typed(["my password is hunter2"])
    assert list(read_turns(True)) == ["my password is hunter2"]
    assert not isolated_home.exists() or not any(p.is_file() for p in isolated_home.rglob("*"))  # nothing on disk
    asked = tmp_path / "chat.history"
    typed(["keep this"])
    assert list(read_turns(True, history_file=asked)) == ["keep this"]
    assert asked.is_file() and stat.S_IMODE(asked.stat().st_mode) == 0o600


def test_the_chat_command_passes_no_history_file_by_default(tiny, monkeypatch):
    from cactus_cli.app import conversation as chat
    from tests.helpers import invoke

    seen = []
    real = chat.read_turns
    monkeypatch.setattr(chat, "read_turns", lambda *a, **kw: (seen.append(kw.get("history_file")), real(*a, **kw))[1])
    args = ["chat", "--verifier", tiny["verifier"], "--draft", "none", "--device", "cpu", "-n", "2"]
    assert invoke(*args, input="hi\n").exit_code == 0
    assert seen == [None]
