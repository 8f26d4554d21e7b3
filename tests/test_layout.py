"""The package's shape, measured from its own source: every import (top-level and inside
functions) goes down the layers core < infer < app < cli, never up and never round in a cycle;
the project's own modules are imported at the top of a module (only the CLI imports, inside its
commands, the modules that pull in torch, so `cactus --help` stays light); modules and functions
stay short unless their docstring says why."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "cactus_cli"
LAYERS = ("core", "infer", "app", "cli")  # each imports only from those before it
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
REASON = "Long because"  # a docstring that says why a module or function is longer
LAZY_OK = ("cactus_cli.cli.",)  # may import torch-heavy modules inside functions (startup time of --help)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer(name: str) -> int:
    """0 for the package root, 1..4 for the layers, 5 for ``python -m cactus_cli``."""
    parts = name.split(".")
    if name == "cactus_cli.__main__":
        return len(LAYERS) + 1
    if len(parts) == 1:
        return 0
    assert parts[1] in LAYERS, f"{name} sits in no layer: put it under one of {', '.join(LAYERS)}"
    return LAYERS.index(parts[1]) + 1


def imports(name: str) -> list[tuple[str, int, bool]]:
    """(project module imported, line, inside a function) for every import statement."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from pkg import mod` imports the module; `from mod import name` the module alone
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):
            if target in MODULES and target != name:
                out.append((target, node.lineno, id(node) in inner))
    return out


GRAPH = {name: imports(name) for name in MODULES}


def test_every_import_goes_down_the_layers():
    upward = [f"{name}:{line} imports {target} ({LAYERS[layer(target) - 1]} is above {LAYERS[layer(name) - 1]})"
              for name, edges in GRAPH.items() for target, line, _ in edges
              if 0 < layer(name) <= len(LAYERS) and layer(target) > layer(name)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges = {name: {t for t, _, _ in out} for name, out in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for name in MODULES:
        if name not in state:
            cycle = visit(name)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def heavy(name: str, seen: frozenset = frozenset()) -> bool:
    """Whether importing ``name`` imports torch or transformers (through its top-level imports)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in HEAVY for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in HEAVY:
            return True
    return any(heavy(t, seen | {name}) for t, _, inner in GRAPH[name] if not inner and t not in seen)


HEAVY = ("torch", "transformers")


def test_the_project_imports_itself_at_the_top():
    """Inside a function only where it keeps `cactus --help` light: a CLI module importing a
    module that pulls in torch."""
    lazy = [f"{name}:{line} imports {target} inside a function; import it at the top"
            for name, edges in GRAPH.items() for target, line, inner in edges
            if inner and not (name.startswith(LAZY_OK) and heavy(target))]
    assert not lazy, "\n".join(lazy)


def test_the_cli_stays_light():
    """`cactus --help` imports the CLI layer's top-level imports only: none of them pulls in torch."""
    offenders = [name for name in MODULES if name.startswith(LAZY_OK) and heavy(name)]
    assert not offenders, f"importing {offenders} imports torch; import the app layer inside the command"


def _has_reason(node: ast.AST) -> bool:
    return REASON in (ast.get_docstring(node) or "")


def test_modules_and_functions_are_short_or_say_why():
    long = []
    for name, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES * 1.05 and not _has_reason(tree):  # (~400)
            long.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES and not _has_reason(node):
                    long.append(f"{name}.{node.name}: {size} lines")
    assert not long, "\n".join(long)


@pytest.mark.parametrize("bad, expected", [
    ("from cactus_cli.app import runtime\n", "imports cactus_cli.app.runtime"),
    ("def f():\n    from cactus_cli.cli import options\n", "imports cactus_cli.cli.options"),
])
def test_the_checks_see_upward_imports_even_inside_functions(tmp_path, monkeypatch, bad, expected):
    """The checks above can fail: an upward import in core, at the top or in a function, is found."""
    fake = "cactus_cli.core._probe"
    path = tmp_path / "_probe.py"
    path.write_text(bad)
    monkeypatch.setitem(MODULES, fake, path)
    monkeypatch.setitem(GRAPH, fake, imports(fake))
    with pytest.raises(AssertionError, match=expected):
        test_every_import_goes_down_the_layers()
