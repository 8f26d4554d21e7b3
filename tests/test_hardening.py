"""Issue 14: every bad input gets a one-line error (exit 2), Ctrl-C exits 130, and no finished
work is lost. One test (or parametrized case) per numbered item of the issue."""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cactus_cli.cli.main import app
from cactus_cli.core import fileio
from tests.test_cli import assert_one_line_error, pair_args

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def calibrate_args(tiny):
    return ["calibrate", *pair_args(tiny, "draft_close"), "--limit", "1", "-n", "6", "--delta", "0.5", "-k", "1,2"]


def bench_args(tiny):
    return ["bench", *pair_args(tiny, "draft_close"), "--limit", "1", "-n", "6", "--rules", "sps", "-k", "2"]


# 1. output paths are checked before the run; results are printed before they are written


@pytest.mark.parametrize("where,needle", [
    ("dir", "is a directory"),
    ("missing", "does not exist"),
    ("/proc/cactus-test.yaml", "cannot write in /proc"),
])
def test_calibrate_save_to_a_bad_place_fails_before_the_run(tiny, tmp_path, where, needle):
    target = {"dir": tmp_path, "missing": tmp_path / "no" / "such" / "x.yaml"}.get(where, where)
    r = invoke(*calibrate_args(tiny), "--save", target)
    assert_one_line_error(r, needle)
    assert not (tmp_path / "no").exists()


def test_bench_out_onto_a_file_and_csv_onto_a_folder_fail_before_the_run(tiny, tmp_path):
    existing = tmp_path / "results.txt"
    existing.write_text("keep me")
    assert_one_line_error(invoke(*bench_args(tiny), "--out", existing), "is a file, not a folder")
    assert existing.read_text() == "keep me"
    assert_one_line_error(invoke(*bench_args(tiny), "--csv", tmp_path), "is a directory")


def test_a_failed_write_after_the_run_keeps_the_printed_results(tiny, tmp_path, monkeypatch):
    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio, "atomic_write", full_disk)
    r = invoke(*bench_args(tiny), "--json", "--out", tmp_path / "out")
    assert r.exit_code == 2 and "Traceback" not in r.output
    doc = json.loads(r.stdout)  # the whole document was printed before the write failed
    assert doc["results"][0]["config"] == "verifier alone"
    assert r.stderr.strip().splitlines()[-1].startswith("error: --out: could not write")
    assert "No space left on device" in r.stderr


# 2. generate --json interrupted prints the partial result


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


# 3. chat: a block or a continued line cut off by the end of input is still a turn


@pytest.mark.parametrize("script,turns", [
    ('"""\nline one\nline two\n', ["line one\nline two"]),
    ("first \\\nsecond \\\n", ["first \nsecond "]),
    ("hello\n\"\"\"\n", ["hello"]),  # an empty unterminated block adds nothing
])
def test_chat_input_cut_off_at_the_end_keeps_the_turn(monkeypatch, script, turns):
    import io

    from cactus_cli.app.chat import read_turns

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(script.encode())))
    assert list(read_turns(False)) == turns


# 4. text that is not UTF-8


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
    assert_one_line_error(invoke("generate", "hi", "--profile", profile), f"{profile}:2:17: the profile is not valid UTF-8")
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    assert_one_line_error(invoke(*bench_args(tiny), "--prompts", prompts), f"{prompts}:2:")


# 5. a truncated GGUF


def test_truncated_gguf_is_a_one_line_error(tmp_path, tiny):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 10, 5) + b"\x05\x00")  # valid header start, then nothing
    assert_one_line_error(invoke("models", "prepare", gguf), "not a readable GGUF file")
    assert_one_line_error(invoke("generate", "hi", "--verifier", gguf, "--tokenizer", tiny["verifier"],
                                 "--draft", "none", "--device", "cpu"), "not a readable GGUF file")


# 6, 9, 11, 12: values checked before anything loads


@pytest.mark.parametrize("flag,value,needle", [
    ("--seed", 2**64, "--seed must be an integer in 0..2^63-1"),
    ("--seed", -1, "--seed must be an integer in 0..2^63-1"),
    ("--device", "cuda:abc", "cuda:N (N a GPU index)"),
    ("--temperature", 1e-38, "--temperature must be 0 (greedy) or a number in 0.001..1e4"),
    ("--delta", 1e39, "--delta must be a number in 0..1e+06"),
])
def test_out_of_range_values(tiny, flag, value, needle):
    assert_one_line_error(invoke("generate", "hi", *pair_args(tiny), flag, value), needle)


def test_non_finite_probabilities_are_an_error_not_garbage(tiny):
    from cactus_cli.core.errors import ModelError
    from cactus_cli.core.sampling import SamplingParams
    from cactus_cli.infer.engine import GenerationParams, SpeculativeEngine
    from cactus_cli.infer.models import load_pair

    pair = load_pair(tiny["verifier"], None, None, "cpu", "float32")
    params = GenerationParams(sampling=SamplingParams(1e-38, 0, 1.0), num_draft_tokens=0, max_tokens=4)
    with pytest.raises(ModelError, match="non-finite"):
        list(SpeculativeEngine(pair).generate(pair.tokenizer("the cat")["input_ids"], params))


