"""The CLI edge: a CactusError becomes one line on stderr and its exit code (2), Ctrl-C exit
130; never a traceback."""

from __future__ import annotations

import errno
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
    except OSError as err:  # a file a flag names that the system refuses (a name too long, a device...)
        if err.filename is None:
            raise
        typer.echo(f"error: {os_message(err)}", err=True)
        raise typer.Exit(2) from None


def os_message(err: OSError) -> str:
    """One line for a file the system refused, naming it (a long name shortened) and what to do."""
    name = str(err.filename).encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    shown = name if len(name) <= 80 else name[:40] + "..." + name[-20:]
    if err.errno == errno.ENAMETOOLONG:
        return f"{shown}: the file name is too long (at most 255 bytes a name); choose a shorter one"
    return f"{shown}: {err.strerror or err}"
