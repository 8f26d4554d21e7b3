"""What bench and eval share: the grid options, declared once, and the command body that parses
them, runs the one grid sweep (app/grid/sweep.py) and prints and writes the results."""

from __future__ import annotations

import functools
import inspect
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from cactus_cli.app.eval.tasks import grader, load_tasks
from cactus_cli.app.prompts import load_prompts
from cactus_cli.cli import options as o
from cactus_cli.cli import tables, ui
from cactus_cli.cli.edge import user_errors
from cactus_cli.core import defaults
from cactus_cli.core.errors import CactusError, ConfigError
from cactus_cli.core.fileio import check_output_dir, check_output_file, write_or_fail

Rules = Annotated[
    str,
    typer.Option("--rules", help="Comma list of rules ({rules}).", rich_help_panel=o.DECODING),
]
Deltas = Annotated[
    Optional[str],
    typer.Option(
        "--delta",
        "-d",
        help="Comma list of delta values for the rules that take one: {delta_rules} (default: the profile's).",
        rich_help_panel=o.DECODING,
    ),
]
Ks = Annotated[
    Optional[str],
    typer.Option(
        "--num-draft-tokens",
        "-k",
        help="Comma list of draft lengths, `auto` included (default: the profile's).",
        rich_help_panel=o.DECODING,
    ),
]
Compiles = Annotated[
    Optional[str],
    typer.Option(
        "--compile",
        help="Comma list of auto, on, off: time eager and compiled engines side by side, e.g. --compile off,on (default: the profile's).",
        rich_help_panel=o.RUNTIME,
    ),
]
Quantizes = Annotated[
    Optional[str],
    typer.Option(
        "--quantize",
        help="Comma list of none, int8, int4, w8a8, auto: time quantized models side by side, e.g. --quantize none,int8,w8a8 (default: the profile's).",
        rich_help_panel=o.RUNTIME,
    ),
]
Backends = Annotated[
    Optional[str],
    typer.Option(
        "--backend",
        help="Comma list of {backend_names}: time backends side by side on the same files, each with its own verifier-alone row (default: the profile's). --quantize and --compile lists apply to the backends that take them.",
        rich_help_panel=o.RUNTIME,
    ),
]
Meter = Annotated[
    bool,
    typer.Option(
        "--meter", help="Also measure the realized divergence KL(h_alg || q) and TV per position (costs time)."
    ),
]
Csv = Annotated[Optional[Path], typer.Option("--csv", help="Also write one CSV row per configuration to this file.")]
DEFAULT_RULES = defaults.BENCH_RULES
MAX_CONCURRENCY = 64  # bench --concurrency at most (serve --parallel's bound)
AXES = {  # the grid's axes, bench's and eval's first options: name -> (annotation, default)
    "rules": (Rules, DEFAULT_RULES),
    "deltas": (Deltas, None),
    "ks": (Ks, None),
    "compiles": (Compiles, None),
    "quantizes": (Quantizes, None),
    "backends": (Backends, None),
}


@dataclass
class GridFlags:
    """The grid options as typed (comma lists, None = the profile's value)."""

    rules: str
    deltas: str | None
    ks: str | None
    compiles: str | None
    quantizes: str | None
    prompts_file: Path | None
    limit: int | None
    category: str | None
    meter: bool = False
    compare_hf: bool = False
    backends: str | None = None
    samples: int = 1  # eval: completions per problem
    resume: bool = False  # eval: go on with the run kept in --out
    unsafe_exec: bool = False  # eval: run code tasks without isolation (where it cannot be had)
    concurrency: str | None = None  # bench: requests served at once, a comma list


@dataclass
class GridAxes:
    """The grid's axes as typed (AXES), for the command to add its own flags to (``flags``)."""

    rules: str
    deltas: str | None
    ks: str | None
    compiles: str | None
    quantizes: str | None
    backends: str | None

    def flags(self, source: Path | None, limit: int | None, category: str | None, meter: bool, **own) -> GridFlags:
        """The GridFlags of these axes and the command's own options (``own``: GridFlags's keywords)."""
        axes = (self.rules, self.deltas, self.ks, self.compiles, self.quantizes)
        return GridFlags(*axes, source, limit, category, meter, backends=self.backends, **own)


