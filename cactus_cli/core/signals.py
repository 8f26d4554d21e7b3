"""How a run ends when it is told to: SIGTERM (what `timeout`, docker and Slurm send) the way
Ctrl-C does. No torch here: the CLI installs it before anything heavy is imported."""

from __future__ import annotations

import signal


def treat_sigterm_as_sigint() -> None:
    """Finished rows and text are printed and written, caches and temp files cleaned, exit 130."""

    def interrupt(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
