"""The third hardening sweep (issue 41): each test names its cause and fails before its fix."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from cactus_cli.core import fileio
from cactus_cli.core.errors import ConfigError
from tests.helpers import ctrl_c_as_in_a_terminal
from tests.test_embedded import fake_model  # noqa: F401 (a fixture: fake embedded parts)


@pytest.fixture
def fake_model_cache(fake_model):  # noqa: F811
    return fake_model[0]


def test_3_a_symlink_is_written_through_to_its_target(tmp_path):
    target = tmp_path / "results.csv"
    target.write_text("old\n")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    fileio.check_output_file(link, "--csv")
    fileio.atomic_write(link, "new\n")
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert target.read_text() == "new\n"


def test_3_a_read_only_file_is_refused_before_the_run_and_never_replaced(tmp_path):
    kept = tmp_path / "kept.yaml"
    kept.write_text("mine\n")
    kept.chmod(0o444)
    with pytest.raises(ConfigError, match="read-only"):
        fileio.check_output_file(kept, "--save")
    with pytest.raises(PermissionError):
        fileio.atomic_write(kept, "theirs\n")  # (as root too: the kernel would let root write)
    assert kept.read_text() == "mine\n" and stat.S_IMODE(kept.stat().st_mode) == 0o444


def test_3_a_fifo_is_written_in_place_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, encoding="utf-8").read()))
    reader.start()
    fileio.check_output_file(fifo, "--csv")
    fileio.atomic_write(fifo, "a,b\n1,2\n")
    reader.join(timeout=10)
    assert got == ["a,b\n1,2\n"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]  # no temp file left beside it


def test_4_a_folder_matching_the_stale_cache_glob_is_left_alone(tmp_path):
    from cactus_cli.infer.quant.quantize import _remove_stale

    (tmp_path / "w8a8-model-oldkey.safetensors").mkdir()
    (tmp_path / "w8a8-model-older.safetensors").write_bytes(b"x")
    _remove_stale(tmp_path / "w8a8-model-newkey.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w8a8-model-oldkey.safetensors"]


def test_5_a_deeply_nested_jsonl_line_is_one_line_naming_file_and_line(tmp_path):
    from cactus_cli.app.prompts import read_jsonl

    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "fine"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=rf"{f}:2: nested too deeply"):
        read_jsonl(str(f), "--prompts", "prompts")


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_9_cross_vocab_with_a_draft_that_has_no_model_is_an_error(tiny, lookup):
    from tests.helpers import assert_one_line_error, invoke

    args = ["--verifier", tiny["verifier"], "--draft", lookup, "--device", "cpu", "--dtype", "float32"]
    assert_one_line_error(
        invoke("generate", "hi", *args, "--cross-vocab", "intersection", "-n", "2"), f"--draft {lookup} has no model"
    )


@pytest.mark.parametrize("tty", [True, False])
def test_15_plain_text_escapes_control_characters_on_a_terminal_only(tty):
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


def test_12_numbers_in_e_notation_are_read_as_numbers_everywhere_yaml_is(tiny):
    from cactus_cli.app.settings import parse_params, parse_yaml

    assert parse_params(["epsilon=1e-3", "scale=2E+2"]) == {"epsilon": 0.001, "scale": 200.0}
    assert parse_yaml("delta: 5e-1\nname: 1e3x\n", "profile.yaml") == {"delta": 0.5, "name": "1e3x"}


def _temp_files(folder):
    return sorted(p.name for p in folder.glob(".*.tmp")) if folder.is_dir() else []


def test_1_an_interrupted_first_quantization_removes_its_partial_cache(tiny, monkeypatch):
    from cactus_cli.infer.quant import quantize
    from tests.helpers import quantize_tiny

    folder = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8").parent
    real, calls = quantize.quantize_int8, []

    def interrupted(w):
        calls.append(1)
        if len(calls) == 3:  # a few layers in: the partial file exists
            assert _temp_files(folder)
            raise KeyboardInterrupt
        return real(w)

    monkeypatch.setattr(quantize, "quantize_int8", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_tiny(tiny)
    assert _temp_files(folder) == [] and not list(folder.glob("*.safetensors"))


SIGTERM_DURING_QUANTIZATION = """
import sys, time
from cactus_cli.core.signals import treat_sigterm_as_sigint
from cactus_cli.infer.quant import quantize
import torch
from transformers import AutoModelForCausalLM
treat_sigterm_as_sigint()
real, calls = quantize.quantize_int8, []
def slow(w):
    calls.append(1)
    if len(calls) == 2:
        print("writing", flush=True)
        time.sleep(60)
    return real(w)
