"""The CLI through Typer's CliRunner: --json, profile precedence, one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from cactus_cli import __version__
from cactus_cli.core import fileio
from tests.helpers import assert_one_line_error, bench_args, invoke, pair_args

runner = CliRunner()


def test_version_and_help():
    assert invoke("--version").output.strip() == f"cactus {__version__}"
    out = invoke("--help").output
    assert "generate" in out and "profiles" in out
    gen_help = invoke("generate", "--help").output
    for flag in (
        "--profile",
        "--verifier",
        "--draft",
        "--rule",
        "--delta",
        "--num-draft-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--max-tokens",
        "--seed",
        "--device",
        "--dtype",
        "--chat-template",
        "--json",
    ):
        assert flag in gen_help, flag


def test_help_does_not_import_torch():
    code = "import sys; from cactus_cli.cli.main import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_generate_json(tiny):
    r = invoke(
        "generate",
        "the cat sat",
        *pair_args(tiny, "draft_close"),
        "-n",
        12,
        "--seed",
        3,
        "-k",
        3,
        "--rule",
        "cactus",
        "--delta",
        0.5,
        "--json",
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["settings"]["rule"] == "cactus" and doc["settings"]["rule_params"]["delta"] == 0.5
    assert doc["settings"]["num_draft_tokens"] == 3 and doc["settings"]["seed"] == 3
    stats = doc["stats"]
    assert stats["num_output_tokens"] == 12 or stats["finish_reason"] in ("eos", "stop")
    for key in (
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "draft_acceptance_rate",
        "mean_acceptance_length",
        "acceptance_histogram",
        "per_position_acceptance_rate",
        "tokens_per_second",
        "verifier_forward_passes",
        "draft_forward_passes",
        "time_to_first_token",
    ):
        assert key in stats, key
    assert len(stats["acceptance_histogram"]) == 4
    assert isinstance(doc["text"], str) and doc["text"]


def test_generate_auto_k_reports_the_cost_model(tiny):
    r = invoke(
        "generate",
        "the cat sat",
        *pair_args(tiny, "draft_close"),
        "-n",
        12,
        "--seed",
        3,
        "-k",
        "auto",
        "--max-draft-tokens",
        5,
        "--json",
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["settings"]["num_draft_tokens"] == "auto" and doc["settings"]["max_draft_tokens"] == 5
    cm = doc["cost_model"]
    assert cm["adaptive_k"] and cm["source"] == "probe+online" and cm["draft_seconds_per_token"] > 0
    assert set(cm["verify_seconds_by_width"]) == {str(w) for w in range(1, 7)}
    assert sum(doc["stats"]["k_histogram"]) == doc["stats"]["num_drafts"] + doc["stats"]["k_histogram"][0]
    assert invoke("generate", "hi", *pair_args(tiny), "-k", "3", "--max-draft-tokens", 5).exit_code == 2


def test_generate_plain_is_reproducible_and_reads_stdin(tiny):
    # a fixed k: with -k auto the text also depends on the k each step chose (from timings)
    args = ["generate", "-", *pair_args(tiny), "-n", 10, "--seed", 7, "-k", 3]
    a = invoke(*args, input="the dog ran")
    b = invoke("generate", "the dog ran", *pair_args(tiny), "-n", 10, "--seed", 7, "-k", 3, "--plain")
    assert a.exit_code == 0 and a.output == b.output and a.output.strip()


def test_profile_precedence(tiny, tmp_path):
    # defaults < profile < flags: the profile sets rule and k; a flag overrides k only
    profile = tmp_path / "mine.yaml"
    profile.write_text(
        textwrap.dedent(f"""
        verifier: {tiny["verifier"]}
        draft: {tiny["draft"]}
        rule: cactus-exact
        rule_params: {{divergence: chi2}}
        num_draft_tokens: 5
        max_tokens: 8
        dtype: float32
    """)
    )
    doc = json.loads(invoke("generate", "hi", "--profile", profile, "-k", 2, "--json", "--seed", 1).output)
    s = doc["settings"]
    assert (s["rule"], s["rule_params"], s["num_draft_tokens"], s["max_tokens"]) == (
        "cactus-exact",
        {"divergence": "chi2"},
        2,
        8,
    )
    assert s["temperature"] == 0.6  # built-in default, untouched by either


def test_user_profile_by_name(tiny, isolated_home):
    folder = isolated_home / "profiles"
    folder.mkdir(parents=True)
    (folder / "tiny.yaml").write_text(f"verifier: {tiny['verifier']}\ndraft: {tiny['draft']}\nmax_tokens: 5\n")
    r = invoke("generate", "hi", "--profile", "tiny", "--json", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["settings"]["max_tokens"] == 5
    listing = invoke("profiles", "list")
    assert "tiny" in listing.output and "user" in listing.output and "qwen3-14b" in listing.output
    shown = invoke("profiles", "show", "tiny")
    assert "max_tokens: 5" in shown.output


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--profile", "nope"], "unknown profile 'nope'"),
        (["--delta", "-1"], "--delta must be a number in 0..1e+06"),
        (["-k", "0"], "--num-draft-tokens must be an integer in 1..64"),
        (["--rule", "magic"], "--rule must be one of sps, cactus"),
        (["--rule", "sps", "--delta", "0.5"], "--delta has no effect with rule 'sps'"),
        (
            ["--param", "topk=3"],
            "--param topk has no effect with rule 'sps' (it takes: no parameters); use --rule topk",
        ),
        (["--param", "nonsense"], "expected KEY=VALUE"),
        (["--rule", "interp", "--param", "alpha=2"], "parameter 'alpha' must be a number in [0, 1]"),
        (["--top-p", "0"], "--top-p must be a number in (0, 1]"),
        (["--dtype", "int8"], "--dtype must be one of"),
    ],
)
def test_bad_inputs_are_one_line_errors(tiny, extra, needle):
    assert_one_line_error(invoke("generate", "hi", *pair_args(tiny), *extra), needle)


def test_cross_vocab_flag_errors(tiny):
    # (a draft with another vocabulary drafts across vocabularies: tests/test_cross_vocab.py)
    assert_one_line_error(
        invoke("generate", "hi", *pair_args(tiny), "--cross-vocab", "string"), "shares the verifier's vocabulary"
    )
    assert_one_line_error(
        invoke("generate", "hi", *pair_args(tiny, "odd_vocab"), "--cross-vocab", "letters"),
        "must be one of auto, string, intersection",
    )
    assert_one_line_error(
        invoke("generate", "hi", *pair_args(tiny, "odd_vocab"), "--cross-vocab", "string,intersection"),
        "got 'string,intersection' (a comma list is for bench and eval",
    )
    assert_one_line_error(
        invoke("generate", "hi", *pair_args(tiny), "--quantize", "w8a8,int4"),
        "got 'w8a8,int4' (a comma list is for bench and eval",
    )
    assert_one_line_error(
        invoke("generate", "hi", "--verifier", tiny["verifier"], "--draft", "none", "--cross-vocab", "string"),
        "--cross-vocab applies to a draft model",
    )


def test_missing_model_one_line_error(tmp_path):
    r = invoke("generate", "hi", "--verifier", tmp_path / "absent", "--draft", "none")
    assert_one_line_error(r, "does not exist")


def test_bad_profile_file_names_file_line_and_key(tiny, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"verifier: {tiny['verifier']}\nrule: cactus\ndleta: 0.3\n")
    assert_one_line_error(invoke("generate", "hi", "--profile", bad), f"{bad}:3: unknown key 'dleta'")
    bad.write_text("num_draft_tokens: four\n")
    assert_one_line_error(invoke("generate", "hi", "--profile", bad), f"{bad}:1: num_draft_tokens must be an integer")
    bad.write_text("rule: [unclosed\n")
    assert_one_line_error(invoke("generate", "hi", "--profile", bad), "not valid YAML")


def test_empty_prompt_and_missing_template(tiny):
    assert_one_line_error(invoke("generate", "  ", *pair_args(tiny)), "the prompt is empty")


def test_installed_entry_point_exits_2_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "cactus_cli", "generate", "hi", "--verifier", str(tmp_path / "x")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error: ")


def test_generate_json_interrupted_prints_what_it_has(tiny, monkeypatch):
    from cactus_cli.cli import ui

    calls = {"n": 0}
    real = ui.QuietView.update

    def update(self, ev):
        real(self, ev)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(ui.QuietView, "update", update)
    r = invoke("generate", "the cat", *pair_args(tiny, "draft_close"), "-n", 30, "-k", 2, "--seed", 1, "--json")
    assert r.exit_code == 130
    doc = json.loads(r.stdout)
    assert doc["interrupted"] is True and doc["text"] and doc["stats"]["num_output_tokens"] >= 2


def test_non_utf8_stdin_argument_and_chat_line_are_replaced_with_one_warning(tiny, monkeypatch):
    monkeypatch.setattr(fileio, "_warned", False)
    r = invoke("generate", "-", *pair_args(tiny), "-n", 4, "-k", 2, input=b"\xff\xfe the cat")
    assert r.exit_code == 0, r.output
    assert r.stderr.count("not valid UTF-8") == 1
    monkeypatch.setattr(fileio, "_warned", False)
    r = invoke("generate", "caf\udce9 the dog", *pair_args(tiny), "-n", 4, "-k", 2)  # argv as Python decodes it
    assert r.exit_code == 0, r.output and "not valid UTF-8" in r.stderr
    monkeypatch.setattr(fileio, "_warned", False)
    r = invoke("chat", *pair_args(tiny), "-n", 4, "-k", 2, input=b"the \xe9 cat\nthe dog\n/exit\n")
    assert r.exit_code == 0, r.output
    assert r.stderr.count("not valid UTF-8") == 1 and "Traceback" not in r.output


def test_non_utf8_files_are_errors_naming_file_and_line(tiny, tmp_path):
    profile = tmp_path / "bad.yaml"
    profile.write_bytes(b"rule: cactus\ndescription: caf\xe9\n")
    assert_one_line_error(
        invoke("generate", "hi", "--profile", profile), f"{profile}:2:17: the profile is not valid UTF-8"
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    assert_one_line_error(invoke(*bench_args(tiny), "--prompts", prompts), f"{prompts}:2:")


def test_generate_dash_with_stdin_closed_or_empty(tiny):
    args = [sys.executable, "-m", "cactus_cli", "generate", "-", *pair_args(tiny)]
    closed = subprocess.run(args, capture_output=True, text=True, preexec_fn=lambda: os.close(0), timeout=120)
    assert closed.returncode == 2 and "Traceback" not in closed.stderr, closed.stderr
    assert "stdin is closed" in closed.stderr
    empty = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert empty.returncode == 2 and "stdin was empty" in empty.stderr, empty.stderr


def test_typer_usage_errors_are_one_line_from_the_entry_point(monkeypatch, capsys):
    """An unknown option or a value Typer's own types refuse: one line and exit 2 from `cactus`
    itself (Typer draws a boxed panel and a usage block; CliRunner does not run the entry point)."""
    from cactus_cli.cli.main import main

    for args, needle in (
        (["eval", "--samples", "abc"], "Invalid value for '--samples'"),
        (["generate", "x", "--bogus"], "No such option: --bogus"),
        (["serve", "--port", "70000"], "less than or equal to 65535"),
        (["serve", "--max-queue", "0"], "greater than or equal to 1"),
    ):
        monkeypatch.setattr(sys, "argv", ["cactus", *args])
        with pytest.raises(SystemExit) as exit_:
            main()
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
        assert needle in lines[0] and lines[0].endswith("cactus " + args[0] + " -h for help)"), lines[0]
    monkeypatch.setattr(sys, "argv", ["cactus", "--version"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("cactus ")


def test_clear_messages(tiny, tmp_path, monkeypatch):
    assert_one_line_error(invoke("generate", "hi", "--profile", tmp_path), "is a directory")
    assert_one_line_error(invoke("generate", "hi", "--profile", "/dev/zero"), "not a regular file")
    assert_one_line_error(invoke(*bench_args(tiny), "--prompts", tmp_path), "is a directory; give a JSONL file")
    assert_one_line_error(
        invoke("generate", "hi", *pair_args(tiny), "--param", "nonsense=1"), "--param has unknown parameter 'nonsense'"
    )
    empty = tmp_path / "empty_model"
    empty.mkdir()
    r = invoke("generate", "hi", "--verifier", empty, "--draft", "none", "--device", "cpu")
    assert_one_line_error(r, f"{empty} is a folder but not a model folder (it has no config.json)")
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text('{"prompt": "the cat"}\n{"id": "big", "prompt": "' + "the cat sat " * 10 + '"}\n')
    r = invoke(
        "bench",
        "--verifier",
        tiny["short_context"],
        "--draft",
        tiny["short_context"],
        "--device",
        "cpu",
        "--prompts",
        long_prompt,
        "--no-chat-template",
        "-k",
        2,
        "-n",
        2,
    )
    assert_one_line_error(r, f"{long_prompt}:2: prompt 'big' is")


@pytest.mark.parametrize("tty", [True, False])
def test_plain_text_escapes_control_characters_on_a_terminal_only(tty):
    import io
    from types import SimpleNamespace

    from cactus_cli.cli.ui import PlainView

    class Out(io.StringIO):
        def isatty(self):
            return tty

    out = Out()
    view = PlainView(out=out)
    view.stats = SimpleNamespace(update=lambda ev: None, num_output_tokens=0)
    text = "a\x1b]0;owned\x07\rb\tc\n\x9bd"
    view.update(SimpleNamespace(text=text))
    assert out.getvalue() == (r"a\x1b]0;owned\x07\x0db" + "\tc\n" + r"\x9bd" if tty else text)
