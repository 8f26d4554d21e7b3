"""The llama.cpp backend's weight types and threads (infer/backends/llama_cpp/gguf_layout.py): a GGUF requantized by
llama.cpp's own quantizer, once, atomically and with its hash; the choice between the shipped file
and Q4_0 by measured speed on edits and quality; threads by measurement; all on tiny GGUF files."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cactus_cli.cli.main import app
from cactus_cli.core import conditions
from cactus_cli.core.errors import ModelError
from cactus_cli.infer.backends.llama_cpp import gguf, gguf_layout
from cactus_cli.infer.backends.llama_cpp.gguf_layout import QUALITY_TOLERANCE, Layout, choose, requantize, score
from tests.gguf_helpers import write_tiny_gguf
from tests.helpers import assert_one_line_error

if gguf.available() is not None:
    if os.environ.get("CI"):  # (the test command installs llama-cpp-python: never skip these there)
        raise RuntimeError(f"llama-cpp-python is missing in CI: {gguf.available()}")
    pytest.skip(f"llama.cpp backend unavailable: {gguf.available()}", allow_module_level=True)
runner = CliRunner()


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf", seed=3)


def no_texts() -> list[list[int]]:
    raise AssertionError("quality measured although the requantized file was not the faster")


def test_requantizing_makes_a_q4_0_file_once_with_its_hash(tiny_gguf):
    out = requantize(tiny_gguf, "q4_0", "tiny")
    record = json.loads(out.with_name(out.name + ".json").read_text())
    assert record["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest() and record["bytes"] == out.stat().st_size
    model = gguf.GGUFModel.load(str(out), 1)
    try:
        assert "Q4_0" in model.description, model.description  # every tensor: the pure type
    finally:
        model.close()
    stamp = out.stat().st_mtime_ns
    assert requantize(tiny_gguf, "q4_0", "tiny") == out and out.stat().st_mtime_ns == stamp  # cached
    with open(out, "r+b") as f:  # a file that does not match its record (a damaged copy) is made again
        f.truncate(100)
    assert requantize(tiny_gguf, "q4_0", "tiny").stat().st_size == record["bytes"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]
    good = out.read_bytes()
    with open(out, "r+b") as f:  # damaged in place, its size kept: its hash tells
        f.seek(len(good) // 2)
        f.write(bytes(b ^ 0xFF for b in good[len(good) // 2 : len(good) // 2 + 64]))
    assert requantize(tiny_gguf, "q4_0", "tiny").read_bytes() == good
    os.utime(out, ns=(1, 1))  # touched, not changed: kept, and its record learns the new time
    assert requantize(tiny_gguf, "q4_0", "tiny").read_bytes() == good and out.stat().st_mtime_ns == 1
    assert json.loads(out.with_name(out.name + ".json").read_text())["mtime_ns"] == 1


def test_a_killed_requantization_leaves_nothing_the_next_run_trusts(tiny_gguf):
    out = requantize(tiny_gguf, "q4_0", "tiny")
    left = out.parent / f".tmp-tiny-q4_0-{2**22 + 12346}-abc.gguf"  # (a dead run's, beside a good cache)
    left.write_bytes(b"half")
    assert requantize(tiny_gguf, "q4_0", "tiny") == out and not left.exists()
    stale = out.parent / f".tmp-tiny-q4_0-{2**22 + 12345}-abc.gguf"  # (no such process)
    stale.write_bytes(b"half")
    out.with_name(out.name + ".json").unlink()  # killed before its record was written
    again = requantize(tiny_gguf, "q4_0", "tiny")
    assert again.with_name(again.name + ".json").is_file() and not stale.exists()


def test_a_folder_where_the_cache_file_goes_is_a_clear_error(tiny_gguf):
    from cactus_cli.infer.load.embedded import models_dir

    (models_dir() / "tiny-q4_0.gguf").mkdir(parents=True)
    with pytest.raises(ModelError, match="is a folder where cactus keeps a requantized model"):
        requantize(tiny_gguf, "q4_0", "tiny")


def test_a_users_gguf_runs_as_given_and_q4_0_only_when_asked(tiny_gguf):
    as_given = choose(tiny_gguf, "tiny", "auto", 1, False, no_texts)
    assert as_given == Layout(str(tiny_gguf), 1, "gguf", "llama.cpp runs the GGUF's own weight types")
    asked = choose(tiny_gguf, "tiny", "q4_0", 1, False, no_texts)
    assert asked.quantize == "q4_0" and asked.path.endswith("tiny-q4_0.gguf") and "as asked" in asked.reason


def test_threads_are_measured_once_and_the_fastest_kept(tiny_gguf, monkeypatch):
    monkeypatch.setattr(gguf_layout, "thread_candidates", lambda: [1, 2])
    timed = []

    def fake_measure(path, threads, widths=gguf_layout.WIDTHS, texts=()):
        timed.append(threads)
        base = {1: 0.05, 2: 0.03}[threads]
        return {"curve": {w: base * (1 + w / 16) for w in widths}, "nll": None}

    monkeypatch.setattr(gguf_layout, "measure", fake_measure)
    layout = choose(tiny_gguf, "tiny", "none", None, False, no_texts)
    assert (
        layout.threads == 2
        and "2 threads, measured fastest here (1 thread takes 1.67x; measured " in layout.threads_reason
    )
    assert timed == [1, 2]
    assert choose(tiny_gguf, "tiny", "none", None, False, no_texts).threads == 2 and timed == [1, 2]  # cached
    assert choose(tiny_gguf, "tiny", "none", 1, False, no_texts).threads == 1  # --threads wins


@pytest.mark.parametrize("bad", [0, -1.0, "nan"])
def test_a_corrupt_stored_choice_is_measured_again(tiny_gguf, isolated_home, monkeypatch, bad):
    """A stored score or speed-up that is not a positive number (a hand edit, a bad disk): measured
    again, never trusted (a zero score won every thread count; a string speed-up crashed the start)."""
    monkeypatch.setattr(gguf_layout, "thread_candidates", lambda: [1, 2])
    timed = []

    def fake_measure(path, threads, widths=gguf_layout.WIDTHS, texts=()):
        timed.append(threads)
        return {"curve": {w: 0.05 / threads * (1 + w / 16) for w in widths}, "nll": None}

    monkeypatch.setattr(gguf_layout, "measure", fake_measure)
    assert choose(tiny_gguf, "tiny", "auto", None, False, no_texts).threads == 2
    n = len(timed)
    for path in (isolated_home / "costs").glob("gguf-layout-*.json"):
        doc = json.loads(path.read_text())
        result = doc["result"]
        if "scores" in result:
            result["scores"]["1"] = float(bad) if bad != "nan" else float("nan")
        if "speedup" in result:
            result["speedup"] = bad if bad != "nan" else "fast"
        path.write_text(json.dumps(doc))
    assert choose(tiny_gguf, "tiny", "auto", None, False, no_texts).threads == 2
    assert len(timed) > n  # measured again


@pytest.mark.parametrize(
    "q4_speed, drift, expected",
    [
        (1.3, -0.01, "q4_0"),  # faster, same quality: the default uses it
        (1.3, QUALITY_TOLERANCE + 0.01, "gguf"),  # faster but worse: not
        (0.8, None, "gguf"),  # slower: quality is not even measured
    ],
)
def test_auto_uses_q4_0_where_it_decodes_edits_faster_at_equal_quality(
    tiny_gguf, isolated_home, monkeypatch, q4_speed, drift, expected
):
    monkeypatch.setattr(gguf_layout, "thread_candidates", lambda: [1])

    def fake_measure(path, threads, widths=gguf_layout.WIDTHS, texts=()):
        q4 = path.endswith("-q4_0.gguf")
        curve = {w: (0.1 / q4_speed if q4 else 0.1) * (1 + w / 8) for w in widths}
        return {"curve": curve, "nll": (2.0 + drift if q4 else 2.0) if texts else None}

    monkeypatch.setattr(gguf_layout, "measure", fake_measure)
    lines = []

    class Reporter:
        def task(self, description, total=None):
            return lambda n: None

        def done(self, description):
            lines.append(description)

    texts = (lambda: [[1, 2, 3]]) if drift is not None else no_texts
    layout = choose(tiny_gguf, "tiny", "auto", None, True, texts, Reporter())
    assert layout.quantize == expected
    made = isolated_home / "models" / "tiny-q4_0.gguf"
    assert (Path(layout.path) == made) == (expected == "q4_0")
    assert made.is_file() == (expected == "q4_0")  # a requantization this CPU does not use is not kept
    assert len(lines) == 1 and f"{q4_speed:.2f}x" in lines[0]  # said once, in one line, when decided
    assert choose(tiny_gguf, "tiny", "auto", None, True, no_texts, Reporter()) == layout and len(lines) == 1


def test_score_prices_an_edit_by_its_plain_steps_and_its_cheapest_drafted_width():
    flat = {1: 0.08, 4: 0.18, 16: 0.31, 64: 0.7}  # an AMX Xeon's Q4_K_M (measured)
    steep = {1: 0.107, 4: 0.12, 16: 0.37, 64: 1.36}  # its Q4_0: cheap at 4, steep past 16
    assert score(flat) < score(steep)
    plain = dict(flat)
    plain[1] = 0.2  # slow plain steps cost 15 of every 100 tokens
    assert score(plain) == pytest.approx(score(flat) + 15 * 0.12)


def test_q4_0_is_a_llama_cpp_setting(tiny_gguf, tiny):
    r = runner.invoke(app, ["generate", "hi", "--verifier", str(tiny_gguf), "--backend", "torch", "--quantize", "q4_0"])
    assert_one_line_error(r, "--quantize q4_0 does not apply to the torch backend (it is a llama.cpp setting)")
    r = runner.invoke(app, ["generate", "hi", "--verifier", tiny["verifier"], "--quantize", "q4_0"])
    assert_one_line_error(r, "is a folder; not torch: --quantize q4_0)")


def test_generate_runs_a_q4_0_requantization_and_says_so(tiny_gguf):
    r = runner.invoke(
        app,
        ["generate", "the cat", "--verifier", str(tiny_gguf), "--draft", "none", "--quantize", "q4_0", "-n", "4"]
        + ["--threads", "1", "--json"],
    )
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["settings"]["plan"]
    assert plan["quantize"]["value"] == "q4_0" and "requantized" in plan["quantize"]["reason"]


def test_a_choice_measured_beside_a_busy_process_is_provisional_and_taken_again(tiny_gguf, monkeypatch):
    """A first start beside another CPU-heavy job stored 1 thread (1.81x slower for good).
    Contention is simulated: the timings' threads get half the CPU they could use and 1 thread
    looks faster; the choice is stored as provisional and said so. Once the other job is gone the
    next start measures again by itself and keeps the quiet choice (2 threads), stored as quiet."""
    monkeypatch.setattr(gguf_layout, "thread_candidates", lambda: [1, 2])
    busy = {"now": True}
    timed = []

    def fake_measure(path, threads, widths=gguf_layout.WIDTHS, texts=()):
        timed.append(threads)
        base = ({1: 0.04, 2: 0.05} if busy["now"] else {1: 0.05, 2: 0.0276})[threads]
        return {"curve": {w: base * (1 + w / 16) for w in widths}, "nll": None}

    monkeypatch.setattr(gguf_layout, "measure", fake_measure)
    monkeypatch.setattr(conditions, "cpu_share", lambda wall, cpu, threads: 0.5 if busy["now"] else 0.98)
    first = choose(tiny_gguf, "tiny", "none", None, False, no_texts)
    assert (
        first.threads == 1
        and "provisional" in first.threads_reason
        and "measured again at the next start" in first.threads_reason
    )
    busy["now"] = False
    second = choose(tiny_gguf, "tiny", "none", None, False, no_texts)
    assert second.threads == 2 and "quiet" in second.threads_reason and timed == [1, 2, 1, 2]
    assert choose(tiny_gguf, "tiny", "none", None, False, no_texts).threads == 2 and len(timed) == 4  # kept
    r = CliRunner().invoke(app, ["models", "remeasure"])
    assert r.exit_code == 0 and "the next start measures again" in r.output
    assert choose(tiny_gguf, "tiny", "none", None, False, no_texts).threads == 2 and len(timed) == 6


def test_a_stored_curve_that_later_verifies_beat_is_taken_again(tiny_gguf, monkeypatch):
    """Contention the CPU share did not show (the other job started just after the timing of 2
    threads): the stored curve says a verify takes far longer than the run's verifies do. Once
    WATCH_STEPS verifies have beaten it, the run says so once and marks the measurement provisional;
    the next start measures again by itself and keeps the quiet choice."""
    monkeypatch.setattr(gguf_layout, "thread_candidates", lambda: [1, 2])
    busy = {"now": True}
    timed = []

    def fake_measure(path, threads, widths=gguf_layout.WIDTHS, texts=()):
        timed.append(threads)
        base = ({1: 4.0, 2: 5.0} if busy["now"] else {1: 5.0, 2: 2.76})[threads]  # (seconds: far slower than real)
        return {"curve": {w: base * (1 + w / 16) for w in widths}, "nll": None}

    monkeypatch.setattr(gguf_layout, "measure", fake_measure)
    args = ["generate", "the cat", "--verifier", str(tiny_gguf), "--draft", "none", "-n", "40", "--seed", "1"]
    args += ["--temperature", "1.0", "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["settings"]["plan"]
    assert plan["threads"]["value"] == 1 and "quiet" in plan["threads"]["reason"]  # (the share looked quiet)
    said = " ".join(r.stderr.split())
    assert said.count("faster than the measurement its choice was made from") == 1, said
    assert "taken again at the next start (or now: `cactus models remeasure`)" in said
    busy["now"] = False
    again = choose(tiny_gguf, "tiny", "none", None, False, no_texts)
    assert again.threads == 2 and "quiet" in again.threads_reason and timed == [1, 2, 1, 2]


def test_the_watch_says_a_slower_machine_once_and_keeps_the_measurement(capsys):
    marked = []
    watch = conditions.Watch(
        "verifies", {1: 0.01, 4: 0.02}, {"taken": "2026-12-01T10:00", "quiet": True}, marked.append
    )
    for _ in range(conditions.WATCH_STEPS - 1):
        watch.add(1, 0.05)
        watch.add(7, 0.001)  # (a width the measurement did not price: not counted)
    assert watch.said is None and capsys.readouterr().err == ""
    for _ in range(10):
        watch.add(4, 0.1)
    said = " ".join(capsys.readouterr().err.split())
    assert said.count("5.00x slower than measured (measured 2026-12-01 10:00, quiet)") == 1, said
    assert "`cactus models remeasure`" in said and not marked  # (slower now: the stored choice is kept)
    quick = conditions.Watch("verifies", {1: 0.01}, {}, marked.append)
    for _ in range(conditions.WATCH_STEPS):
        quick.add(1, 0.009)  # within the allowance either way: nothing said
    assert quick.said is None and not marked and capsys.readouterr().err == ""
