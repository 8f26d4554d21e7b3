"""The built-in prompt sets: the `edit` category (real standard-library functions with an instruction
whose answer reproduces most of them), used only when named, and `bench --category edit`."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

from typer.testing import CliRunner

from cactus_cli.app.prompts import EDIT_FILE, builtin_prompts, edit_prompts, load_prompts
from cactus_cli.cli.main import app

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
