"""`cactus bench` on tiny pairs: the JSON schema, the baseline row, SpS with draft == verifier,
outputs on disk, Ctrl-C, and bad inputs."""

from __future__ import annotations

import csv
import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from cactus_cli.app.grid import sweep as bench_mod
from cactus_cli.cli.main import app
from cactus_cli.core import fileio
from tests.helpers import (
    assert_one_line_error,
    bench_args,
    decoding,
    invoke,
    tiny_args,
    wait_for,
)

runner = CliRunner()


def bench(tiny, *args, draft="draft_close"):
    base = [
        "bench",
        "--verifier",
        tiny["verifier"],
        "--draft",
        tiny[draft],
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--limit",
        "2",
        "-n",
        "8",
    ]
    return runner.invoke(app, base + [str(a) for a in args])


def test_json_schema_and_baseline_row(tiny):
    r = bench(tiny, "--rules", "sps,cactus,tas", "--delta", "0.5,1", "-k", "2,3", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["schema_version"] == 1 and doc["interrupted"] is False
    for key in ("cactus", "torch", "transformers", "device", "dtype", "verifier", "draft"):
        assert key in doc["environment"]
    assert len(doc["prompts"]) == 2
    rows = doc["results"]
    assert [r["config"] for r in rows] == [
        "verifier alone",
        "sps k=2",
        "sps k=3",
        "cactus δ=0.5 k=2",
        "cactus δ=0.5 k=3",
        "cactus δ=1 k=2",
        "cactus δ=1 k=3",
        "tas k=2",
        "tas k=3",
    ]
    base = rows[0]
    assert base["kind"] == "autoregressive" and base["speedup"] == 1.0 and base["draft_acceptance_rate"] is None
    assert base["verifier_forward_passes_per_token"] > 1.0 - 1e-9  # one pass per token (+ prefill)
    for row in rows[1:]:
        for key in (
            "mean_accepted_tokens_per_step",
            "mean_acceptance_length",
            "draft_acceptance_rate",
            "acceptance_histogram",
            "per_position_acceptance_rate",
            "tokens_per_second",
            "ms_per_output_token",
            "speedup",
            "verifier_forward_passes_per_token",
            "by_category",
        ):
            assert row[key] is not None, key
        assert row["mean_acceptance_length"] == pytest.approx(1 + row["mean_accepted_tokens_per_step"])
        assert len(row["acceptance_histogram"]) == row["k"] + 1
        assert set(row["by_category"]) == {"code", "math"}  # the built-in set interleaves categories


def test_auto_k_row_with_its_chosen_k_histogram(tiny):
    r = bench(tiny, "--rules", "cactus", "-k", "2,auto", "--max-draft-tokens", "3", "-n", "16", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    rows = {row["config"]: row for row in doc["results"]}
    auto = rows["cactus δ=1 k=auto"]
    assert auto["k"] == "auto" and auto["max_draft_tokens"] == 3
    assert len(auto["k_histogram"]) <= 4 and sum(auto["k_histogram"]) > 0  # steps by chosen k in 0..3
    assert rows["cactus δ=1 k=2"]["k_histogram"][0] <= 2  # a fixed k only shrinks near max_tokens
    cm = doc["cost_model"]
    assert cm["source"].startswith("probe") and set(cm["verify_seconds_by_width"]) == {"1", "2", "3", "4"}


def test_sps_with_draft_equal_to_verifier_accepts_everything(tiny):
    # p and q agree up to float rounding: a rejection has probability ~1e-6 per token here,
    # so the false-failure odds of this test are below 1e-4
    r = bench(tiny, "--rules", "sps", "-k", "3", "--temperature", "0.8", "--json", draft="verifier")
    assert r.exit_code == 0, r.output
    row = json.loads(r.output)["results"][1]
    assert row["draft_acceptance_rate"] == 1.0
    assert row["mean_accepted_tokens_per_step"] == pytest.approx(3.0, abs=1.0)  # max_tokens cuts the last step


def test_outputs_on_disk_and_hf_comparison(tiny, tmp_path):
    out = tmp_path / "run"
    r = bench(tiny, "--rules", "sps", "-k", "2", "--compare-hf", "--out", out, "--csv", tmp_path / "x.csv")
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "bench.json").read_text())
    kinds = [row["kind"] for row in doc["results"]]
    assert kinds == ["autoregressive", "speculative", "hf-assisted"]
    assert doc["results"][1]["tokens_per_second_vs_hf"] > 0
    assert json.loads((out / "environment.json").read_text())["device"] == "cpu"
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [row["config"] for row in rows] == ["verifier alone", "sps k=2", "HF assisted k=2"]
    assert (tmp_path / "x.csv").read_text() == (out / "bench.csv").read_text()
    assert "sps k=2" in r.output and "speedup" in r.output  # the table


