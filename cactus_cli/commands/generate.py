"""`cactus generate PROMPT`: one-shot generation with the live view, plain text or JSON."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from cactus_cli import options as o
from cactus_cli.commands import user_errors


def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt, or - to read it from stdin.")],
    profile: o.Profile = None,
    verifier: o.Verifier = None,
    draft: o.Draft = None,
    tokenizer: o.Tokenizer = None,
    rule: o.Rule = None,
    delta: o.Delta = None,
    param: o.Param = None,
    num_draft_tokens: o.NumDraft = None,
    temperature: o.Temperature = None,
    top_k: o.TopK = None,
    top_p: o.TopP = None,
    max_tokens: o.MaxTokens = None,
    seed: o.Seed = None,
    stop: o.Stop = None,
    device: o.Device = None,
    dtype: o.Dtype = None,
    chat_template: o.ChatTemplate = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt (with a chat template).", rich_help_panel=o.RUNTIME)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: text, settings, stats.")] = False,
    plain: Annotated[bool, typer.Option("--plain", help="Stream plain text even on a terminal.")] = False,
    no_color: o.NoColor = False,
) -> None:
    """Generate a completion for PROMPT with speculative decoding.

    On a terminal the text grows live: accepted draft tokens, verifier corrections and bonus
    tokens in different styles, rejected drafts struck through, and running stats. Piped or
    with --plain: just the text. With --json: one JSON object.
    """
    with user_errors():
        from cactus_cli.config import resolve_settings
        from cactus_cli.errors import ConfigError

        flags = o.flags_to_settings(
            verifier=verifier, draft=draft, tokenizer=tokenizer, rule=rule, delta=delta, rule_params=param,
            num_draft_tokens=num_draft_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            max_tokens=max_tokens, seed=seed, stop=stop, device=device, dtype=dtype,
            chat_template=chat_template, system=system,
        )
        settings = resolve_settings(profile, flags)
        o.check_flags_apply(settings, flags)
        if prompt == "-":
            prompt = sys.stdin.read()
        if not prompt.strip():
            raise ConfigError("the prompt is empty; pass some text, or - to read it from stdin")

        from cactus_cli import runtime, ui

        runtime.fill_seed(settings)
        err_console = ui.make_console(no_color=no_color, stderr=True)
        with ui.LoadProgress(err_console) as progress:
            engine = runtime.load_engine(settings, progress)
        messages = ([{"role": "system", "content": settings.system}] if settings.system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = runtime.encode(engine.pair.tokenizer, messages, settings.chat_template)
        params = runtime.generation_params(settings)

        out_console = ui.make_console(no_color=no_color)
        if as_json:
            view = ui.QuietView()
        elif out_console.is_terminal and not plain:
            view = ui.LiveView(out_console)
        else:
            view = ui.PlainView()
        text = []
        with view:
            for event in engine.generate(ids, params):
                text.append(event.text)
                view.update(event)
        if as_json:
            doc = {"text": "".join(text), "settings": settings.to_dict(), "stats": view.stats.to_dict()}
            doc["settings"]["dtype_resolved"] = str(engine.pair.verifier.dtype).removeprefix("torch.")
            doc["settings"]["device_resolved"] = str(engine.pair.verifier.device)
            typer.echo(json.dumps(doc, indent=2))


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
