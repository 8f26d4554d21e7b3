"""Writes cactus_cli/app/data/edit.jsonl, the built-in `edit` prompt category: real functions of
20-80 lines from CPython's standard library (Python Software Foundation License, NOTICE), each with an
instruction whose answer reproduces most of the function (type hints, renames, docstrings,
formatting, a small fix), the kind of request an editor or agent sends all day.

    python benchmarks/make_edit_prompts.py          # with the Python the data was made from (3.11.7)

The sources are read with ``inspect.getsource`` from the running interpreter's standard library;
the committed file was made with CPython 3.11.7, and another version writes slightly different
functions (so the file is committed, not made at run time). Where the instruction asks for a fix,
the bug is put in first, by one exact replacement that must match once.
"""

from __future__ import annotations

import importlib
import inspect
import json
import platform
import sys
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "cactus_cli" / "app" / "data" / "edit.jsonl"

HINTS = "Add type hints to every parameter and to the return value, and return the whole function."
# (source, instruction, optional bug: (text, replacement) applied once before the prompt is written)
EDITS: list[tuple[str, str, tuple[str, str] | None]] = [
    ("textwrap.dedent", HINTS, None),
    (
        "shutil.which",
        "Rename the parameter `cmd` to `command` everywhere in this function, docstring included, "
        "and return the whole function.",
        None,
    ),
    ("heapq.nsmallest", "Add type hints (from typing: Iterable, Callable, Any) and return the whole function.", None),
    (
        "base64._b32decode",
        "Rename the variable `l` to `original_length` everywhere and return the whole function.",
        None,
    ),
    (
        "difflib.get_close_matches",
        "Replace the %-formatting in the error messages with f-strings and return the whole function.",
        None,
    ),
    (
        "statistics.median_grouped",
        "The result is too large by exactly one interval width. Fix the bug and return the whole function.",
        ("L = x - interval / 2.0", "L = x + interval / 2.0"),
    ),
    ("urllib.parse.urlsplit", HINTS, None),
    (
        "urllib.parse.parse_qsl",
        "Rename the list `r` to `pairs` and the variable `nv` to `name_value_pair` "
        "everywhere, and return the whole function.",
        None,
    ),
    (
        "copy.deepcopy",
        "Rename the variable `y` to `result` everywhere in this function and return the whole function.",
        None,
    ),
    (
        "tempfile._mkstemp_inner",
        "Replace the one-line docstring with a Google-style docstring that describes "
        "every argument and the return value, and return the whole function.",
        None,
    ),
    (
        "random.Random.choices",
        "This method sometimes raises IndexError for the last element's weight. Fix the "
        "bug and return the whole method.",
        ("hi = n - 1", "hi = n"),
    ),
    ("colorsys.rgb_to_hls", "Add a docstring and type hints (floats) and return the whole function.", None),
    (
        "quopri.encode",
        "Replace `while 1:` with `while True:`, add type hints to the signature, and return the whole function.",
        None,
    ),
    (
        "inspect.cleandoc",
        "Rename `lines` to `doc_lines` and `margin` to `indent_width` everywhere, and return the whole function.",
        None,
    ),
    ("statistics.variance", HINTS, None),
    (
        "json.decoder.JSONArray",
        "Add a docstring that explains the arguments and the return value, and return the whole function.",
        None,
    ),
    (
        "difflib.SequenceMatcher.get_opcodes",
        "Rename the variable `tag` to `operation` everywhere in this method and return the whole method.",
        None,
    ),
    ("email.utils.formataddr", HINTS, None),
    (
        "urllib.parse.urlencode",
        "Convert every single-quoted string literal to double quotes (docstring "
        "unchanged) and return the whole function.",
        None,
    ),
    (
        "csv.Sniffer._guess_quote_and_delimiter",
        "Rename `regexp` to `pattern` and `delims` to `delimiter_counts` everywhere, and return the whole method.",
        None,
    ),
    ("mimetypes.MimeTypes.guess_type", HINTS, None),
    (
        "locale.format_string",
        "Add type hints and replace the docstring with a Google-style one, then return the whole function.",
        None,
    ),
    (
        "getopt.getopt",
        "Rename `opts` to `options` everywhere in this function (not in the docstring's first "
        "line) and return the whole function.",
        None,
    ),
    (
        "fractions.Fraction.limit_denominator",
        "Add a comment above each block of the continued-fraction loop "
        "saying what it does, and return the whole method.",
        None,
    ),
    (
        "statistics.linear_regression",
        "The intercept comes out with the wrong sign. Fix the bug and return the whole function.",
        ("else ybar - slope * xbar", "else slope * xbar - ybar"),
    ),
    ("shutil.copytree", HINTS, None),
    ("shutil.make_archive", "Rename `save_cwd` to `previous_cwd` everywhere and return the whole function.", None),
    (
        "contextlib.ExitStack.__exit__",
        "Add type hints to the method and to its nested function, and return the whole method.",
        None,
    ),
    ("gettext.c2py", "Replace the %-formatting with f-strings and return the whole function.", None),
    (
        "http.cookies._unquote",
        "Rename the parameter `str` to `text` (it shadows the built-in) everywhere, and return the whole function.",
        None,
    ),
    ("netrc.netrc._parse", "Replace `while 1:` with `while True:` everywhere and return the whole method.", None),
    (
        "heapq.merge",
        "Rename `h_append` to `push` and `_heapreplace` to `replace_top` everywhere, and return the whole function.",
        None,
    ),
]


def source(name: str) -> str:
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for attr in parts[i:]:
        obj = getattr(obj, attr)
    return textwrap.dedent(inspect.getsource(obj))


def main() -> None:
    rows = []
    for n, (name, instruction, bug) in enumerate(EDITS, start=1):
        code = source(name)
        lines = len(code.splitlines())
        if not 20 <= lines <= 80:
            raise SystemExit(f"{name}: {lines} lines, not 20-80")
        if bug is not None:
            if code.count(bug[0]) != 1:
                raise SystemExit(f"{name}: the bug's text occurs {code.count(bug[0])} times, not once")
            code = code.replace(*bug)
        rows.append(
            {
                "id": f"edit-{n}",
                "category": "edit",
                "source": f"{name} (CPython {platform.python_version()} standard library, PSF License)",
                "prompt": f"{instruction}\n\n```python\n{code}```",
            }
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts to {OUT} (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
