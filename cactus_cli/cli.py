"""The Typer app. Commands live in cactus_cli/commands/, one module each; heavy imports
(torch, transformers) happen inside the commands so `cactus --help` answers at once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cactus_cli import __version__

app = typer.Typer(
    name="cactus",
    help="Speculative decoding with the Cactus acceptance rule: a small draft model proposes, "
    "a large verifier checks, and a divergence budget (delta) trades fidelity for speed.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"cactus {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = None,
) -> None:
    """Speculative decoding with the Cactus acceptance rule."""


from cactus_cli.commands import register  # noqa: E402  (commands need `app` defined)

register(app)


def treat_sigterm_as_sigint() -> None:
    """SIGTERM (what `timeout`, docker and Slurm send) ends a run the way Ctrl-C does: finished
    rows and text are printed and written, caches and temp files cleaned, exit 130."""
    import signal

    def interrupt(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def main() -> None:
    treat_sigterm_as_sigint()
    app()