quantize.quantize_int8 = slow
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
try:
    quantize.quantize_model(model, "int8", sys.argv[1])
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_1_sigterm_during_the_first_quantization_leaves_no_partial_cache(tiny, isolated_home):
    import signal
    import subprocess
    import sys

    from cactus_cli.infer.quant import quantize

    folder = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8").parent
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_DURING_QUANTIZATION, tiny["verifier"]],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, CACTUS_HOME=str(isolated_home)),
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert _temp_files(folder)  # the partial file is there while it writes
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
    assert _temp_files(folder) == []


def _remember(path, n, tag, barrier):
    from cactus_cli.infer.draft.suffix_tree import History

    h, _ = History.load(path, "vocab-A", 1000)
    barrier.wait(30)  # both runs have read the file before either writes
    for i in range(n):
        h.add([tag, i % 900 + 1, tag])


def test_2_runs_sharing_a_remember_file_merge_under_a_lock(tmp_path):
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


def test_2_a_chat_document_that_grows_is_kept_once(tmp_path):
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
def test_2_a_history_file_that_cannot_be_used_is_moved_aside_not_destroyed(tmp_path, content, why):
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


def test_2_a_device_as_the_remember_file_is_written_in_place_never_moved(tmp_path):
    from pathlib import Path

    from cactus_cli.infer.draft.suffix_tree import History

    h, warning = History.load(Path("/dev/null"), "vocab-A", 100)
    assert warning is None
    h.add([1, 2, 3])
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and not list(Path("/dev").glob("null.bad-*"))


def test_14_a_history_file_is_bounded_and_loaded_in_one_pass(tmp_path, monkeypatch):
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


def _broken(tmp_path, tiny, how):
    import json
    import shutil

    folder = tmp_path / how
    shutil.copytree(tiny["verifier"], folder)
    weights = folder / "model.safetensors"
    config = folder / "config.json"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "pickle":
        weights.unlink()
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 never unpickled")
    elif how == "not-json":
        config.write_text("{ not json")
    elif how == "unknown-architecture":
        doc = json.loads(config.read_text())
        config.write_text(json.dumps({**doc, "model_type": "foo", "architectures": ["FooForCausalLM"]}))
    elif how == "mistyped":
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": "big"}))
    return folder


@pytest.mark.parametrize(
    "how, needle",
    [
        ("truncated", "truncated or corrupt"),
        ("pickle", "pickle checkpoint (pytorch_model.bin)"),
        ("not-json", "config.json is not valid JSON"),
        ("unknown-architecture", "does not know (model_type 'foo'"),
        ("mistyped", "hidden_size"),
    ],
)
def test_6_a_model_folder_that_does_not_load_is_one_line_naming_it(tmp_path, tiny, how, needle):
    from tests.helpers import assert_one_line_error, invoke

    folder = _broken(tmp_path, tiny, how)
    r = invoke("generate", "hi", "--verifier", folder, "--draft", "ngram", "--device", "cpu", "-n", "2")
    assert_one_line_error(r, needle)
    assert str(folder) in r.output


def test_7_a_damaged_quantized_cache_is_said_in_a_line_that_stays(tiny):
    from cactus_cli.infer.quant import quantize
    from tests.helpers import invoke

    args = ["generate", "the cat", "--verifier", tiny["verifier"], "--draft", "none", "--device", "cpu"]
    args += ["--quantize", "int8", "-n", "2", "--plain"]
    assert invoke(*args).exit_code == 0
    path = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8")
    path.write_bytes(path.read_bytes()[:100])
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    assert f"warning: the quantized cache {path} is damaged (" in " ".join(r.stderr.split())


def test_7_every_rebuilt_cache_says_why(tiny, fake_model_cache, capsys):
    from cactus_cli.infer import devices, embedded
    from cactus_cli.infer.quant import quantize

    def said() -> str:
        return " ".join(capsys.readouterr().err.split())

    verdict = quantize.verdict_path(tiny["verifier"])
    assert quantize.quality_verdict(tiny["verifier"]) is None and said() == ""  # not measured yet: nothing to say
    verdict.parent.mkdir(parents=True, exist_ok=True)
    verdict.write_text('{"nll_delta": "x"}')
    assert quantize.quality_verdict(tiny["verifier"]) is None
    assert f"warning: the w8a8 quality verdict {verdict} is unreadable; measuring" in said()

    devices._timed_once("t-", [1], ("a",), lambda name: 0.5)
    assert said() == ""  # measured the first time
    (path,) = (devices.cache_path({}, "").parent).glob("t-*.json")
    path.write_text("not json")
    devices._timed_once("t-", [1], ("a",), lambda name: 0.5)
    assert f"warning: the timing cache {path} is unreadable; measuring again" in said()

    (embedded.models_dir() / "fake").mkdir(parents=True)  # a conversion that never finished
    embedded.prepare_embedded("fake")
    assert "fake is an incomplete conversion (no cactus-conversion.json); making it again" in said()
    (embedded.models_dir() / "fake.gguf").write_bytes(b"short")
    embedded.embedded_gguf("fake")
    assert f"fake.gguf is 5 bytes, not {fake_model_cache.size}; assembling it again" in said()


