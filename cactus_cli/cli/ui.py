"""Rich for the running part: the live view of step events, the stats line, progress bars and
chat's output (tables.py draws the result tables).

The live view shows the text as it grows: accepted draft tokens in green (italic blue when the
draft was copied from the context by prompt lookup, italic magenta when the suffix trees drafted
it from memory), tokens the verifier
chose (corrections after a rejection, bonus tokens after a full acceptance) in bold, underlined
yellow/cyan, and the last step's rejected draft tokens struck through in a side lane under the
text. Without colour (--no-color or NO_COLOR) the same styles keep them apart: plain, bold
underline, strike-through.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from cactus_cli.core.events import StepEvent
from cactus_cli.core.stats import SpecStats

STYLES = {
    "accepted": "green",
    "copied": "italic blue",  # an accepted draft copied from the context (prompt lookup)
    "remembered": "italic magenta",  # an accepted draft from the suffix trees (the request and earlier ones)
    "correction": "bold underline yellow",
    "bonus": "bold underline cyan",
    "verifier": "default",
    "rejected": "strike red",
    "dim": "dim",
}


def make_console(no_color: bool = False, stderr: bool = False, file: TextIO | None = None) -> Console:
    # Rich honours NO_COLOR by itself; --no-color adds the same for this run
    return Console(no_color=no_color or None, stderr=stderr, file=file, highlight=False, soft_wrap=False)


FREE_STYLE = "italic"  # the accepted drafts of a model-free drafter without a style of its own here


def style(kind: str) -> str:
    """The style of a piece of text by where its token came from (a model-free drafter's label)."""
    return STYLES.get(kind, FREE_STYLE)


def legend() -> Text:
    from cactus_cli.infer.draft import KINDS  # (the registry: a drafter added there shows here too)

    t = Text("legend: ", style=STYLES["dim"])
    t.append("accepted draft", style=STYLES["accepted"])
    t.append("  ")
    for kind in KINDS.values():
        t.append(f"{kind.label} ({kind.name})", style=style(kind.label))
        t.append("  ")
    t.append("verifier correction", style=STYLES["correction"])
    t.append("  ")
    t.append("verifier bonus", style=STYLES["bonus"])
    t.append("  ")
    t.append("rejected draft", style=STYLES["rejected"])
    return t


def stats_line(stats: SpecStats) -> Text:
    parts = [f"{stats.num_output_tokens} tokens"]
    if stats.tokens_per_second:
        parts.append(f"{stats.tokens_per_second:.1f} tok/s")
    if stats.draft_acceptance_rate is not None:
        parts.append(f"acceptance {100 * stats.draft_acceptance_rate:.0f}%")
        parts.append(f"mean acceptance length {stats.mean_acceptance_length:.2f}")
    parts.append(f"verifier passes/token {stats.verifier_forward_passes / max(stats.num_output_tokens, 1):.2f}")
    if stats.time_to_first_token is not None:
        parts.append(f"TTFT {stats.time_to_first_token:.2f}s")
    return Text(" · ".join(parts), style=STYLES["dim"])


class LiveView:
    """Renders step events on a terminal. Use as a context manager; call ``update`` per event."""

    def __init__(self, console: Console, show_legend: bool = True, fps: float = 15.0):
        self.console = console
        self.text = Text()
        self.rejected = Text()
        self.stats = SpecStats()
        self.show_legend = show_legend
        self.min_interval = 1.0 / fps
        self._last = 0.0
        self._live = Live(console=console, auto_refresh=False, transient=True)

    def __enter__(self) -> LiveView:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._live.__exit__(*exc)
        # the final frame, printed in full (the live area only shows the tail of long text)
        self.console.print(self.text)
        if self.show_legend:
            self.console.print(legend())
        self.console.print(stats_line(self.stats))

    def update(self, ev: StepEvent) -> None:
        self.stats.update(ev)
        for piece in ev.pieces:
            self.text.append(piece.text, style=style(piece.kind))
        self.rejected = Text()
        if ev.rejected_text:
            self.rejected.append("rejected: ", style=STYLES["dim"])
            self.rejected.append(" ".join(t.replace("\n", "\\n") for t in ev.rejected_text), style=STYLES["rejected"])
        now = time.monotonic()
        if now - self._last >= self.min_interval or ev.finish_reason:
            self._last = now
            self._live.update(self._frame(), refresh=True)

    def _frame(self) -> Group:
        height = max(self.console.size.height - 4, 3)
        lines = self.text.wrap(self.console, self.console.size.width)
        tail = Text("\n").join(lines[-height:]) if len(lines) > height else self.text
        parts = [tail, self.rejected, stats_line(self.stats)]
        if self.show_legend:
            parts.append(legend())
        return Group(*parts)


# Control characters a model may generate (ESC, BEL, CR, C1 controls...) shown as \xNN on a terminal,
# where an "ESC ]" sequence could retitle or confuse it; newline and tab pass. Pipes and files get the
# text as generated.
CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if c not in (0x09, 0x0A)}


