"""`cactus calibrate`: measure, then choose delta and k for a model pair; optionally save them."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from cactus_cli.app.eval.tasks import grader, load_tasks
from cactus_cli.app.prompts import load_prompts
from cactus_cli.cli import options as o
from cactus_cli.cli import tables, ui
from cactus_cli.cli.edge import user_errors
from cactus_cli.core.errors import ConfigError

Plot = o.plot_option("Draw delta vs accepted length vs realized divergence to this PNG.")


@o.shared_options(*o.MODEL_AND_SAMPLING, "rule", "compile", "quantize", "backend")
def calibrate(
    deltas: Annotated[
        Optional[str],
        typer.Option(
            "--delta",
            "-d",
            help="Comma list of delta values to sweep (0 is always added). Default: 0,0.1,0.25,0.5,0.75,1,1.5,2.",
            rich_help_panel=o.DECODING,
        ),
    ] = None,
    ks: Annotated[
        Optional[str],
        typer.Option(
            "--num-draft-tokens",
            "-k",
            help="Comma list of candidate k (default 1..12), timed against the verifier alone and -k auto; the delta sweep runs at the profile's k (for auto: the candidate nearest 4).",
            rich_help_panel=o.DECODING,
        ),
    ] = None,
    max_divergence: Annotated[
        Optional[float],
        typer.Option(
            "--max-divergence", help="Largest mean realized KL(h_alg || q) per token, in nats (default 0.05)."
        ),
    ] = None,
    max_quality_drop: Annotated[
        Optional[float],
        typer.Option(
            "--max-quality-drop", help="Largest drop in mean verifier log-likelihood per token vs SpS, in nats."
        ),
    ] = None,
    max_accuracy_drop: Annotated[
        Optional[float],
        typer.Option(
            "--max-accuracy-drop",
            help="With --tasks: largest drop in accuracy (pass@1 for code tasks), in points, against delta = 0 (SpS) over the same problems (paired); a delta whose 95% interval excludes zero is refused too.",
        ),
    ] = None,
    min_acceptance_gain: Annotated[
        Optional[float],
        typer.Option(
            "--min-acceptance-gain",
            help="Smallest gain worth a delta: accepted draft tokens per step over delta = 0's (SpS), e.g. 1.2. A delta that buys less is not taken.",
        ),
    ] = None,
    prompts_file: Annotated[
        Optional[Path],
        typer.Option(
            "--prompts",
            help="JSONL prompts, as for bench (default: the built-in set; a line nested deeper than about 1,000 levels is refused).",
        ),
    ] = None,
    tasks_file: Annotated[
        Optional[Path],
        typer.Option(
            "--tasks",
            help="Calibrate on graded tasks instead of prompts: `humaneval` or a task file, as for `cactus eval` (code tasks RUN THE MODEL'S CODE, isolated). Give --limit too: accuracy needs many problems.",
        ),
    ] = None,
    unsafe_exec: Annotated[
        bool,
        typer.Option(
            "--unsafe-exec",
            help="With code --tasks: run the model's code WITHOUT isolation where this machine cannot isolate it (as for cactus eval).",
        ),
    ] = False,
    limit: Annotated[int, typer.Option("--limit", help="Number of prompts.")] = 8,
    plot: Plot = None,
    save: Annotated[
        Optional[str],
        typer.Option(
            "--save", help="Write the chosen delta and k (and a calibration block) to a user profile NAME or a PATH."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole sweep as one JSON document.")] = False,
    *,
    shared: o.Shared,
) -> None:
    """Choose delta and k for a model pair from measurements: sweep delta with the divergence
    meter on, keep the largest delta within the divergence budget (and the quality, accuracy and
    acceptance-gain bounds given; none met: SpS, delta = 0), then time the k values the cost model
    ranks best and keep the fastest. The rule is the profile's, or Cactus where the profile decodes
    with SpS (the default: delta = 0 is SpS). With --tasks each delta's answers are graded (give
    --limit and -n large enough for whole answers)."""
    with user_errors():
        from cactus_cli.app.config.parsing import parse_list
        from cactus_cli.app.grid import calibration as cal_mod
        from cactus_cli.app.grid import report
        from cactus_cli.app.grid import sweep as b
        from cactus_cli.app.session import Session

        settings, constraints = _settings(
            shared, max_divergence, max_quality_drop, max_accuracy_drop, min_acceptance_gain, tasks_file is not None
        )
        delta_list = parse_list(deltas, float, "--delta") if deltas else list(cal_mod.DEFAULT_DELTAS)
        k_list = parse_list(ks, int, "-k") if ks else list(cal_mod.DEFAULT_KS)
        cal_mod.validate(settings, delta_list, k_list)
        target, plot = _check_outputs(save, plot)
        prompts, grade = _prompts(prompts_file, tasks_file, limit, max_accuracy_drop, unsafe_exec)

        err = ui.make_console(no_color=shared.no_color, stderr=True)
        with ui.LoadProgress(err) as progress:
            session = Session.load(settings=settings, reporter=progress)
            encoded = session.encode_prompts(prompts)
            longest = b.longest_prompt(session.tokenizer, encoded, settings.max_tokens)
            session.prepare(longest, progress, k_values=[*k_list, "auto"])
            engine = session.engine  # (the grid sweep that bench and eval share takes the engine)
        base = session.params()
        runs = (len(set(delta_list) | {0.0}) + 2 + min(cal_mod.KEEP_K + 1, len(set(k_list)))) * len(prompts)
        with ui.bench_progress(err, runs) as advance:
            b.warm_up(engine, encoded[0][1], base, max(k_list))
            cal = cal_mod.run(
                engine,
                settings,
                encoded,
                base,
                delta_list,
                k_list,
                constraints,
                lambda label: advance(1, label),
                grade,
            )
        if cal.interrupted:
            _report_interrupted(cal, err)
        doc = cal_mod.document(
            cal,
            settings,
            prompts,
            constraints,
            report.environment(engine, settings.to_dict()),
        )
        _report(doc, cal, settings, shared, target, plot, as_json, err)


def _prompts(
    prompts_file: Path | None, tasks_file: Path | None, limit: int, max_accuracy_drop: float | None, unsafe: bool
):
    """The prompts, or with --tasks the graded tasks and their grader."""
    if prompts_file is not None and tasks_file is not None:
        raise ConfigError("--prompts and --tasks: give one (tasks are prompts with a grade)")
    if max_accuracy_drop is not None and tasks_file is None:
        raise ConfigError("--max-accuracy-drop needs --tasks (humaneval or a task file) to measure accuracy on")
    if max_accuracy_drop is not None and not (0 <= max_accuracy_drop <= 100):
        raise ConfigError(f"--max-accuracy-drop must be in 0..100 points, got {max_accuracy_drop:g}")
    if tasks_file is not None:
        tasks = load_tasks(str(tasks_file), limit)
        return tasks, grader(tasks, unsafe, lambda line: print(f"warning: {line}", file=sys.stderr))
    if unsafe:
        raise ConfigError("--unsafe-exec applies to code --tasks")
    return load_prompts(str(prompts_file) if prompts_file else None, limit), None


def _settings(
    shared: o.Shared,
    max_divergence: float | None,
    max_quality_drop: float | None,
    max_accuracy_drop: float | None,
    min_acceptance_gain: float | None,
    graded: bool,
):
    """The run's settings (seed 0 unless given; 64 tokens per prompt unless given, or with --tasks
    the profile's cap: an answer cut short fails its grade) and the constraints on delta."""
    from cactus_cli.app.config.profile_files import resolve_settings
    from cactus_cli.app.grid import calibration as cal_mod
    from cactus_cli.core.acceptance import RULES

    settings = resolve_settings(shared.profile, shared.flags)
    if shared.flags.get("rule", ...) is ... and RULES[settings.rule].lossless:
        settings = replace(settings, rule="cactus")  # a profile of SpS (the default): Cactus's delta, from 0 (SpS)
    if settings.draft is None:
        raise ConfigError("calibrate needs a --draft model")
    if settings.temperature == 0:
        raise ConfigError("calibrate needs sampling: at temperature 0 every rule is greedy and delta has no effect")
    budget = cal_mod.DEFAULT_MAX_DIVERGENCE if max_divergence is None else max_divergence
    for flag, value in (("--max-divergence", budget), ("--max-quality-drop", max_quality_drop)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{flag} must be a finite number >= 0, got {value!r}")
    if min_acceptance_gain is not None and not (math.isfinite(min_acceptance_gain) and min_acceptance_gain > 0):
        raise ConfigError(
            f"--min-acceptance-gain must be a finite number > 0 (1.2: 20% more), got {min_acceptance_gain!r}"
        )
    if settings.seed is None:
        settings = replace(settings, seed=0)
    if shared.flags.get("max_tokens", ...) is ... and not graded:
        settings = replace(settings, max_tokens=64)  # enough tokens per prompt to measure, short enough to sweep
    constraints = cal_mod.Constraints(budget, max_quality_drop, max_accuracy_drop, min_acceptance_gain)
    return settings, constraints


def _check_outputs(save: str | None, plot: Path | None) -> tuple[Path | None, Path | None]:
    """--save and --plot checked before the run: a long calibration must not die at the end."""
    from cactus_cli.app.grid import calibrated_profile

    target = calibrated_profile.save_target(save) if save else None
    plot = o.check_plot(plot)
    if target is not None:
        calibrated_profile.check_save_target(target)
    return target, plot


def _report(
    doc: dict, cal, settings, shared: o.Shared, target: Path | None, plot: Path | None, as_json: bool, err
) -> None:
    """Print first, then write: a failed write must not lose a finished calibration."""
    from cactus_cli.app.grid.calibrated_profile import save_profile

    if target is not None:
        doc["saved_profile"] = str(target)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        tables.print_calibration(ui.make_console(no_color=shared.no_color), doc)
    if plot is not None:
        o.draw_plot(tables.plot_calibration_png, doc, plot)
        if not as_json:
            err.print(f"wrote {plot}", style="dim")
    if target is not None:
        save_profile(target, shared.profile, settings, doc)
        if not as_json:
            err.print(f"saved delta={cal.chosen_delta:g} k={cal.chosen_k} to {target}", style="dim")


def _report_interrupted(cal, err) -> None:
    """Ctrl-C or SIGTERM: the measurements that finished, then exit 130 with nothing saved (a
    choice from an unfinished sweep would not be the one the options asked for)."""
    for row in cal.deltas:
        kl, acc, tps = row["realized_kl_mean"], row["mean_accepted_tokens_per_step"], row["tokens_per_second_metered"]
        err.print(
            f"delta={row['delta']:g} k={cal.k0}: accepted/step "
            + (f"{acc:.2f}" if acc is not None else "-")
            + ", KL/token "
            + (f"{kl:.4f}" if kl is not None else "-")
            + ", tok/s (metered) "
            + (f"{tps:.2f}" if tps is not None else "-")
        )
    chosen = f" (the finished sweep chose delta={cal.chosen_delta:g})" if cal.chosen_delta is not None else ""
    err.print(f"interrupted {cal.interrupted}: the rows above finished{chosen}; nothing saved", style="yellow")
    raise typer.Exit(130)


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)
