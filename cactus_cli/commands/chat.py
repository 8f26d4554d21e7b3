"""`cactus chat`: an interactive REPL with the live view and cross-turn KV-cache reuse."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from cactus_cli import options as o
from cactus_cli.commands import user_errors


def chat(
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
    system: Annotated[str | None, typer.Option("--system", help="System prompt.", rich_help_panel=o.RUNTIME)] = None,
    no_color: o.NoColor = False,
) -> None:
    """Chat with speculative decoding. Each reply grows live like `generate`; only the new turn
    is encoded (both KV caches carry over). Type /help for commands. Ctrl-C stops a reply and
    keeps the conversation; Ctrl-C at the prompt or Ctrl-D leaves.

    With stdin not a terminal, each line is one user turn and replies are printed plainly:
    printf 'hi\\n/stats\\n/exit\\n' | cactus chat
    """
    with user_errors():
        from cactus_cli.config import resolve_settings

        flags = o.flags_to_settings(
            verifier=verifier, draft=draft, tokenizer=tokenizer, rule=rule, delta=delta, rule_params=param,
            num_draft_tokens=num_draft_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            max_tokens=max_tokens, seed=seed, stop=stop, device=device, dtype=dtype,
            chat_template=chat_template, system=system,
        )
        settings = resolve_settings(profile, flags)
        o.check_flags_apply(settings, flags)

        from cactus_cli import runtime, ui
        from cactus_cli.chat import ChatSession, read_turns
        from cactus_cli.embedded import cache_dir

        runtime.fill_seed(settings)
        interactive = sys.stdin.isatty()
        err = ui.make_console(no_color=no_color, stderr=True)
        out = ui.ChatOutput(ui.make_console(no_color=no_color), err, live=interactive)

        def load(s):
            with ui.LoadProgress(err) as progress:
                return runtime.load_engine(s, progress)

        session = ChatSession(settings, flags, load, out)
        if interactive:
            out.info("cactus chat · /help for commands · Ctrl-D to leave")
        try:
            session.run(read_turns(interactive, history_file=cache_dir() / "chat_history"))
        except KeyboardInterrupt:  # Ctrl-C at the prompt: leave cleanly
            out.info("")


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