def grid_command(fn: Callable) -> Callable:
    """bench's and eval's options: the grid's axes (AXES, declared once) first, then the command's
    own, then the model and sampling options (``o.shared_options``). The command takes
    ``axes: GridAxes`` and ``shared: o.Shared`` instead of the declarations."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "axes"]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    front = [inspect.Parameter(n, kind, annotation=a, default=d) for n, (a, d) in AXES.items()]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        axes = GridAxes(*(kwargs.pop(n) for n in AXES))
        return fn(*args, **kwargs, axes=axes)

    wrapper.__signature__ = sig.replace(parameters=front + own)  # what Typer reads
    return o.shared_options(*o.MODEL_AND_SAMPLING)(wrapper)


@dataclass
class GridOutput:
    as_json: bool
    csv_path: Path | None
    out_dir: Path | None
    plot: Path | None = None  # bench --plot: the speed / divergence trade-off (needs --meter)


def run_grid_command(kind: str, shared: o.Shared, flags: GridFlags, output: GridOutput) -> None:
    """bench and eval: the same grid (variants x rules x delta x k, the verifier alone first),
    the same runner, the same outputs; eval also grades each answer."""
    with user_errors():
        settings, lists, prompts, grade = _parse(kind, shared, flags)
        if output.plot is not None and not flags.meter:
            raise ConfigError("--plot draws speed against the realized divergence: add --meter")
        output = _check_outputs(output)
        from cactus_cli.app.grid import configs, report, variants
        from cactus_cli.app.grid import sweep as g
        from cactus_cli.app.runtime import generation_params

        err = ui.make_console(no_color=shared.no_color, stderr=True)
        from cactus_cli.infer.backends.registry import drives

        if any(drives(b) for b in lists["backend"]):
            return _on_vllm(kind, settings, lists, prompts, flags, output, shared, err)
        if remembered := settings.draft_params.get("remember"):
            err.print(
                f"{kind} does not use the profile's remember: {remembered} (each row's history starts "
                "empty, or rows would draft from earlier runs' answers to the same prompts)",
                style="yellow",
            )
            kept = {k: v for k, v in settings.draft_params.items() if k != "remember"}
            settings = replace(settings, draft_params=kept)
        with ui.LoadProgress(err) as progress:
            engines, encoded = variants.load_engines(
                settings,
                prompts,
                progress,
                quantizes=lists["quantize"],
                compiles=lists["compile"],
                drafts=lists["draft"],
                ks=lists["k"],
                crosses=lists["cross"],
                backends=lists["backend"],
                sequences=max(lists["concurrency"]),
            )
        grid = configs.build_grid(
            lists["rules"],
            lists["delta"],
            lists["k"],
            settings.rule_params,
            flags.compare_hf,
            settings.max_draft_tokens,
            list(engines),
            lists["concurrency"],
        )
        base = replace(generation_params(settings), measure=flags.meter)
        results: list = []
        interrupted = False
        keep = _checkpoint(kind, settings, grid, prompts, flags, output)
        todo = [p for p in prompts if keep is None or p.id not in keep.done]
        with ui.bench_progress(err, len(grid) * len(todo) * flags.samples) as advance:
            on_problem = _on_problem(kind, keep, results, len(prompts), advance, err)
            try:
                if todo:
                    for e in engines.values():
                        g.warm_up(e, encoded[0][1], base, max(c.k for c in grid))
                g.run_grid(
                    engines,
                    grid,
                    encoded,
                    base,
                    lambda cfg: advance(1, cfg.label),
                    results,
                    grade,
                    flags.samples,
                    keep.done if keep else None,
                    on_problem,
                )
            except KeyboardInterrupt:
                interrupted = True
        engine = next(iter(engines.values()))
        asked = {**settings.to_dict(), "cross_vocab": ",".join(lists["cross"])}  # (every method asked for)
        env = {
            **report.environment(engine, asked),
            "cross_vocab": ",".join(dict.fromkeys(v[4] for v in engines if v[4])) or None,
            "backend": ",".join(dict.fromkeys(v[0] for v in engines)),
        }
        doc = report.document(
            results, env, asked, prompts, interrupted, engine.costs.describe(None, settings.max_draft_tokens)
        )
        _report(kind, doc, env, output, shared.no_color, err)
        if interrupted:
            err.print("interrupted: the results above cover what finished", style="yellow")
            raise typer.Exit(130)


def _on_vllm(
    kind: str, settings, lists: dict, prompts: list, flags: GridFlags, output: GridOutput, shared, err
) -> None:
    """bench --backend vllm: the same grid and report, its rows run by vLLM's engine (app/on_vllm.py)."""
    from cactus_cli.app import on_vllm
    from cactus_cli.app.grid import configs, report
    from cactus_cli.infer.backends.registry import backend_of

    backend = lists["backend"][0]
    if kind not in backend_of(backend).commands or len(lists["backend"]) > 1:
        raise ConfigError(f"--backend {backend} runs bench alone (one backend); {kind} runs on cactus's engine")
    if flags.compare_hf:
        raise ConfigError("--compare-hf times transformers' generate; it does not apply to --backend vllm")
    if len(lists["draft"]) > 1 or len(lists["cross"]) > 1 or lists["quantize"] != [settings.quantize]:
        raise ConfigError("--backend vllm runs one --draft, one --cross-vocab and the profile's --quantize")
    ks = list(dict.fromkeys(on_vllm.AUTO_K if k == "auto" else k for k in lists["k"]))
    if "auto" in lists["k"]:
        err.print(
            f"-k auto: vLLM drafts a fixed k per engine; running k {on_vllm.AUTO_K} (give -k N to choose)", style="dim"
        )
    variant = [(backend, "none", False, lists["draft"][0], "")]
    grid = configs.build_grid(
        lists["rules"],
        lists["delta"],
        ks,
        settings.rule_params,
        False,
        settings.max_draft_tokens,
        variant,
        lists["concurrency"],
    )
    results: list = []
    interrupted, failed = False, None
    env: dict = {}
    with ui.bench_progress(err, len(grid) * len(prompts)) as advance:
        try:
            on_vllm.run_grid(
                settings,
                grid,
                prompts,
                lists["concurrency"],
                results,
                lambda cfg: advance(1, cfg.label),
                lambda line: err.print(line, style="dim", highlight=False),
                env,
            )
        except KeyboardInterrupt:
            interrupted = True
        except CactusError as problem:  # (a later engine that does not start: the rows done are kept)
            interrupted, failed = True, problem
    env = {**report.environment_here(), **env, "verifier": settings.verifier, "draft": settings.draft}
    doc = report.document(results, env, settings.to_dict(), prompts, interrupted, None)
    if results or failed is None:
        _report(kind, doc, env, output, shared.no_color, err)
    if failed is not None:
        raise failed
    if interrupted:
        err.print("interrupted: the results above cover what finished", style="yellow")
        raise typer.Exit(130)