@pytest.mark.parametrize(
    "flag, value, said",
    [("-k", "2,2", "-k: 2 given"), ("--delta", "1,1.0", "--delta: 1.0 given"), ("--draft", "suffix,suffix", "suffix")],
)
def test_8_a_value_given_twice_runs_once_and_every_row_has_its_own_history(tiny, flag, value, said):
    import json

    from tests.helpers import invoke

    args = ["bench", "--verifier", tiny["verifier"], "--draft", "suffix", "--device", "cpu", "--dtype", "float32"]
    args += ["--rules", "cactus", "-k", "2", "--delta", "1", "--limit", "2", "-n", "6", "--json", flag, value]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    assert said in r.stderr and "given more than once; each runs once" in r.stderr
    rows = json.loads(r.stdout)["results"]
    assert [row["config"] for row in rows] == ["verifier alone", "cactus δ=1 k=2"]  # one row, not two


def test_8_twin_rows_never_share_a_drafters_memory():
    from cactus_cli.app.grid import build_grid

    grid = build_grid(["sps", "sps"], [1.0], [2, 2], {}, False, variants=[("torch", "none", False, "suffix", "")])
    assert [c.label for c in grid] == ["verifier alone", "sps k=2"]


@pytest.mark.parametrize("number", ["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    "command, flag",
    [
        ("calibrate", "--max-divergence"),
        ("calibrate", "--max-quality-drop"),
        ("calibrate", "--max-accuracy-drop"),
        ("bench", "--delta"),
        ("generate", "--param"),
        ("generate", "--top-p"),
    ],
)
def test_10_a_number_that_is_not_finite_is_refused_in_one_line(tiny, command, flag, number):
    from tests.helpers import assert_one_line_error, invoke

    value = f"epsilon={'.' + number.lstrip('-') if number != '-inf' else '-.inf'}" if flag == "--param" else number
    args = [command, *(["hi"] if command == "generate" else []), "--verifier", tiny["verifier"]]
    args += ["--draft", tiny["draft"], "--device", "cpu"]
    args += ["--rules", "cactus"] if command == "bench" else ["--rule", "tas" if flag == "--param" else "cactus"]
    if command == "calibrate" and flag == "--max-accuracy-drop":
        args += ["--tasks", "humaneval"]
    r = invoke(*args, flag, value)
    assert_one_line_error(r, "must be")
    assert "finite" in r.output or "in 0..100" in r.output or "in (0, 1]" in r.output


def test_10_a_profile_or_set_value_that_is_not_finite_is_refused():
    from cactus_cli.app.settings import check_layer, parse_yaml

    for text in ("delta: .nan\n", "top_p: .inf\n", "rule_params: {epsilon: .nan}\n"):
        with pytest.raises(ConfigError, match="finite number"):
            check_layer(parse_yaml(text, "p.yaml"), "p.yaml")


@pytest.mark.parametrize("plain, fast", [(10.0, 12.0), (12.0, 10.0)])
def test_11_calibrate_advice_follows_the_rows_it_prints(plain, fast):
    from cactus_cli.app import calibrate as cal
    from cactus_cli.app.grid import ConfigResult
    from cactus_cli.core.stats import SpecStats
    from cactus_cli.infer.costs import CostModel

    costs = CostModel()  # a steep verify: the model predicts that no k pays
    costs.add_draft(0.01)
    for w in range(1, 8):
        costs.add_verify(w, 0.1 * w)

    def result(tps, a=0.5):
        s = SpecStats()
        s.num_output_tokens, s.total_seconds = int(tps * 10), 10.0
        s.num_draft_tokens, s.num_accepted_tokens = 10, int(10 * a)
        return ConfigResult(None, s, {}, 1)

    def time_config(cfg, label):
        return result(plain if cfg.k == 0 else fast if cfg.k == 2 else fast - 1)

    c = cal.Calibration(rule="cactus", k0=2)
    cal._choose_k(c, costs, cal.DeltaPoint(1.0, result(fast)), [1, 2, 3], {"delta": 1.0}, 8, time_config)
    if fast > plain:  # the table shows k = 2 beating the verifier alone: that is the choice, no advice against it
        assert c.chosen_k == 2 and c.advice == ""
    else:
        assert c.chosen_k == "auto" and f"{plain:.2f} tok/s" in c.advice and f"{fast:.2f} tok/s" in c.advice


def test_13_prompt_files_split_on_newlines_only_keep_ids_and_read_fifos(tmp_path):
    import json
    import threading

    from cactus_cli.app.prompts import load_prompts
    from cactus_cli.app.tasks import load_tasks

    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "a\u2028b\u2029c\x85d", "id": 7}, {"prompt": "two", "id": "x"}, {"prompt": "three"}]
    f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8-sig")  # (a BOM)
    got = load_prompts(str(f), None)
    assert [p.id for p in got] == [7, "x", "p3"] and got[0].prompt == rows[0]["prompt"]
    for bad in (1.5, True, [1], None):
        f.write_text(json.dumps({"prompt": "p", "id": bad}) + "\n")
        with pytest.raises(ConfigError, match=rf"{f}:1: 'id' must be a string or an integer"):
            load_prompts(str(f), None)
    f.write_text(json.dumps({"prompt": "p", "answer": "1", "id": [2]}) + "\n")
    with pytest.raises(ConfigError, match="'id' must be"):
        load_tasks(str(f), None)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text('{"prompt": "from a pipe"}\n'))
    writer.start()
    assert [p.prompt for p in load_prompts(str(fifo), None)] == ["from a pipe"]
    writer.join(10)


