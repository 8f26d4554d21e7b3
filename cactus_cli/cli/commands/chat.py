"""`cactus chat`: an interactive REPL with the live view and cross-turn KV-cache reuse."""

from __future__ import annotations

import sys

import typer

from cactus_cli.cli import options as o
from cactus_cli.cli import ui
from cactus_cli.cli.edge import user_errors
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.fileio import check_output_file


@o.shared_options(*o.GENERATION, "history")
def chat(*, shared: o.Shared) -> None:
    """Chat with speculative decoding. Each reply grows live like `generate`; only the new turn
    is encoded (both KV caches carry over). Type /help for commands. Ctrl-C stops a reply and
    keeps the conversation; Ctrl-C at the prompt or Ctrl-D leaves.

    With stdin not a terminal, each line is one user turn and replies are printed plainly:
    printf 'hi\\n/stats\\n/exit\\n' | cactus chat
    """
    with user_errors():
        from cactus_cli.app.config.profile_files import resolve_settings
        from cactus_cli.app.config.settings import check_flags_apply, with_seed

        flags = shared.flags
        settings = resolve_settings(shared.profile, flags)
        check_flags_apply(settings, flags)

        from cactus_cli.app.conversation import ChatSession, read_turns
        from cactus_cli.app.session import Session

        settings = with_seed(settings)
        history = check_output_file(settings.history, "--history") if settings.history else None
        if sys.stdin is None or sys.stdin.closed:
            raise ConfigError("chat: stdin is closed; run it on a terminal or pipe the turns in")
        interactive = sys.stdin.isatty()
        if history is not None and not interactive:
            ui.make_console(stderr=True).print(
                f"--history {history}: stdin is not a terminal, so no typed lines are kept", style="yellow"
            )
        err = ui.make_console(no_color=shared.no_color, stderr=True)
        out = ui.ChatOutput(ui.make_console(no_color=shared.no_color), err, live=interactive)

        def load(s):
            with ui.LoadProgress(err) as progress:
                session = Session.load(settings=s, reporter=progress)
                session.prepare(reporter=progress, whole_context=True)
            session.report_to(out.note)  # a long conversation outgrows the compiled cache now and then
            return session

        session = ChatSession(load(settings), flags, load, out)
        if interactive:
            out.info("cactus chat · /help for commands · Ctrl-D to leave")
        try:
            session.run(read_turns(interactive, history_file=history))
        except KeyboardInterrupt:  # Ctrl-C at the prompt: leave cleanly
            out.info("")


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
