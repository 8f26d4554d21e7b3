"""The documentation holds together: every relative link in README.md and docs/*.md leads to a
file (and to a heading, where it names one), every cactus command in the README's bash blocks
parses (its subcommand and flags exist: Typer's own parser, with --help so nothing runs), and
no comment or docstring in the code cites a file the repository does not have."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cactus_cli.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # (code is not links)
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{page.name}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{page.name}: {target} (no such heading)")
    return bad


def test_every_relative_link_resolves():
    assert (ROOT / "docs").is_dir()
    bad = [b for page in PAGES for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nSee [the rules](nowhere.md), [here](#title) and [there](#nothing).\n")
    assert broken_links(page) == ["page.md: nowhere.md (no such file)", "page.md: #nothing (no such heading)"]


def readme_commands() -> list[list[str]]:
    """Each `cactus ...` command in the README's bash blocks, as argv after `cactus`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|\||;|\|", line):
                words = shlex.split(part.split(" #")[0], posix=True) if part.strip() else []
                while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value cactus ...
                    words = words[1:]
                if words and words[0] == "cactus":
                    out.append(words[1:])
    return out


def test_the_readme_shows_commands():
    assert len(readme_commands()) >= 8


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda a: " ".join(a)[:60])
def test_every_readme_command_parses(argv):
    r = CliRunner().invoke(app, [*argv, "--help"])
    assert r.exit_code == 0, f"cactus {' '.join(argv)}: {r.output[-500:]}"


def test_an_unknown_flag_fails_the_parse():
    assert CliRunner().invoke(app, ["generate", "hi", "--no-such-flag", "--help"]).exit_code != 0


CITED = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:py|md|yaml|toml|json))\b")
KNOWN_ELSEWHERE = {
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "bench.json",
    "eval.json",
    "environment.json",
    "progress.jsonl",
    "vocab.json",
    "generation_config.json",
    "default.yaml",
    "custom.yaml",
    "my.yaml",
    "profile.yaml",
    "check.py",
    "model.safetensors.index.json",
}


def cited_files(text: str) -> set[str]:
    return {m.group(1) for m in CITED.finditer(text)}


def missing(name: str) -> bool:
    if name in KNOWN_ELSEWHERE or name.startswith(("torch/", "transformers/", "vllm/", "v1/", "generation/")):
        return False
    for base in (ROOT, ROOT / "cactus_cli", ROOT / "cactus_cli" / "infer", ROOT / "cactus_cli" / "app"):
        if (base / name).exists():
            return False
    return not any(ROOT.glob(f"**/{Path(name).name}"))  # a bare name: any file so called in the tree


def test_no_comment_cites_a_file_that_is_not_there():
    import ast
    import io
    import tokenize

    bad = []
    for path in sorted((ROOT / "cactus_cli").rglob("*.py")):
        src = path.read_text(encoding="utf-8")
        texts = [t.string for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT]
        texts += [
            ast.get_docstring(n) or ""
            for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        ]
        for text in texts:
            bad += [f"{path.relative_to(ROOT)}: {name}" for name in sorted(cited_files(text)) if missing(name)]
    assert not bad, "\n".join(bad)


def test_the_readme_package_map_names_every_folder():
    """A newcomer's map: each folder the README's package map names exists, and every folder of the
    package is named in it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## How it works", 1)[1].split("```", 2)[1]
    entries = [line.split()[0] for line in block.splitlines() if line.startswith("  ") and line.split()]
    named = {e.rstrip("/") for e in entries if e.endswith("/")}
    package = ROOT / "cactus_cli"
    folders = {str(p.relative_to(package)) for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    assert named, "no package map under 'How it works'"
    assert not named - folders, f"the map names folders that do not exist: {sorted(named - folders)}"
    assert not folders - named, f"folders the map does not name: {sorted(folders - named)}"