def _checkpoint(kind: str, settings, grid: list, prompts: list, flags: GridFlags, output: GridOutput):
    """eval --out DIR: the problems finished so far, kept as they finish (app/eval/checkpoint.py)."""
    if flags.resume and output.out_dir is None:
        raise ConfigError("--resume goes on with the run kept in --out DIR; give --out")
    if kind != "eval" or output.out_dir is None:
        return None
    from cactus_cli.app.eval.checkpoint import Checkpoint, run_of

    run = run_of(settings.to_dict(), [c.label for c in grid], flags.samples, [p.id for p in prompts])
    rows = {c.label: {"rule": c.rule, "rule_params": c.rule_kwargs} for c in grid}
    return Checkpoint(output.out_dir, run, flags.resume, rows)


def _on_problem(kind: str, keep, results: list, total: int, advance, err):
    """After each problem: keep it (eval --out), and say how far the run is and pass@1 so far
    (the bar's label on a terminal, a line per problem otherwise)."""
    import time

    if kind != "eval":
        return None
    t0, start = time.monotonic(), len(keep.done) if keep else 0
    count = [start]

    def on_problem(prompt, made) -> None:
        if keep is not None:
            keep.add(prompt.id, made)
        count[0] += 1
        done = count[0]
        rates = ", ".join(f"{r.config.label.split(' · ')[0]} {r.correct / r.graded:.2f}" for r in results if r.graded)
        left = (time.monotonic() - t0) / (done - start) * (total - done)
        line = (
            f"{done}/{total} problems · pass@1 so far: {rates} · ETA {int(left // 3600)}h{int(left % 3600 // 60):02d}m"
        )
        if err.is_terminal:
            advance(0, f"{done}/{total}")
        else:
            err.print(line, highlight=False, soft_wrap=True)

    return on_problem


