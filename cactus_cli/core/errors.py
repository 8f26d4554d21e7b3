"""A small error hierarchy. Messages are shown to the user as one line; the CLI edge
turns any CactusError into that line and exit code 2. ``warn``: one persistent line on stderr
for what the user should know but need not stop for (a cache rebuilt, and why)."""

import sys


def warn(message: str) -> None:
    """One line on stderr that stays (a spinner's text disappears)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


class CactusError(Exception):
    """A problem the user can fix; the message says how."""

    exit_code = 2


class ConfigError(CactusError):
    """A bad profile, option or combination of options."""


class ModelError(CactusError):
    """A model that cannot be found, loaded, or paired with the other one."""


class ContextLimitError(CactusError):
    """The prompt does not fit in the model's context window."""