def test_16_chat_keeps_no_typed_history_unless_asked_and_then_only_for_the_user(tmp_path, monkeypatch, isolated_home):
    import builtins

    from cactus_cli.app.chat import read_turns

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


def test_16_the_chat_command_passes_no_history_file_by_default(tiny, monkeypatch):
    from cactus_cli.app import chat
    from tests.helpers import invoke

    seen = []
    real = chat.read_turns
    monkeypatch.setattr(chat, "read_turns", lambda *a, **kw: (seen.append(kw.get("history_file")), real(*a, **kw))[1])
    args = ["chat", "--verifier", tiny["verifier"], "--draft", "none", "--device", "cpu", "-n", "2"]
    assert invoke(*args, input="hi\n").exit_code == 0
    assert seen == [None]


LEFTOVER = (".tmp", ".tmp-", "chat_history", "cactus-check-", "cactus-tp-", ".cactus-write-test-")


def _leftovers(*folders):
    """Files or folders a finished cache never is: temp names, partial writes, typed history."""
    found = []
    for folder in folders:
        for p in folder.rglob("*") if folder.is_dir() else ():
            if any(mark in p.name for mark in LEFTOVER) or (folder.name == "tmp" and p.parent == folder):
                found.append(str(p.relative_to(folder)))
    return found


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "the cat sat", "--quantize", "int8", "-n", "40", "--plain"],
        ["chat", "--draft", "suffix", "-n", "30"],
        ["bench", "--rules", "sps,cactus", "-k", "2,auto", "-n", "12", "--limit", "4", "--csv", "OUT/b.csv"],
        ["eval", "--tasks", "TASKS", "--rules", "sps", "-k", "2", "-n", "16", "--out", "OUT/e"],
        ["calibrate", "--limit", "2", "-n", "8", "--delta", "0.5", "-k", "1,2", "--save", "OUT/p.yaml"],
    ],
    ids=["generate", "chat", "bench", "eval", "calibrate"],
)
def test_17_ctrl_c_at_random_points_leaves_nothing_but_finished_caches(tiny, tmp_path, command):
    import json
    import random
    import signal
    import subprocess
    import sys
    import time

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        json.dumps({"prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"}) + "\n"
    )
    (tmp_path / "out").mkdir()
    args = [a.replace("TASKS", str(tasks)).replace("OUT", str(tmp_path / "out")) for a in command]
    model = ["--verifier", tiny["verifier"], "--device", "cpu", "--dtype", "float32"]
    if "--draft" not in args:
        model += ["--draft", tiny["draft_close"]]
    rng = random.Random(" ".join(command))
    for attempt in range(2):
        home, tmp = tmp_path / f"home{attempt}", tmp_path / f"t{attempt}" / "tmp"
        tmp.mkdir(parents=True)
        env = dict(os.environ, CACTUS_HOME=str(home), TMPDIR=str(tmp), HF_HUB_OFFLINE="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "cactus_cli", *args, *model],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            preexec_fn=ctrl_c_as_in_a_terminal,
        )
        if command[0] == "chat":
            proc.stdin.write("the cat sat on the mat\n" * 20)
            proc.stdin.flush()
        time.sleep(rng.uniform(1.5, 9.0))  # (imports take ~3 s: some land in loading, some in decoding)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert "Traceback" not in err, err
        assert _leftovers(home, tmp) == [], (attempt, err)