def _parse(kind: str, shared: o.Shared, flags: GridFlags) -> tuple[Any, dict[str, list], list, Any]:
    """Settings, the parsed lists, the prompts (or tasks) and the grader, all checked before any
    model loads."""
    from cactus_cli.app.config.parsing import parse_ks, parse_list, uses_lookup
    from cactus_cli.app.config.profile_files import resolve_settings
    from cactus_cli.app.config.settings import check_each
    from cactus_cli.app.grid import configs
    from cactus_cli.app.grid import sweep as g

    crosses = None  # bench and eval take a comma list: each method a variant of the drafts of another vocabulary
    if isinstance(shared.flags.get("cross_vocab"), str):
        crosses = parse_list(shared.flags["cross_vocab"], str, "--cross-vocab")
        check_each("cross_vocab", crosses, "--cross-vocab")
        shared = replace(shared, flags={**shared.flags, "cross_vocab": crosses[0]})
    settings = resolve_settings(shared.profile, shared.flags)
    if settings.draft is None:
        raise ConfigError(f"{kind} compares speculative decoding with the verifier alone: it needs a --draft")
    if flags.compare_hf and settings.tp > 1:
        raise ConfigError("--compare-hf runs transformers' own generate, which cannot drive a --tp group; drop one")
    drafts = g.parse_drafts(settings.draft)
    if flags.compare_hf and (len(drafts) > 1 or uses_lookup(drafts[0])):
        raise ConfigError("--compare-hf compares draft-model drafting; use one --draft MODEL (no ngram or suffix)")
    lists = {
        "draft": drafts,
        "cross": crosses or [settings.cross_vocab],
        "delta": parse_list(flags.deltas, float, "--delta") if flags.deltas else [settings.param("delta")],
        "k": parse_ks(flags.ks) if flags.ks else [settings.num_draft_tokens],
        "rules": parse_list(flags.rules, str, "--rules"),
        "compile": parse_list(flags.compiles, str, "--compile") if flags.compiles else [settings.compile],
        "quantize": parse_list(flags.quantizes, str, "--quantize") if flags.quantizes else [settings.quantize],
        "backend": parse_list(flags.backends, str, "--backend") if flags.backends else [settings.backend],
        "concurrency": parse_list(flags.concurrency, int, "--concurrency") if flags.concurrency else [1],
    }
    if any(not 1 <= n <= MAX_CONCURRENCY for n in lists["concurrency"]):
        raise ConfigError(f"--concurrency: give whole numbers from 1 to {MAX_CONCURRENCY}, e.g. 1,2,4,8")
    if lists["concurrency"] != [1] and flags.compare_hf:
        raise ConfigError("--compare-hf times transformers' generate one request at a time; drop --concurrency")
    check_each("compile", lists["compile"], "--compile")
    check_each("quantize", lists["quantize"], "--quantize")
    check_each("backend", lists["backend"], "--backend")
    configs.build_grid(
        lists["rules"], lists["delta"], lists["k"], settings.rule_params, flags.compare_hf, settings.max_draft_tokens
    )  # checks every rule, delta and k now
    _check_sweep_flags(lists["rules"], flags.deltas, lists["k"], shared.flags)
    categories = parse_list(flags.category, str, "--category") if flags.category else None
    source = str(flags.prompts_file) if flags.prompts_file else None
    grade = None
    if flags.samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {flags.samples}")
    if kind == "eval":
        prompts = load_tasks(source, flags.limit, categories)
        grade = grader(prompts, flags.unsafe_exec, lambda line: print(f"warning: {line}", file=sys.stderr))
    elif flags.unsafe_exec:
        raise ConfigError("--unsafe-exec applies to eval's code tasks")
    else:
        prompts = load_prompts(source, flags.limit, categories)
    if settings.seed is None:
        settings = replace(settings, seed=0)  # a benchmark is reproducible by default
    return settings, lists, prompts, grade


def _check_outputs(output: GridOutput) -> GridOutput:
    """A 30-minute run must not die at the end on a path it could have checked now."""

    plot = o.check_plot(output.plot)
    return GridOutput(
        output.as_json,
        check_output_file(output.csv_path, "--csv") if output.csv_path else None,
        check_output_dir(output.out_dir, "--out") if output.out_dir else None,
        plot,
    )


def _report(kind: str, doc: dict, env: dict, output: GridOutput, no_color: bool, err) -> None:
    """Print first, then write: a failed write must not lose the results."""
    from cactus_cli.app.grid.report import csv_text

    if output.as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        console = ui.make_console(no_color=no_color)
        (tables.print_eval if kind == "eval" else tables.print_bench)(console, doc)
    if output.out_dir:
        write_or_fail(output.out_dir / f"{kind}.json", json.dumps(doc, indent=2), "--out")
        write_or_fail(output.out_dir / "environment.json", json.dumps(env, indent=2), "--out")
        write_or_fail(output.out_dir / f"{kind}.csv", csv_text(doc), "--out")
        err.print(f"wrote {output.out_dir}/{kind}.json, {kind}.csv, environment.json", style="dim")
    if output.csv_path:
        write_or_fail(output.csv_path, csv_text(doc), "--csv")
    if output.plot:
        o.draw_plot(tables.plot_tradeoff_png, doc, output.plot)
        err.print(f"wrote {output.plot}", style="dim")


def _check_sweep_flags(rules: list[str], deltas: str | None, ks: list, flags: dict) -> None:
    """A sweep option that no configuration of the grid would use is an error, not a no-op."""
    from cactus_cli.core.acceptance import RULES

    if deltas and not any("delta" in RULES[r].param_names() for r in rules):
        raise ConfigError(f"--delta has no effect with --rules {','.join(rules)}; add cactus or cactus-exact")
    if flags.get("max_draft_tokens", ...) is not ... and "auto" not in ks:
        raise ConfigError("--max-draft-tokens only applies with -k auto; add auto to -k")