# 7. stdin closed or empty


def test_generate_dash_with_stdin_closed_or_empty(tiny):
    args = [sys.executable, "-m", "cactus_cli", "generate", "-", *pair_args(tiny)]
    closed = subprocess.run(args, capture_output=True, text=True, preexec_fn=lambda: os.close(0), timeout=120)
    assert closed.returncode == 2 and "Traceback" not in closed.stderr, closed.stderr
    assert "stdin is closed" in closed.stderr
    empty = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert empty.returncode == 2 and "stdin was empty" in empty.stderr, empty.stderr


# 8. calibrate validates everything before loading (a missing verifier would fail the load)


@pytest.mark.parametrize("args,needle", [
    (["--delta", "0.5,nan"], "--delta: each value must be a number in 0..1e+06"),
    (["--rule", "sps"], "calibrate tunes delta"),
])
def test_calibrate_validates_before_loading(tmp_path, args, needle):
    r = invoke("calibrate", "--verifier", tmp_path / "missing", "--draft", tmp_path / "missing2", *args)
    assert_one_line_error(r, needle)


# 10. --tokenizer cannot bypass the shared-vocabulary check


def test_tokenizer_from_another_model_is_rejected(tiny):
    r = invoke("generate", "hi", *pair_args(tiny), "--tokenizer", tiny["odd_vocab"])
    assert_one_line_error(r, "do not share a vocabulary")


# 13. chat /set follows the same rules as the flags


def test_chat_set_delta_under_sps_is_rejected(tiny):
    r = invoke("chat", *pair_args(tiny), "--rule", "sps", "-n", 4, input="/set delta=0.5\n/set k=auto\n/set\n/exit\n")
    assert r.exit_code == 0
    assert "error: /set delta: has no effect with rule 'sps'" in r.stderr
    assert "k = auto (from the next turn)" in r.stdout


# 14. one malformed user profile does not hide the others


def test_profiles_list_flags_a_bad_profile_and_lists_the_rest(isolated_home):
    folder = isolated_home / "profiles"
    folder.mkdir(parents=True)
    (folder / "broken.yaml").write_text("rule: [unclosed\n")
    (folder / "fine.yaml").write_text("rule: sps\n")
    r = invoke("profiles", "list")
    assert r.exit_code == 0
    assert "fine" in r.stdout and "default" in r.stdout and "broken" in r.stdout
    assert "invalid profile:" in r.stderr and "broken.yaml" in r.stderr


# 15. messages that say what is wrong


def test_clear_messages(tiny, tmp_path, monkeypatch):
    assert_one_line_error(invoke("generate", "hi", "--profile", tmp_path), "is a directory")
    assert_one_line_error(invoke(*bench_args(tiny), "--prompts", tmp_path), "is a directory; give a JSONL file")
    assert_one_line_error(invoke("generate", "hi", *pair_args(tiny), "--param", "nonsense=1"),
                          "--param has unknown parameter 'nonsense'")
    empty = tmp_path / "empty_model"
    empty.mkdir()
    r = invoke("generate", "hi", "--verifier", empty, "--draft", "none", "--device", "cpu")
    assert_one_line_error(r, f"{empty} is a folder but not a model folder (it has no config.json)")
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text('{"prompt": "the cat"}\n{"id": "big", "prompt": "' + "the cat sat " * 10 + '"}\n')
    r = invoke("bench", "--verifier", tiny["short_context"], "--draft", tiny["short_context"], "--device", "cpu",
               "--prompts", long_prompt, "--no-chat-template", "-k", 2, "-n", 2)
    assert_one_line_error(r, f"{long_prompt}:2: prompt 'big' is")


# 16. atomic_write keeps the umask's mode and does not create folders


def test_atomic_write_mode_and_no_parent_creation(tmp_path, tiny):
    path = fileio.atomic_write(tmp_path / "x.txt", "hi")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    with pytest.raises(FileNotFoundError):
        fileio.atomic_write(tmp_path / "new" / "x.txt", "hi")
    assert not (tmp_path / "new").exists()
    r = invoke("chat", *pair_args(tiny), "-n", 2, input=f"/save {tmp_path}/nope/dir/x.json\n/exit\n")
    assert "folder" in r.stderr and "does not exist" in r.stderr
    assert not (tmp_path / "nope").exists()


# 18. an unknown hub id or a mistyped path fails at once, naming both readings


def test_unknown_hub_id_and_mistyped_path_fail_fast(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    r = invoke("generate", "hi", "--verifier", "no-such-org/no-such-model", "--draft", "none")
    assert_one_line_error(r, "no Hugging Face model no-such-org/no-such-model in the local cache")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "verifier").mkdir()
    monkeypatch.chdir(tmp_path)
    r = invoke("generate", "hi", "--verifier", "tiny/verifer", "--draft", "none")
    assert_one_line_error(r, "no folder tiny/verifer (in tiny/: verifier)")
