"""How a run ends when it is told to: SIGTERM (what `timeout`, docker and Slurm send) the way
Ctrl-C does. No torch here: the CLI installs it before anything heavy is imported."""

from __future__ import annotations

import _thread
import signal
import sys
import threading


def treat_sigterm_as_sigint() -> None:
    """Finished rows and text are printed and written, caches and temp files cleaned, exit 130.
    A Ctrl-C that lands inside an object's finalizer (``__del__``), where Python cannot raise it
    (it would print "Exception ignored ... Traceback" and go on), is raised again just after."""

    def interrupt(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    default = sys.unraisablehook

    def unraisable(info) -> None:
        if isinstance(info.exc_value, KeyboardInterrupt):
            # (from another thread, as SIGTERM, whose handler is ours even where SIGINT is ignored, as
            # in a background job: the main thread sees it at its next instruction, outside the hook)
            threading.Timer(0.05, _thread.interrupt_main, (signal.SIGTERM,)).start()
        else:
            default(info)

    sys.unraisablehook = unraisable