def test_ctrl_c_keeps_what_finished(tiny, tmp_path, monkeypatch):
    real = bench_mod.run_one
    calls = []

    def interrupted_after_one(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_mod, "run_one", interrupted_after_one)
    r = bench(tiny, "--rules", "sps,cactus", "-k", "2", "--out", tmp_path / "o")
    assert r.exit_code == 130
    doc = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert doc["interrupted"] is True
    assert [row["config"] for row in doc["results"]] == ["verifier alone"]
    assert doc["results"][0]["prompts"] == 1


def test_configurations_run_prompt_by_prompt(tiny, monkeypatch):
    # all configurations on prompt 1, then all on prompt 2: machine drift moves every row alike
    real, order = bench_mod.run_one, []

    def record(engine, cfg, i, ids, base, *rest):
        order.append((i, cfg.label))
        return real(engine, cfg, i, ids, base, *rest)

    monkeypatch.setattr(bench_mod, "run_one", record)
    assert bench(tiny, "--rules", "sps", "-k", "1,2").exit_code == 0
    labels = ["verifier alone", "sps k=1", "sps k=2"]
    assert order == [(0, c) for c in labels] + [(1, c) for c in labels]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--rules", "sps,magic"], "unknown rule 'magic'"),
        (["--rules", "cactus", "--delta", "0.5,-1"], "--delta: each value must be a number in 0..1e+06"),
        (["-k", "2,0"], "-k: each value must be an integer in 1..64"),
        (["-k", "two"], "-k: expected an integer in 1..64 or auto"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--prompts", "/nonexistent.jsonl"], "no such file"),
    ],
)
def test_bad_inputs(tiny, args, needle):
    assert_one_line_error(bench(tiny, *args), needle)


