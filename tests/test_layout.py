"""The package's shape, measured from its own source: every import (top-level and inside
functions) goes down the layers core < infer < app < api < cli, never up and never round in a cycle,
and inside a layer down its stated order (INFER_ORDER: infer/'s folders; CORE_CONCERNS: core/'s modules
grouped by concern); the project's own modules are imported at the top of a module (only the CLI imports, inside its
commands, the modules that pull in torch, so `cactus --help` stays light); modules and functions
stay short (counted in statements) unless their docstring says why, and no module, nor any
benchmarks/ script, runs past 450 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "cactus_cli"
LAYERS = ("core", "infer", "app", "api", "cli")  # each imports only from those before it
MAX_MODULE_STATEMENTS = 300  # statements, not lines: packing code into wide lines does not shorten a module
MAX_FUNCTION_STATEMENTS = 50
MAX_MODULE_LINES = 450  # and in lines, with no exception: a file a newcomer reads in one sitting
FOLDERS = {  # each layer's folders, one per purpose (README's package map names them too)
    "core": (),
    "infer": ("backends", "decode", "draft", "kpolicy", "load", "pair"),
    "app": ("config", "data", "eval", "grid", "serve"),
    "cli": ("commands",),
}
# infer/'s places, bottom to top: a module imports only from its own place and the places below it
# (at the top and inside functions alike); places on one line are siblings and import none of each other
INFER_ORDER = (
    ("load",),  # what a model is, where its files are, what a device holds: core/ alone
    ("runner",),  # the Runner interface: a model that forwards tokens over its own cache
    ("draft", "kpolicy"),  # drafters (over runners); choosing k (its store's key handed in as data)
    ("backends", "backends.base"),  # the Backend interface (backends/__init__.py imports nothing)
    ("backends.torch", "backends.llama_cpp", "backends.vllm"),  # one folder a backend, all of it
    ("backends.registry",),  # BACKENDS: the one module that knows every backend
    ("pair",),  # choosing and loading a model pair; the cost store's key
    ("decode",),  # the engine, slots, batch, grammar, text: the top of infer/
)
INFER_EXCEPTIONS: dict[tuple[str, str], str] = {}  # (importer, imported) -> why it must stay; none today
# core/'s modules by concern, bottom to top: a module imports only from its own concern and those above it in this dict
CORE_CONCERNS = {
    "basics": ("defaults", "errors", "events"),  # built-in defaults, errors and warnings, what a step reports
    "io": ("paths", "fileio", "once", "signals", "conditions", "companions"),  # files, caches, signals, the machine
    "numbers": ("stats", "intervals"),  # a run's statistics, confidence intervals
    "rules": ("sampling", "acceptance", "verify", "exact"),  # sampling, the acceptance rules, verifying drafts
}
REASON = "Long because"  # a docstring that says why a module or function is longer
LAZY_OK = ("cactus_cli.cli.",)  # may import torch-heavy modules inside functions (startup time of --help)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
BENCHMARKS = sorted((ROOT.parent / "benchmarks").glob("*.py"))  # held to MAX_MODULE_LINES too


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
    inner = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    }
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
    upward = [
        f"{name}:{line} imports {target} ({LAYERS[layer(target) - 1]} is above {LAYERS[layer(name) - 1]})"
        for name, edges in GRAPH.items()
        for target, line, _ in edges
        if 0 < layer(name) <= len(LAYERS) and layer(target) > layer(name)
    ]
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
                return path[path.index(nxt) :] + [nxt]
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
    lazy = [
        f"{name}:{line} imports {target} inside a function; import it at the top"
        for name, edges in GRAPH.items()
        for target, line, inner in edges
        if inner and not (name.startswith(LAZY_OK) and heavy(target))
    ]
    assert not lazy, "\n".join(lazy)


def test_the_cli_stays_light():
    """`cactus --help` imports the CLI layer's top-level imports only: none of them pulls in torch."""
    offenders = [name for name in MODULES if name.startswith(LAZY_OK) and heavy(name)]
    assert not offenders, f"importing {offenders} imports torch; import the app layer inside the command"


