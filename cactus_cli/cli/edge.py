"""The CLI edge: a CactusError becomes one line on stderr and its exit code (2), Ctrl-C exit
130; never a traceback."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import typer

from cactus_cli.core.errors import CactusError


@contextmanager
def user_errors() -> Iterator[None]:
    """The CLI edge: a CactusError becomes one line on stderr and exit code 2, never a traceback."""
    try:
        yield
    except CactusError as err:
        # a path given as undecodable bytes comes back as surrogates: print them as U+FFFD
        message = str(err).encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(err.exit_code) from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None