class PlainView:
    """Just the text, streamed, for pipes and --plain; with ``err``, the stats line goes there
    at the end (a scripted chat: each turn's figures on stderr, the replies alone on stdout).
    On a terminal, control characters are escaped (CONTROLS)."""

    def __init__(self, out: TextIO | None = None, err: Console | None = None):
        self.out = out or sys.stdout
        self.err = err
        self.stats = SpecStats()
        isatty = getattr(self.out, "isatty", None)
        self.escape = bool(isatty and isatty())

    def __enter__(self) -> PlainView:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.out.write("\n")
        self.out.flush()
        if self.err is not None and self.stats.num_output_tokens:
            self.err.print(stats_line(self.stats), soft_wrap=True)

    def update(self, ev: StepEvent) -> None:
        self.stats.update(ev)
        self.out.write(ev.text.translate(CONTROLS) if self.escape else ev.text)
        self.out.flush()


class QuietView:
    """Collects stats only (for --json)."""

    def __init__(self) -> None:
        self.stats = SpecStats()

    def __enter__(self) -> QuietView:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def update(self, ev: StepEvent) -> None:
        self.stats.update(ev)


class LoadProgress:
    """Progress for loading and one-time conversions: a bar for byte counts, a spinner and
    elapsed time for the rest. On a terminal it is live and transient; elsewhere only the
    finished conversion steps are printed, one line each (useful in CI logs)."""

    def __init__(self, console: Console):
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            ProgressColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        class _Bytes(ProgressColumn):
            def render(self, task):
                return DownloadColumn().render(task) if task.total else Text("")

        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            _Bytes(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self._current = None

    def __enter__(self) -> LoadProgress:
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live:
            self.progress.stop()

    def task(self, description: str, total: int | None = None):
        if self._current is not None:
            self.progress.update(self._current, visible=False)
        self._current = self.progress.add_task(description, total=total)
        tid = self._current
        return lambda n: self.progress.advance(tid, n)

    def done(self, description: str) -> None:
        self.console.print(f"[green]✓[/] {description}")

    def warn(self, message: str) -> None:
        self.console.print(f"[yellow]warning:[/] {message}")


def cost_line(cm: dict) -> str:
    """One line of the cost model: draft ms per token, verifier ms by width, a, best k."""
    if not cm.get("verify_seconds_by_width"):
        return "cost model: nothing measured yet"
    widths = cm["verify_seconds_by_width"]
    shown = [w for w in ("1", "2", "3", "5", "9") if w in widths] or list(widths)[:4]
    parts = [f"cost model ({cm['source']}):"]
    if cm.get("draft_seconds_per_token") is not None:
        parts.append(f"draft {1000 * cm['draft_seconds_per_token']:.1f} ms/token,")
    parts.append("verify " + ", ".join(f"w={w} {1000 * widths[w]:.1f}" for w in shown) + " ms")
    if cm.get("acceptance_estimate") is not None:
        parts.append(f"· a ≈ {cm['acceptance_estimate']:.2f}")
    if cm.get("best_k") is not None:
        parts.append(f"· best k now {cm['best_k']}")
    return " ".join(parts)


def bench_progress(console: Console, total: int):
    """A progress bar over (configuration, prompt) pairs; yields advance(n, label)."""
    from contextlib import contextmanager

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    @contextmanager
    def cm():
        progress = Progress(
            TextColumn("{task.description:<28}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        with progress:
            tid = progress.add_task("warming up", total=total)
            yield lambda n, label: progress.update(tid, advance=n, description=label)

    return cm()


# --------------------------------------------------------------------------- chat


class ChatOutput:
    """What the chat REPL shows: live replies on a terminal, plain replies when scripted."""

    def __init__(self, console: Console, err: Console, live: bool):
        self.console = console
        self.err = err
        self.live = live and console.is_terminal
        self._legend_shown = False

    def reply_view(self):
        if self.live:
            view = LiveView(self.console, show_legend=not self._legend_shown)
            self._legend_shown = True
            return view
        return PlainView(err=self.err)

    def info(self, text: str) -> None:
        self.console.print(Text(text), soft_wrap=True)

    def note(self, text: str) -> None:
        self.err.print(Text(text, style="yellow"), soft_wrap=True)

    def error(self, text: str) -> None:  # one line, whatever the width: scripts grep for it
        self.err.print(Text(f"error: {text}", style="red"), soft_wrap=True)

    def stats_table(self, d: dict) -> None:
        def fmt(v):
            if isinstance(v, float):
                return f"{v:.4g}"
            if isinstance(v, list):
                return "[" + ", ".join(fmt(x) for x in v) + "]"
            return str(v)

        keys = [
            "turns",
            "num_output_tokens",
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
            "draft_acceptance_rate",
            "mean_acceptance_length",
            "mean_accepted_tokens_per_step",
            "acceptance_histogram",
            "per_position_acceptance_rate",
            "k_histogram",
            "mean_k",
            "tokens_per_second",
            "verifier_forward_passes",
            "draft_forward_passes",
            "prefill_tokens",
            "prefill_tokens_saved",
        ]
        width = max(len(k) for k in keys)
        for k in keys:
            self.console.print(Text(f"{k:<{width}}  {fmt(d.get(k))}"))
        if d.get("cost_model"):
            self.console.print(Text(cost_line(d["cost_model"]), style=STYLES["dim"]))


# --------------------------------------------------------------------------- calibrate