def _has_reason(node: ast.AST) -> bool:
    return REASON in (ast.get_docstring(node) or "")


def statements(node: ast.AST) -> int:
    """Statements inside ``node`` (itself excluded): a measure of code, whatever its line width."""
    return sum(isinstance(n, ast.stmt) for n in ast.walk(node)) - isinstance(node, ast.stmt)


def test_modules_and_functions_are_short_or_say_why():
    long = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if statements(tree) > MAX_MODULE_STATEMENTS and not _has_reason(tree):
            long.append(f"{name}: {statements(tree)} statements")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if statements(node) > MAX_FUNCTION_STATEMENTS and not _has_reason(node):
                    long.append(f"{name}.{node.name}: {statements(node)} statements")
    assert not long, "\n".join(long)


def test_modules_stay_under_450_lines():
    """The package's modules and the benchmarks/ scripts alike (a script too long splits into siblings)."""
    files = {**MODULES, **{f"benchmarks/{p.name}": p for p in BENCHMARKS}}
    long = [
        f"{name}: {n} lines"
        for name, path in files.items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "\n".join(long)


def test_each_layer_holds_the_folders_it_names():
    """Folders say what they hold: a new folder is a decision, named here and in the README's map."""
    for top, named in FOLDERS.items():
        found = sorted(p.name for p in (ROOT / top).iterdir() if p.is_dir() and p.name != "__pycache__")
        assert found == sorted(named), f"{top}/ holds {found}; FOLDERS names {sorted(named)}"


def test_no_module_name_in_two_layers():
    """`cli/grid.py` beside `app/grid.py` made a reader open both: a module's name is its own."""
    seen: dict[str, str] = {}
    clashes = []
    for name in MODULES:
        stem = name.rpartition(".")[2]
        package = MODULES[name].name == "__init__.py"  # a folder may be named for the command it serves
        if layer(name) in (0, len(LAYERS) + 1) or package or stem == "base":
            continue
        if stem in seen and layer(seen[stem]) != layer(name):
            clashes.append(f"{seen[stem]} and {name}")
        seen.setdefault(stem, name)
    assert not clashes, "\n".join(clashes)


def test_the_length_check_counts_statements_not_lines(tmp_path, monkeypatch):
    """Code packed into a few wide lines is as long as it is."""
    wide = tmp_path / "_wide.py"
    wide.write_text("; ".join(f"x{i} = {i}" for i in range(MAX_MODULE_STATEMENTS + 1)) + "\n")
    monkeypatch.setitem(MODULES, "cactus_cli.core._wide", wide)
    with pytest.raises(AssertionError, match=f"cactus_cli.core._wide: {MAX_MODULE_STATEMENTS + 1} statements"):
        test_modules_and_functions_are_short_or_say_why()


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("from cactus_cli.app import runtime\n", "imports cactus_cli.app.runtime"),
        ("def f():\n    from cactus_cli.cli import options\n", "imports cactus_cli.cli.options"),
    ],
)
def test_the_checks_see_upward_imports_even_inside_functions(tmp_path, monkeypatch, bad, expected):
    """The checks above can fail: an upward import in core, at the top or in a function, is found."""
    fake = "cactus_cli.core._probe"
    path = tmp_path / "_probe.py"
    path.write_text(bad)
    monkeypatch.setitem(MODULES, fake, path)
    monkeypatch.setitem(GRAPH, fake, imports(fake))
    with pytest.raises(AssertionError, match=expected):
        test_every_import_goes_down_the_layers()


def test_the_tree_is_formatted_and_clean():
    """ruff format and ruff check (pyproject.toml: line length 120, pyflakes and import order)."""
    import subprocess
    import sys

    root = ROOT.parent
    paths = ["cactus_cli", "tests", "benchmarks"]
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *paths], cwd=root, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout[-2000:] + fmt.stderr[-500:]
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", *paths], cwd=root, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout[-2000:] + lint.stderr[-500:]


