"""The Typer app. Commands live in cli/commands/, one module each; heavy imports (torch,
transformers) happen inside the commands so `cactus --help` answers at once."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from cactus_cli import __version__
from cactus_cli.cli.commands import register
from cactus_cli.cli.options import RuleHelpCommand
from cactus_cli.core.signals import treat_sigterm_as_sigint

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


register(app)
for _command in app.registered_commands:  # (their options' help may list the rules: options.rule_help)
    _command.cls = RuleHelpCommand


def main() -> None:
    """The `cactus` entry point: Typer's own usage errors (an unknown option, a value its type
    refuses) as one line on stderr with exit code 2, like every other error."""
    treat_sigterm_as_sigint()
    try:
        from typer._click import exceptions as errors  # (newer Typer vendors click)
    except ImportError:
        from click import exceptions as errors
    try:
        code = app(standalone_mode=False)
    except typer.Abort:  # Ctrl-C outside a command's own handling
        sys.exit(130)
    except getattr(errors, "NoArgsIsHelpError", ()):  # (click >= 8.2)
        app()  # (the help, as Typer shows it; exit 2)
    except errors.ClickException as err:
        ctx = getattr(err, "ctx", None)
        where = f" ({ctx.command_path} -h for help)" if ctx is not None else ""
        print(f"error: {' '.join(err.format_message().split())}{where}", file=sys.stderr)
        sys.exit(err.exit_code)
    sys.exit(code if isinstance(code, int) else 0)
