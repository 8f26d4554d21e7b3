"""`cactus generate PROMPT`: one-shot generation with the live view, plain text or JSON."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from cactus_cli.cli import options as o
from cactus_cli.cli import ui
from cactus_cli.cli.edge import user_errors
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.fileio import clean_text, decode_input


@o.shared_options(*o.GENERATION)
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt, or - to read it from stdin.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: text, settings, stats.")] = False,
    plain: Annotated[bool, typer.Option("--plain", help="Stream plain text even on a terminal.")] = False,
    *,
    shared: o.Shared,
) -> None:
    """Generate a completion for PROMPT with speculative decoding.

    On a terminal the text grows live: accepted draft tokens, verifier corrections and bonus
    tokens in different styles, rejected drafts struck through, and running stats. Piped or
    with --plain: just the text. With --json: one JSON object.
    """
    with user_errors():
        from cactus_cli.app.config.profile_files import resolve_settings
        from cactus_cli.app.config.settings import check_flags_apply, with_seed
        from cactus_cli.app.session import Session
        from cactus_cli.infer.backends.registry import drives

        settings = resolve_settings(shared.profile, shared.flags)
        check_flags_apply(settings, shared.flags)
        prompt = _read_prompt(prompt)
        settings = with_seed(settings)
        err_console = ui.make_console(no_color=shared.no_color, stderr=True)
        if drives(settings.backend):
            return _on_vllm(settings, prompt, as_json, err_console)
        with ui.LoadProgress(err_console) as progress:
            session = Session.load(settings=settings, reporter=progress)
            ids = session.encode(prompt)  # (the chat template and the system prompt: Session.encode)
            session.prepare(len(ids), progress)
        params = session.params()

        out_console = ui.make_console(no_color=shared.no_color)
        if as_json:
            view = ui.QuietView()
        elif out_console.is_terminal and not plain:
            view = ui.LiveView(out_console)
        else:
            view = ui.PlainView()
        text = []
        interrupted = False
        try:
            with view:
                for event in session.generate(ids, params=params):
                    text.append(event.text)
                    view.update(event)
        except KeyboardInterrupt:
            if not as_json:
                raise  # the live view and plain text already show what was generated
            interrupted = True
        if as_json:
            typer.echo(
                json.dumps(
                    _json_doc("".join(text), interrupted, settings, view.stats, session.engine, params), indent=2
                )
            )
            if interrupted:
                raise typer.Exit(130)


def _on_vllm(settings, prompt: str, as_json: bool, err) -> None:
    """--backend vllm: the whole answer at once (vLLM's offline engine does not stream here), then
    one line of what the drafts and the rule did; --json: the text, settings, stats and that line's figures."""
    from cactus_cli.app import on_vllm

    text, stats, info = on_vllm.generate(settings, prompt, lambda line: err.print(line, style="dim", highlight=False))
    if as_json:
        doc = {"text": text, "interrupted": False, "settings": settings.to_dict(), "stats": stats.to_dict()}
        typer.echo(json.dumps({**doc, "vllm": info}, indent=2))
        return
    typer.echo(text)
    err.print(on_vllm.summary(stats, info), style="dim", highlight=False)


def _read_prompt(prompt: str) -> str:
    """The prompt argument, or stdin for ``-``: valid UTF-8 and not empty."""

    if prompt == "-":
        if sys.stdin is None or sys.stdin.closed:
            raise ConfigError("generate -: stdin is closed; pipe the prompt in, or pass it as an argument")
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        prompt = decode_input(data, "stdin")
        if not prompt.strip():
            raise ConfigError(
                "generate -: stdin was empty; pipe the prompt in (echo 'hi' | cactus generate -) "
                "or pass it as an argument"
            )
    prompt = clean_text(prompt, "the prompt")
    if not prompt.strip():
        raise ConfigError("the prompt is empty; pass some text, or - to read it from stdin")
    return prompt


def _json_doc(text: str, interrupted: bool, settings, stats, engine, params) -> dict:
    """--json: the text, the settings as given and as resolved, the stats and the cost model."""
    doc = {"text": text, "interrupted": interrupted, "settings": settings.to_dict(), "stats": stats.to_dict()}
    doc["settings"]["dtype_resolved"] = str(engine.pair.verifier.dtype).removeprefix("torch.")
    doc["settings"]["device_resolved"] = str(engine.pair.verifier.device)
    doc["settings"]["dtype_reason"] = engine.pair.dtype_reason
    doc["settings"]["backend_resolved"] = engine.pair.verifier.backend
    doc["settings"]["backend_reason"] = engine.pair.backend_reason
    cross = engine.pair.cross
    doc["settings"]["cross_vocab_resolved"] = {"method": cross.method, "why": cross.why} if cross else None
    doc["settings"]["quantized"] = {
        role: lm.quantize_note
        for role, lm in (("verifier", engine.pair.verifier), ("draft", engine.pair.draft))
        if lm is not None and lm.quantize_note
    }  # what ran, layer counts included
    doc["settings"]["compiled"] = engine.compiled
    plan = engine.pair.plan.describe()  # every choice the load made, with its reason (infer/pair/plan.py)
    if engine.compile_note:  # (compiling failed at the first step: the engine went eager, and says why)
        plan["compile"] = {"value": False, "reason": engine.compile_note}
    doc["settings"]["plan"] = plan
    doc["settings"]["compile_seconds"] = engine.compile_seconds
    doc["cost_model"] = engine.cost_summary(params)
    return doc


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