def test_bad_prompts_file(tiny, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"id": 3}\n')
    assert_one_line_error(bench(tiny, "--prompts", f), f"{f}:2: each line must be an object")
    f.write_text('{"prompt": "the cat", "category": "animals", "id": "c1"}\n')
    r = bench(tiny, "--prompts", f, "--rules", "sps", "-k", "2", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["prompts"] == ["c1"] and set(doc["results"][1]["by_category"]) == {"animals"}


def test_bench_needs_a_draft(tiny):
    r = runner.invoke(app, ["bench", "--verifier", tiny["verifier"], "--draft", "none"])
    assert_one_line_error(r, "needs a --draft")


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


def test_sigterm_keeps_finished_rows(tiny, tmp_path, isolated_home):
    out, csv = tmp_path / "o", tmp_path / "rows.csv"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cactus_cli",
            "bench",
            *tiny_args(tiny),
            "--rules",
            "sps",
            "-k",
            "4",
            "-n",
            "400",
            "--out",
            str(out),
            "--csv",
            str(csv),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    try:
        assert wait_for(decoding(isolated_home), 240), "the bench never started decoding"
        time.sleep(8)  # past the warm-up: the first prompts of 8 x 400 tokens are done
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert (out / "bench.json").is_file() and csv.is_file()
    doc = json.loads((out / "bench.json").read_text())
    assert doc["interrupted"] is True and doc["results"], stdout


def test_plot_draws_speed_against_the_realized_divergence(tiny, tmp_path):
    png = tmp_path / "tradeoff.png"
    r = bench(tiny, "--rules", "sps,cactus", "--delta", "0.5,2", "-k", "2", "--meter", "--plot", png)
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = bench(tiny, "--rules", "sps", "-k", "2", "--plot", png)
    assert r.exit_code == 2 and "add --meter" in r.output


@pytest.mark.parametrize(
    "flag, value, said",
    [("-k", "2,2", "-k: 2 given"), ("--delta", "1,1.0", "--delta: 1.0 given"), ("--draft", "suffix,suffix", "suffix")],
)
def test_a_value_given_twice_runs_once_and_every_row_has_its_own_history(tiny, flag, value, said):
    import json

    from tests.helpers import invoke

    args = ["bench", "--verifier", tiny["verifier"], "--draft", "suffix", "--device", "cpu", "--dtype", "float32"]
    args += ["--rules", "cactus", "-k", "2", "--delta", "1", "--limit", "2", "-n", "6", "--json", flag, value]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    assert said in r.stderr and "given more than once; each runs once" in r.stderr
    rows = json.loads(r.stdout)["results"]
    assert [row["config"] for row in rows] == ["verifier alone", "cactus δ=1 k=2"]  # one row, not two


def test_twin_rows_never_share_a_drafters_memory():
    from cactus_cli.app.grid.configs import build_grid

    grid = build_grid(["sps", "sps"], [1.0], [2, 2], {}, False, variants=[("torch", "none", False, "suffix", "")])
    assert [c.label for c in grid] == ["verifier alone", "sps k=2"]


def test_concurrency_rows_serve_requests_together(tiny):
    """--concurrency 1,3: each configuration also runs with 3 requests stepped together; those rows
    give the aggregate rate, each request's rate and the time to first token; greedy answers are
    the same tokens as one at a time (the same count of output tokens)."""
    r = bench(tiny, "--rules", "sps", "-k", "2", "--limit", "4", "-t", "0", "--concurrency", "1,3", "--json")
    assert r.exit_code == 0, r.output
    rows = {row["config"]: row for row in json.loads(r.output)["results"]}
    assert set(rows) == {"verifier alone", "verifier alone · 3 at once", "sps k=2", "sps k=2 · 3 at once"}
    for name in ("verifier alone", "sps k=2"):
        one, three = rows[name], rows[f"{name} · 3 at once"]
        assert three["concurrency"] == 3 and one["concurrency"] == 1
        assert three["num_output_tokens"] == one["num_output_tokens"] and three["prompts"] == 4
        assert three["aggregate_tokens_per_second"] > 0 and three["ttft_p90"] >= three["ttft_p50"] > 0
        assert three["request_decode_tokens_per_second"] > 0
    assert rows["sps k=2 · 3 at once"]["mean_acceptance_length"] == rows["sps k=2"]["mean_acceptance_length"]
    table = bench(tiny, "--rules", "sps", "-k", "2", "--limit", "3", "--concurrency", "2")
    assert table.exit_code == 0 and "all tok/s" in table.output and "TTFT p50" in table.output


@pytest.mark.parametrize("value", ["0", "1,x", "65"])
def test_bad_concurrency(tiny, value):
    assert_one_line_error(invoke(*bench_args(tiny), "--concurrency", value), "--concurrency")


QUESTIONS = [  # Spec-Bench's question.jsonl format: its MT-Bench rows have two turns, the others one
    {"question_id": 81, "category": "writing", "turns": ["the cat sat on the mat", "then the dog ran fast"]},
    {"question_id": 1001, "category": "translation", "turns": ["one two three four"]},
    {"question_id": 1002, "category": "qa", "turns": ["the sun and the moon"], "reference": ["the sky"]},
]


def question_file(tmp_path):
    f = tmp_path / "question.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in QUESTIONS))
    return f


def record_turns(monkeypatch):
    """Every turn the runner decodes: (config, question id, its token ids, its output tokens, its answer)."""
    real, turns = bench_mod._turn, []

    def turn(engine, cfg, i, ids, base, *rest, **kw):
        stats, text = real(engine, cfg, i, ids, base, *rest, **kw)
        turns.append((cfg.label, QUESTIONS[i]["question_id"], ids, stats.num_output_tokens, text))
        return stats, text

    monkeypatch.setattr(bench_mod, "_turn", turn)
    return turns


def test_a_spec_bench_question_file_is_reported_per_category_with_every_turn(tiny, tmp_path, monkeypatch):
    turns = record_turns(monkeypatch)
    r = bench(tiny, "--prompts", question_file(tmp_path), "--limit", "3", "--rules", "sps", "-k", "2", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["prompts"] == [81, 1001, 1002]
    for row in doc["results"]:
        assert set(row["by_category"]) == {"writing", "translation", "qa"} and row["prompts"] == 3
        mine = [t for t in turns if t[0] == row["config"]]
        assert [t[1] for t in mine] == [81, 81, 1001, 1002]  # both of the MT-Bench row's turns
        writing = row["by_category"]["writing"]  # (the question's turns together, as Spec-Bench counts)
        assert writing["num_output_tokens"] == sum(t[3] for t in mine[:2])
        assert row["num_output_tokens"] == sum(t[3] for t in mine)


def test_the_second_turn_is_asked_after_the_models_own_first_answer(tiny, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    turns = record_turns(monkeypatch)
    r = bench(tiny, "--prompts", question_file(tmp_path), "--limit", "2", "--rules", "sps", "-k", "2")
    assert r.exit_code == 0, r.output
    assert "by category" in r.output and "writing" in r.output and "translation" in r.output  # (the table)
    tok = AutoTokenizer.from_pretrained(tiny["verifier"])
    for label in ("verifier alone", "sps k=2"):
        (_, _, first_ids, _, answer), (_, _, second_ids, _, _) = [t for t in turns if t[:2] == (label, 81)]
        assert answer.strip()  # (the tiny model says something: -n 8)
        conversation = [
            {"role": "user", "content": QUESTIONS[0]["turns"][0]},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": QUESTIONS[0]["turns"][1]},
        ]
        rendered = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert f"<s> assistant {answer} </s> <s> user then the dog ran fast </s>" in rendered
        assert second_ids == tok(rendered, add_special_tokens=False)["input_ids"]
        assert second_ids[: len(first_ids) - 2] == first_ids[:-2]  # (the first turn, less "<s> assistant")


def test_a_multi_turn_question_keeps_its_slot_with_concurrency(tiny, tmp_path, monkeypatch):
    from cactus_cli.app.grid import sweep as grid

    real, asked = grid.next_turn, []
    monkeypatch.setattr(grid, "next_turn", lambda e, p, answers: asked.append(p.id) or real(e, p, answers))
    f = question_file(tmp_path)
    r = bench(tiny, "--prompts", f, "--limit", "3", "--rules", "sps", "-k", "2", "--concurrency", "2", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    together = [row for row in rows if row["concurrency"] == 2]
    assert together and all(set(row["by_category"]) == {"writing", "translation", "qa"} for row in together)
    assert asked.count(81) == len(rows)  # the second turn, once per row, batched rows included


def test_a_malformed_question_row_is_one_line_naming_file_line_and_field(tiny, tmp_path):
    f = tmp_path / "question.jsonl"
    f.write_text(json.dumps(QUESTIONS[0]) + "\n" + json.dumps({"question_id": 2, "turns": ["ok", ""]}) + "\n")
    assert_one_line_error(bench(tiny, "--prompts", f), f"{f}:2: 'turns'[1] must be a non-empty string")
    f.write_text(json.dumps({"question_id": [2], "turns": ["ok"]}) + "\n")
    assert_one_line_error(bench(tiny, "--prompts", f), f"{f}:1: 'question_id' must be a string or an integer")


def test_calibrate_and_eval_take_the_question_file(tiny, tmp_path, monkeypatch):
    from cactus_cli.app.grid import sweep as grid
    from tests.helpers import calibrate_args

    real, asked = grid.next_turn, []
    monkeypatch.setattr(grid, "next_turn", lambda e, p, answers: asked.append(p.id) or real(e, p, answers))
    f = question_file(tmp_path)
    r = invoke(*calibrate_args(tiny), "--prompts", f, "--json")  # (--limit 1: the two-turn question)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["prompts"] == [81] and asked and set(asked) == {81}
    r = invoke("eval", *tiny_args(tiny), "--tasks", f, "--limit", "1")  # (no answers to grade)
    assert_one_line_error(r, "bench --prompts")