def named_in_comparisons(names: set[str], outside: str) -> list[str]:
    """Where a string in ``names`` is compared with something (``==``, ``!=``, ``in``, a match
    case), in modules outside ``outside``: code that decides by a registry entry's name."""
    found = []
    for name, path in MODULES.items():
        if name.startswith(outside):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                parts = [node.left, *node.comparators]
                consts = [c for p in parts for c in ([p] if isinstance(p, ast.Constant) else getattr(p, "elts", []))]
                hits = [c.value for c in consts if isinstance(c, ast.Constant) and c.value in names]
                if hits:
                    found.append(f"{name}:{node.lineno} compares with {hits[0]!r}")
    return found


def test_each_registry_is_the_only_place_its_kind_is_named():
    """Backends (infer/backends), model-free drafters (infer/draft) and acceptance rules
    (core/acceptance.py): nothing else decides by comparing a name, so adding one is one module
    and one registry line."""
    from cactus_cli.core.acceptance import RULES
    from cactus_cli.infer.backends.registry import BACKENDS
    from cactus_cli.infer.draft import KINDS

    assert not named_in_comparisons(set(BACKENDS), "cactus_cli.infer.backends")
    assert not named_in_comparisons(set(KINDS), "cactus_cli.infer.draft")
    assert not named_in_comparisons(set(RULES), "cactus_cli.core.acceptance")


def test_the_name_check_finds_a_comparison_with_a_registry_name(tmp_path, monkeypatch):
    """A module that decides by a backend's name, in any of the shapes code takes, is found."""
    planted = tmp_path / "_planted.py"
    planted.write_text('a = b == "llama.cpp"\nc = d in ("x", "torch")\n')
    monkeypatch.setitem(MODULES, "cactus_cli.app._planted", planted)
    assert named_in_comparisons({"llama.cpp", "torch"}, "cactus_cli.infer.backends") == [
        "cactus_cli.app._planted:1 compares with 'llama.cpp'",
        "cactus_cli.app._planted:2 compares with 'torch'",
    ]


def test_the_readme_and_docs_python_blocks_are_formatted():
    """The Python in README.md and docs/ reads as the code does: ``ruff format`` would not change it."""
    import re
    import subprocess
    import sys

    root = ROOT.parent
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            fmt = subprocess.run(
                [sys.executable, "-m", "ruff", "format", "--check", "--stdin-filename", "block.py", "-"],
                cwd=root,
                input=block,
                capture_output=True,
                text=True,
            )
            assert fmt.returncode == 0, f"{page.name}: a python block is not formatted:\n{block}"


def test_every_benchmark_script_still_names_what_exists():
    """Each benchmarks/*.py imports, and every ``module.name`` it reads from a project module exists:
    a refactor that renames what a script uses fails here, not on the day someone runs the script
    (three were broken by the drafter registry until this test). The scripts run only under main()."""
    import importlib.util
    import sys
    import types

    bench = ROOT.parent / "benchmarks"
    sys.path.insert(0, str(bench))  # (scripts import their neighbours: `from hostile_sweep import ...`)
    missing = []
    try:
        for path in sorted(bench.glob("*.py")):
            spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
            script = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = script  # (dataclasses look their module up there)
            try:
                spec.loader.exec_module(script)
            except ImportError as e:
                missing.append(f"{path.name}: {e}")
                continue
            finally:
                sys.modules.pop(spec.name, None)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    owner = getattr(script, node.value.id, None)
                    if (
                        isinstance(owner, types.ModuleType)
                        and owner.__name__.startswith("cactus_cli")
                        and not hasattr(owner, node.attr)
                    ):
                        missing.append(f"{path.name}:{node.lineno}: {owner.__name__}.{node.attr}")
    finally:
        sys.path.remove(str(bench))
    assert not missing, missing


def infer_place(name: str) -> tuple[int, str] | None:
    """(level in INFER_ORDER, place) of an infer/ module: its longest place prefix; None outside infer/."""
    parts = name.split(".")
    if parts[:2] != ["cactus_cli", "infer"]:
        return None
    rest = parts[2:]
    if not rest:  # infer/__init__.py: a docstring
        return -1, ""
    found = [
        (len(place.split(".")), level, place)
        for level, places in enumerate(INFER_ORDER)
        for place in places
        if rest[: len(place.split("."))] == place.split(".")
    ]
    assert found, f"{name} sits in no place of INFER_ORDER: name its folder there"
    _, level, place = max(found)
    return level, place


