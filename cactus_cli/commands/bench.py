"""`cactus bench`: acceptance rules x delta x k side by side, against the verifier alone
(and optionally Hugging Face assisted generation), for humans (a table) and scripts (JSON/CSV)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from cactus_cli import options as o
from cactus_cli.commands import user_errors


# the grid options bench and eval share, declared once
Rules = Annotated[str, typer.Option("--rules", help="Comma list of rules: sps,cactus,cactus-exact,tas,topk,interp.", rich_help_panel=o.DECODING)]
Deltas = Annotated[Optional[str], typer.Option("--delta", "-d", help="Comma list of delta values for the rules that take one (default: the profile's).", rich_help_panel=o.DECODING)]
Ks = Annotated[Optional[str], typer.Option("--num-draft-tokens", "-k", help="Comma list of draft lengths, `auto` included (default: the profile's).", rich_help_panel=o.DECODING)]
Compiles = Annotated[Optional[str], typer.Option("--compile", help="Comma list of auto, on, off: time eager and compiled engines side by side, e.g. --compile off,on (default: the profile's).", rich_help_panel=o.RUNTIME)]
Quantizes = Annotated[Optional[str], typer.Option("--quantize", help="Comma list of none, int8, int4, auto: time weight-only quantized models side by side, e.g. --quantize none,int8 (default: the profile's).", rich_help_panel=o.RUNTIME)]
Meter = Annotated[bool, typer.Option("--meter", help="Also measure the realized divergence KL(h_alg || q) and TV per position (costs time).")]
Csv = Annotated[Optional[Path], typer.Option("--csv", help="Also write one CSV row per configuration to this file.")]


@o.shared_options(*o.MODEL_AND_SAMPLING)
def bench(
    rules: Rules = "sps,cactus",
    deltas: Deltas = None,
    ks: Ks = None,
    compiles: Compiles = None,
    quantizes: Quantizes = None,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts", help="JSONL file with 'prompt' and optional 'id', 'category' (default: the built-in set).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Use only the first N prompts (the built-in set is interleaved by category).")] = None,
    category: Annotated[Optional[str], typer.Option("--category", help="Comma list of prompt categories to keep (built-in: code, math, instructions, writing, grounded).")] = None,
    meter: Meter = False,
    compare_hf: Annotated[bool, typer.Option("--compare-hf", help="Also time transformers' assisted generation (constant k) on the same pair and prompts.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document (schema_version 1) instead of the table.")] = False,
    csv_path: Csv = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Write bench.json, bench.csv and environment.json into this folder.")] = None,
    *,
    shared: o.Shared,
) -> None:
    """Benchmark acceptance rules, delta and k on one model pair, with the verifier-alone
    baseline always included (same prompts, sampling and seeds). Ctrl-C stops early and
    still prints and saves what finished."""
    run_grid_command("bench", shared, rules, deltas, ks, compiles, quantizes, prompts_file, limit, category, meter,
                     compare_hf, as_json, csv_path, out_dir)


def run_grid_command(kind: str, shared: o.Shared, rules: str, deltas: str | None, ks: str | None,
                     compiles: str | None, quantizes: str | None, prompts_file: Path | None, limit: int | None,
                     category: str | None, meter: bool, compare_hf: bool, as_json: bool, csv_path: Path | None,
                     out_dir: Path | None) -> None:
    """bench and eval: the same grid (variants x rules x delta x k, the verifier alone first),
    the same runner, the same outputs; eval also grades each answer."""
    with user_errors():
        from cactus_cli import bench as b
        from cactus_cli.config import resolve_settings
        from cactus_cli.errors import ConfigError

        settings = resolve_settings(shared.profile, shared.flags)
        if settings.draft is None:
            raise ConfigError(f"{kind} compares speculative decoding with the verifier alone: it needs a --draft")
        if compare_hf and settings.tp > 1:
            raise ConfigError("--compare-hf runs transformers' own generate, which cannot drive a --tp group; drop one")
        if compare_hf and settings.draft.startswith("ngram"):
            raise ConfigError("--compare-hf compares draft-model drafting; use a --draft MODEL without ngram")
        delta_list = b.parse_list(deltas, float, "--delta") if deltas else [settings.delta]
        k_list = b.parse_ks(ks) if ks else [settings.num_draft_tokens]
        rule_list = b.parse_list(rules, str, "--rules")
        compile_list = b.parse_list(compiles, str, "--compile") if compiles else [settings.compile]
        from cactus_cli.config import check_each

        check_each("compile", compile_list, "--compile")
        quantize_list = b.parse_list(quantizes, str, "--quantize") if quantizes else [settings.quantize]
        check_each("quantize", quantize_list, "--quantize")
        grid = b.build_grid(rule_list, delta_list, k_list, settings.rule_params, compare_hf, settings.max_draft_tokens)
        _check_sweep_flags(rule_list, deltas, k_list, shared.flags)
        categories = b.parse_list(category, str, "--category") if category else None
        grade = None
        if kind == "eval":
            from cactus_cli.tasks import is_correct, load_tasks

            prompts = load_tasks(str(prompts_file) if prompts_file else None, limit, categories)
            grade = is_correct
        else:
            from cactus_cli.prompts import load_prompts

            prompts = load_prompts(str(prompts_file) if prompts_file else None, limit, categories)
        if settings.seed is None:
            settings.seed = 0  # a benchmark is reproducible by default
        # a 30-minute run must not die at the end on a path it could have checked now
        from cactus_cli.fileio import check_output_dir, check_output_file, write_or_fail

        if out_dir is not None:
            out_dir = check_output_dir(out_dir, "--out")
        if csv_path is not None:
            csv_path = check_output_file(csv_path, "--csv")

        from cactus_cli import runtime, ui

        err = ui.make_console(no_color=shared.no_color, stderr=True)
        with ui.LoadProgress(err) as progress:
            engines: dict = {}
            for quantize in quantize_list:  # a pair in memory per quantization, an engine per variant
                pair = None
                for mode in compile_list:
                    engine = runtime.load_engine(settings, progress, mode, pair, quantize)
                    pair = engine.pair
                    engines.setdefault((pair.verifier.quantize, engine.compiled), engine)
            engine = next(iter(engines.values()))
            encoded = runtime.encode_prompts(engine, prompts, settings.chat_template)
            longest = max(len(ids) for _, ids in encoded)
            for e in engines.values():
                runtime.prepare(e, settings, progress, longest, k_list)
            # a compiled engine that fell back to eager (the warning says why) is not a second variant
            ready: dict = {}
            for e in engines.values():
                ready.setdefault((e.pair.verifier.quantize, e.compiled), e)
            engines = ready
            grid = b.build_grid(rule_list, delta_list, k_list, settings.rule_params, compare_hf,
                                settings.max_draft_tokens, list(engines))
        base = runtime.generation_params(settings)
        base.measure = meter

        results: list = []
        interrupted = False
        with ui.bench_progress(err, len(grid) * len(prompts)) as advance:
            try:
                for e in engines.values():
                    b.warm_up(e, encoded[0][1], base, max(c.k for c in grid))
                b.run_grid(engines, grid, encoded, base, lambda cfg: advance(1, cfg.label), results, grade)
            except KeyboardInterrupt:
                interrupted = True
        env = b.environment(engine, settings.to_dict())
        doc = b.document(results, env, settings.to_dict(), prompts, interrupted,
                         engine.policy.describe(None, settings.max_draft_tokens))

        # print first, then write: a failed write must not lose the results
        if as_json:
            typer.echo(json.dumps(doc, indent=2))
        else:
            console = ui.make_console(no_color=shared.no_color)
            (ui.print_eval if kind == "eval" else ui.print_bench)(console, doc)
        if out_dir:
            write_or_fail(out_dir / f"{kind}.json", json.dumps(doc, indent=2), "--out")
            write_or_fail(out_dir / "environment.json", json.dumps(env, indent=2), "--out")
            write_or_fail(out_dir / f"{kind}.csv", b.csv_text(doc), "--out")
            err.print(f"wrote {out_dir}/{kind}.json, {kind}.csv, environment.json", style="dim")
        if csv_path:
            write_or_fail(csv_path, b.csv_text(doc), "--csv")
        if interrupted:
            err.print("interrupted: the results above cover what finished", style="yellow")
            raise typer.Exit(130)


def _check_sweep_flags(rules: list[str], deltas: str | None, ks: list, flags: dict) -> None:
    """A sweep option that no configuration of the grid would use is an error, not a no-op."""
    from cactus_cli.acceptance import RULES
    from cactus_cli.errors import ConfigError

    if deltas and not any("delta" in RULES[r].param_names() for r in rules):
        raise ConfigError(f"--delta has no effect with --rules {','.join(rules)}; add cactus or cactus-exact")
    if flags.get("max_draft_tokens", ...) is not ... and "auto" not in ks:
        raise ConfigError("--max-draft-tokens only applies with -k auto; add auto to -k")


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
