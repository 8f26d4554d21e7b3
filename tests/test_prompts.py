"""The built-in prompt sets: the `edit` category (real standard-library functions with an instruction
whose answer reproduces most of them), used only when named, and `bench --category edit`."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cactus_cli.app.prompts import EDIT_FILE, builtin_prompts, edit_prompts, load_prompts
from cactus_cli.cli.main import app
from cactus_cli.core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def test_the_edit_category_holds_real_functions_to_change():
    prompts = edit_prompts()
    assert len(prompts) >= 24 and len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        instruction, code = re.fullmatch(r"(.+?)\n\n```python\n(.+)```", p.prompt, re.S).groups()
        assert 20 <= len(code.splitlines()) <= 80, p.id
        tree = ast.parse(code)  # a whole function (or method), as the standard library has it
        assert isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)), p.id
        assert "return the whole" in instruction, p.id  # the answer reproduces most of the input


def test_each_edit_names_its_source_and_the_notice_its_licence():
    rows = [json.loads(line) for line in EDIT_FILE.read_text(encoding="utf-8").splitlines()]
    assert all("standard library, PSF License" in r["source"] for r in rows)
    notice = (ROOT / "NOTICE").read_text()
    assert "cactus_cli/app/data/edit.jsonl" in notice and "Python Software Foundation License" in notice
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import make_edit_prompts
    finally:
        sys.path.pop(0)
    made = [(f"edit-{i}", name, instruction) for i, (name, instruction, _) in enumerate(make_edit_prompts.EDITS, 1)]
    assert made == [(r["id"], r["source"].split(" ")[0], r["prompt"].split("\n\n```")[0]) for r in rows]


def test_edits_come_only_when_asked_for():
    assert not any(p.category == "edit" for p in builtin_prompts(None))
    assert not any(p.category == "edit" for p in load_prompts(None, None))
    asked = load_prompts(None, None, ["edit"])
    assert len(asked) == len(edit_prompts()) and {p.category for p in asked} == {"edit"}
    both = load_prompts(None, 4, ["edit", "code"])
    assert [p.category for p in both] == ["code", "edit", "code", "edit"]  # interleaved, as every set


def test_bench_runs_the_edit_category(tiny):
    r = runner.invoke(
        app,
        ["bench", "--verifier", tiny["verifier"], "--draft", "suffix", "--device", "cpu", "--dtype", "float32"]
        + ["--category", "edit", "--limit", "1", "-n", "4", "--rules", "sps", "--json"],
    )  # (one: the tiny pair's context holds 512 tokens)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["prompts"] == ["edit-1"] and set(doc["results"][1]["by_category"]) == {"edit"}


def test_a_deeply_nested_jsonl_line_is_one_line_naming_file_and_line(tmp_path):
    from cactus_cli.app.prompts import read_jsonl

    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "fine"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=rf"{f}:2: nested too deeply"):
        read_jsonl(str(f), "--prompts", "prompts")


def test_prompt_files_split_on_newlines_only_keep_ids_and_read_fifos(tmp_path):
    import json
    import threading

    from cactus_cli.app.eval.tasks import load_tasks
    from cactus_cli.app.prompts import load_prompts

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


SPEC_BENCH_ROWS = [  # MT-Bench / Spec-Bench question.jsonl rows, as those files have them
    {"question_id": 81, "category": "writing", "turns": ["the cat sat on the mat", "then the dog ran fast"]},
    {"question_id": 101, "category": "translation", "turns": ["one two three"]},
    {"question_id": 102, "category": "qa", "turns": ["the sun and the moon"], "reference": ["the sky"]},
]


def test_spec_bench_question_rows_are_read_as_they_are(tmp_path):
    f = tmp_path / "question.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in SPEC_BENCH_ROWS))
    got = load_prompts(str(f), None)
    assert [(p.id, p.category, p.prompt, p.turns) for p in got] == [
        (81, "writing", "the cat sat on the mat", ("then the dog ran fast",)),
        (101, "translation", "one two three", ()),
        (102, "qa", "the sun and the moon", ()),
    ]
    assert [p.id for p in load_prompts(str(f), None, ["writing"])] == [81]
    asked = got[0].protocol(True)
    assert asked.chat is True and asked.conversation(["it was happy"]) == [
        {"role": "user", "content": "the cat sat on the mat"},
        {"role": "assistant", "content": "it was happy"},
        {"role": "user", "content": "then the dog ran fast"},
    ]


@pytest.mark.parametrize(
    "row, needle",
    [
        ({"question_id": 1, "category": "qa"}, "non-empty string 'prompt' or MT-Bench / Spec-Bench 'turns'"),
        ({"question_id": 1, "turns": "just one"}, "'turns' must be a non-empty list"),
        ({"question_id": 1, "turns": []}, "'turns' must be a non-empty list"),
        ({"question_id": 1, "turns": ["fine", ""]}, "'turns'[1] must be a non-empty string"),
        ({"question_id": 1, "turns": ["fine", 7]}, "'turns'[1] must be a non-empty string"),
        ({"question_id": 1.5, "turns": ["fine"]}, "'question_id' must be a string or an integer"),
        ({"question_id": None, "turns": ["fine"]}, "'question_id' must be a string or an integer"),
        ({"question_id": 1, "category": 3, "turns": ["fine"]}, "'category' must be a non-empty string"),
        ({"question_id": 1, "prompt": "a", "turns": ["b"]}, "give 'prompt' or 'turns', not both"),
    ],
)
def test_a_malformed_question_row_is_one_error_naming_file_line_and_field(tmp_path, row, needle):
    f = tmp_path / "question.jsonl"
    f.write_text(json.dumps(SPEC_BENCH_ROWS[1]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(f'{f}:2: ')}.*{re.escape(needle)}") as err:
        load_prompts(str(f), None)
    assert "\n" not in str(err.value)


def test_eval_reads_multi_turn_answer_tasks_and_says_where_unanswered_questions_go(tmp_path):
    from cactus_cli.app.eval.tasks import load_tasks

    f = tmp_path / "tasks.jsonl"
    f.write_text(json.dumps({"question_id": 5, "category": "math", "turns": ["one", "and two"], "answer": 3}) + "\n")
    (task,) = load_tasks(str(f), None)
    assert (task.id, task.prompt, task.turns, task.answer) == (5, "one", ("and two",), "3")
    assert task.protocol(True).chat is True
    f.write_text(json.dumps(SPEC_BENCH_ROWS[0]) + "\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(f))}:1: each task needs an 'answer'.*bench --prompts"):
        load_tasks(str(f), None)
