"""`cactus eval`: task accuracy beside speed, over the same grid as bench (one grid runner)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cactus_cli.cli import options as o
from cactus_cli.cli.grid import (
    DEFAULT_RULES,
    Backends,
    Compiles,
    Csv,
    Deltas,
    GridFlags,
    GridOutput,
    Ks,
    Meter,
    Quantizes,
    Rules,
    run_grid_command,
)


@o.shared_options(*o.MODEL_AND_SAMPLING)
def eval_cmd(
    rules: Rules = DEFAULT_RULES,
    deltas: Deltas = None,
    ks: Ks = None,
    compiles: Compiles = None,
    quantizes: Quantizes = None,
    backends: Backends = None,
    tasks_file: Annotated[Optional[Path], typer.Option("--tasks", help="JSONL file: 'prompt', 'answer', optional 'id', 'category' and 'pattern' (a regex whose first group is the answer). Default: the built-in set (40 arithmetic word problems, 8 code-output questions).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Use only the first N problems (the built-in set is interleaved by category).")] = None,
    category: Annotated[Optional[str], typer.Option("--category", help="Comma list of task categories to keep (built-in: arithmetic, code-output).")] = None,
    meter: Meter = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document (bench's schema plus accuracy fields and each answer) instead of the table.")] = False,
    csv_path: Csv = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Write eval.json, eval.csv and environment.json into this folder.")] = None,
    *,
    shared: o.Shared,
) -> None:
    """Task accuracy next to speed: exact-answer problems over the rule x delta x k grid of
    bench, with the verifier alone first (same problems, sampling and seeds). Answers are read
    the way GSM8K evaluations read them (after '####', else the last number, or a task's
    pattern) and compared after normalization; accuracy comes with a 95% Wilson interval.
    Ctrl-C stops early and still prints and saves what finished."""
    run_grid_command("eval", shared, GridFlags(rules, deltas, ks, compiles, quantizes, tasks_file, limit, category, meter,
                                             backends=backends),
                     GridOutput(as_json, csv_path, out_dir))


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