def test_infer_imports_go_down_its_stated_order():
    """infer/ in one direction: load/ at the bottom, then runner.py, the drafters and the k policy,
    the backends (each in a folder of its own, never importing another), their registry, pair/
    and decode/ at the top."""
    wrong = []
    for name, edges in GRAPH.items():
        here = infer_place(name)
        if here is None:
            continue
        for target, line, inner in edges:
            there = infer_place(target)
            if there is None or there[1] == here[1] or (name, target) in INFER_EXCEPTIONS:
                continue
            if there[0] > here[0] or (there[0] == here[0] and there[1] != here[1]):
                what = "a sibling" if there[0] == here[0] else "above it"
                where = " inside a function" if inner else ""
                wrong.append(f"{name}:{line} imports {target}{where} ({there[1] or 'infer'} is {what})")
    assert not wrong, "\n".join(wrong)


def test_infer_order_names_every_folder_and_no_exception_is_stale():
    infer = ROOT / "infer"
    for path in sorted(infer.rglob("*.py")):
        infer_place(module_name(path))  # (fails for a module in no place)
    for importer, imported in INFER_EXCEPTIONS:
        assert any(t == imported for t, _, _ in GRAPH.get(importer, ())), f"stale exception: {importer} -> {imported}"


def test_core_imports_go_down_its_concerns():
    """core/'s modules, grouped by concern bottom to top (CORE_CONCERNS), import only from their
    own concern and those below it; every module of core/ is in exactly one concern."""
    order = list(CORE_CONCERNS)
    concern = {m: c for c, mods in CORE_CONCERNS.items() for m in mods}
    core = {n for n in MODULES if n.startswith("cactus_cli.core.")}
    listed = sorted(f"cactus_cli.core.{m}" for m in concern)
    assert sorted(core) == listed, f"core/ holds {sorted(core)}; CORE_CONCERNS names {listed}"
    assert len(concern) == sum(len(m) for m in CORE_CONCERNS.values()), "a core module named in two concerns"
    wrong = [
        f"{name}:{line} imports {target} ({concern[b]} is above {concern[a]})"
        for name, edges in GRAPH.items()
        if name in core
        for target, line, _ in edges
        if target in core
        for a, b in [(name.rpartition(".")[2], target.rpartition(".")[2])]
        if order.index(concern[b]) > order.index(concern[a])
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "fake, bad, expected",
    [
        (
            "cactus_cli.infer.load._probe",
            "from cactus_cli.infer.pair import plan\n",
            "imports cactus_cli.infer.pair.plan",
        ),
        (
            "cactus_cli.infer.kpolicy._probe",
            "def f():\n    from cactus_cli.infer.backends import registry\n",
            "inside a function",
        ),
        (
            "cactus_cli.infer.backends.torch._probe",
            "from cactus_cli.infer.backends.llama_cpp import gguf\n",
            "is a sibling",
        ),
        ("cactus_cli.infer.draft._probe", "from cactus_cli.infer.kpolicy import costs\n", "is a sibling"),
        ("cactus_cli.core._probe_verify", "from cactus_cli.core import stats\n", "numbers is above"),
    ],
)
def test_the_order_checks_find_a_wrong_import(tmp_path, monkeypatch, fake, bad, expected):
    """The two checks above can fail: an import up infer/'s order (at the top or in a function),
    between two backends or two sibling places, or up core/'s concerns, is found."""
    path = tmp_path / "_probe.py"
    path.write_text(bad)
    monkeypatch.setitem(MODULES, fake, path)
    monkeypatch.setitem(GRAPH, fake, imports(fake))
    if fake.startswith("cactus_cli.core."):
        monkeypatch.setitem(CORE_CONCERNS, "basics", (*CORE_CONCERNS["basics"], fake.rpartition(".")[2]))
        check = test_core_imports_go_down_its_concerns
    else:
        check = test_infer_imports_go_down_its_stated_order
    with pytest.raises(AssertionError, match=expected):
        check()
