"""`cactus bench`: acceptance rules x delta x k side by side, against the verifier alone
(and optionally Hugging Face assisted generation), for humans (a table) and scripts (JSON/CSV)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cactus_cli.cli import options as o
from cactus_cli.cli.grid_options import Csv, GridAxes, GridOutput, Meter, grid_command, run_grid_command

Plot = o.plot_option(
    "Draw tokens/s and mean acceptance length against the realized divergence (one point per configuration, SpS at zero) to this PNG; needs --meter."
)


@grid_command
def bench(
    prompts_file: Annotated[
        Optional[Path],
        typer.Option(
            "--prompts",
            help="JSONL file (or a pipe), one object per line, with 'prompt' and optional 'id' (a string or an integer) and 'category' (default: the built-in set). A line nested deeper than about 1,000 levels is refused.",
        ),
    ] = None,
    limit: Annotated[
        Optional[int],
        typer.Option("--limit", help="Use only the first N prompts (the built-in set is interleaved by category)."),
    ] = None,
    category: Annotated[
        Optional[str],
        typer.Option(
            "--category",
            help="Comma list of prompt categories to keep (built-in: code, math, instructions, writing, grounded; and edit, 32 standard-library functions to change, used only when named).",
        ),
    ] = None,
    concurrency: Annotated[
        Optional[str],
        typer.Option(
            "--concurrency",
            help="Comma list of how many requests to serve at once, e.g. 1,2,4,8: each row's prompts are all submitted together and that many are stepped in one batch (as cactus serve --parallel N serves them); the table adds every answer's tokens over the wall time, each request's tok/s and time to first token (p50, p90).",
        ),
    ] = None,
    meter: Meter = False,
    compare_hf: Annotated[
        bool,
        typer.Option(
            "--compare-hf",
            help="Also time transformers' assisted generation (constant k) on the same pair and prompts.",
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON document (schema_version 1) instead of the table.")
    ] = False,
    csv_path: Csv = None,
    out_dir: Annotated[
        Optional[Path], typer.Option("--out", help="Write bench.json, bench.csv and environment.json into this folder.")
    ] = None,
    plot: Plot = None,
    *,
    axes: GridAxes,
    shared: o.Shared,
) -> None:
    """Benchmark acceptance rules, delta and k on one model pair, with the verifier-alone
    baseline always included (same prompts, sampling and seeds). Ctrl-C stops early and
    still prints and saves what finished."""
    flags = axes.flags(prompts_file, limit, category, meter, compare_hf=compare_hf, concurrency=concurrency)
    run_grid_command("bench", shared, flags, GridOutput(as_json, csv_path, out_dir, plot))


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
