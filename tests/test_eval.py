"""`cactus eval`: answer extraction and normalization (GSM8K conventions), Wilson intervals,
the built-in task set, the grid runner it shares with bench, and accuracy under SpS with the
verifier as its own draft."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

import cactus_cli.app.grid.sweep as bench_mod
from cactus_cli.app.eval import tasks
from cactus_cli.app.eval.tasks import (
    Task,
    builtin_tasks,
    extract_answer,
    is_correct,
    normalize,
)
from cactus_cli.cli.main import app
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.intervals import wilson
from tests.helpers import ctrl_c_as_in_a_terminal

cli = CliRunner()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("She has 5 + 3 = 8 apples.\n#### 8", "8"),
        ("#### 1,234", "1,234"),
        ("The total is $1,234.50.", "$1,234.50"),
        ("It drops to -7 degrees.", "-7"),
        ("so 12 x 3 = 36. The answer is 36.", "36"),
        ("#### 42\nThen some chatter with 99 in it", "42"),
        ("first #### 3 then #### 5", "5"),
        ("no digits here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "given,answer,ok",
    [
        ("$1,000", "1000", True),
        ("1000.", "1000", True),
        ("1,000.00", "1000", True),
        ("-3", "-3", True),
        ("3", "-3", False),
        ("0.50", ".5", True),
        ("12%", "12", True),
        ("42 apples", "42", True),
        ("The Mat.", "the mat", True),
        ("41", "42", False),
    ],
)
def test_comparison_after_normalization(given, answer, ok):
    assert is_correct(Task("t", "c", "p", answer=answer), f"reasoning...\n#### {given}")[0] is ok


def test_pattern_and_normalize_edge_cases():
    task = Task("t", "c", "p", answer="B", pattern=r"[Aa]nswer:\s*\(?([A-D])\)?")
    assert is_correct(task, "I think answer: (B) because ...") == (True, "B")
    assert is_correct(task, "no letter given") == (False, None)
    assert normalize(" 7.0 ") == "7" and normalize("$2,500") == "2500" and normalize("Hello  World.") == "hello world"


def test_wilson_interval():
    lo, hi = wilson(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    assert wilson(0, 10)[0] == 0.0 and 0.27 < wilson(0, 10)[1] < 0.28  # never a zero-width interval at 0/n
    assert wilson(10, 10)[1] == pytest.approx(1.0) and wilson(10, 10)[0] < 1
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(450, 900)
    assert hi - lo == pytest.approx(2 * 1.959964 * (0.25 / 900) ** 0.5, rel=5e-3)  # ~ the normal interval at large n


def test_builtin_tasks_have_checked_answers():
    tasks = builtin_tasks()
    arith = [t for t in tasks if t.category == "arithmetic"]
    code = [t for t in tasks if t.category == "code-output"]
    assert len(arith) == 40 and len(code) == 8 and len({t.id for t in tasks}) == 48
    assert all(normalize(t.answer).lstrip("-").isdigit() for t in arith)
    for t in code:  # run the code independently of the module's own runner
        src = t.prompt.split("```python\n")[1].split("\n```")[0]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(src, {})
        assert out.getvalue().strip() == t.answer
    assert all("####" in t.prompt for t in tasks)


def pair_args(tiny, draft="draft_close"):
    return [
        "--verifier",
        tiny["verifier"],
        "--draft",
        tiny[draft],
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--compile",
        "off",
    ]


def test_eval_and_bench_share_one_grid_runner(tiny, monkeypatch):
    calls = []
    real = bench_mod.run_grid

    def record(engines, grid, prompts, base, on_run, sink, grade=None, *rest):
        calls.append(grade is not None)
        return real(engines, grid, prompts, base, on_run, sink, grade, *rest)

    monkeypatch.setattr(bench_mod, "run_grid", record)
    assert (
        cli.invoke(app, ["bench", *pair_args(tiny), "--rules", "sps", "-k", "2", "--limit", "1", "-n", "4"]).exit_code
        == 0
    )
    assert (
        cli.invoke(app, ["eval", *pair_args(tiny), "--rules", "sps", "-k", "2", "--limit", "1", "-n", "4"]).exit_code
        == 0
    )
    assert calls == [False, True]


def test_sps_with_the_verifier_as_draft_matches_the_verifier_alone(tiny, tmp_path):
    # greedy: identical answers, hence identical accuracy, problem by problem
    tasks = tmp_path / "tasks.jsonl"
    rows = [
        {"prompt": p, "answer": a, "id": f"q{i}"}
        for i, (p, a) in enumerate(
            [
                ("one two three", "four"),
                ("the cat sat on the", "mat"),
                ("five six", "seven"),
                ("the sun and the", "moon"),
            ]
        )
    ]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = cli.invoke(
        app,
        [
            "eval",
            *pair_args(tiny, "verifier"),
            "--tasks",
            tasks,
            "--rules",
            "sps,cactus",
            "-k",
            "3",
            "-t",
            "0",
            "-n",
            "6",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["results"]
    alone, sps, cactus = rows
    assert alone["config"] == "verifier alone" and alone["problems"] == 4
    assert sps["answers"] == alone["answers"] == cactus["answers"]
    assert sps["accuracy"] == alone["accuracy"]
    assert sps["draft_acceptance_rate"] == 1.0  # the draft is the verifier: every draft accepted
    assert 0 <= alone["accuracy_ci95_low"] <= alone["accuracy"] <= alone["accuracy_ci95_high"] <= 1


def test_eval_table_csv_and_out(tiny, tmp_path):
    r = cli.invoke(
        app,
        [
            "eval",
            *pair_args(tiny),
            "--rules",
            "sps",
            "-k",
            "2",
            "--limit",
            "3",
            "-n",
            "4",
            "--csv",
            tmp_path / "e.csv",
            "--out",
            tmp_path / "o",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "accuracy" in r.stdout and "95% interval" in r.stdout
    header = (tmp_path / "e.csv").read_text().splitlines()[0].split(",")
    assert {"accuracy", "accuracy_ci95_low", "accuracy_ci95_high", "problems"} <= set(header)
    doc = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert [a["id"] for a in doc["results"][0]["answers"]] == doc["prompts"]


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"prompt": "hi"}', "each task needs an 'answer'"),
        ('{"prompt": "hi", "answer": 3, "pattern": "no group"}', "'pattern' must be a regular expression with a group"),
        ('{"prompt": "hi", "answer": 3, "pattern": "(unclosed"}', "'pattern' is not a valid regular expression"),
        ("not json", "not valid JSON"),
    ],
)
def test_bad_task_files_are_one_line_errors(tiny, tmp_path, line, message):
    f = tmp_path / "t.jsonl"
    f.write_text(line + "\n")
    r = cli.invoke(app, ["eval", *pair_args(tiny), "--tasks", f])
    assert r.exit_code == 2
    assert r.stderr.startswith(f"error: {f}:1: ") and message in r.stderr and "Traceback" not in r.output


@pytest.mark.parametrize(
    "pattern,text,want",
    [
        (r"answer:\s*(\d+)?", "answer: none", None),
        (r"(\d+)|\S", "x 5 y", "5"),
        (r"(\d+)|\S", "x y", None),
    ],
)
def test_a_pattern_group_that_takes_no_part_is_no_answer(pattern, text, want):
    assert tasks.extract_answer(text, pattern) == want


def test_a_backtracking_pattern_gives_up_and_ctrl_c_still_works():
    t0 = time.monotonic()
    assert tasks.extract_answer("x" * 40, r"((x|xx)+)+y(\d)") == tasks.PATTERN_TIMED_OUT
    assert time.monotonic() - t0 < tasks.PATTERN_SECONDS + 3
    code = (
        "from cactus_cli.app.eval.tasks import extract_answer\nimport sys\nprint('ready', flush=True)\n"
        "while True: extract_answer('x' * 40, r'((x|xx)+)+y(\\d)')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_in_a_terminal,  # (a suite started in the background made this flaky)
    )
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)  # within one give-up (2 s) on a quiet machine; slack for a loaded one
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in proc.stderr.read()


@pytest.mark.parametrize(
    "answer,needle",
    [
        (float("nan"), "not a finite number"),
        (1e400, "not a finite number"),
        ("  ", "is empty"),
        ("inf", "not a finite number"),
    ],
)
def test_task_answers_that_can_never_match(tmp_path, answer, needle):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": answer}) + "\n")
    with pytest.raises(ConfigError, match=needle):
        tasks.load_tasks(str(path), None)
