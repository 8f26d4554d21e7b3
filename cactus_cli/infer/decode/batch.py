"""The one loop over generations: ``Batch`` holds the runs in flight, each in its own slot with
its own text stream, and ``step`` moves them all one round (runs added since the last round are
prefilled first, then the engine steps every run in one verifier call). ``generate`` is a batch
of one; `cactus serve` keeps one batch and adds requests as they come (continuous batching);
`bench --concurrency` adds several at once.

A run ends at its finish reason, at a stop string (its text stream cuts it), at its own error
(the others go on), or when cancelled; its drafter then learns what it output and the cost store
is saved. Time spent outside ``step`` (the consumer's: rendering, sending) is not the run's: it
is counted as paused, so tokens per second are the engine's."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from cactus_cli.core.events import StepEvent
from cactus_cli.infer.decode.slot import Run, Slot
from cactus_cli.infer.decode.text import TextStream


@dataclass(eq=False)
class Entry:
    run: Run
    text: TextStream | None  # None: token events only (engine.steps)
    reuse: bool
    donor: Slot | None = None
    done: bool = False
    tag: object = field(default=None)  # the caller's (serve: the request)


class Batch:
    def __init__(self, engine: Any):
        """``engine``: the SpeculativeEngine whose slots the runs hold (its prefill, step, finish)."""
        self.engine = engine
        self.entries: list[Entry] = []
        self.idle_from: float | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, run: Run, reuse: bool = False, text: bool = True, donor: Slot | None = None, tag=None) -> Entry:
        """``run`` joins at the next step (prefilled then); ``donor``: a slot whose caches hold a
        longer prefix of its prompt (adopted instead of prefilled)."""
        stream = TextStream(self.engine.pair.tokenizer, run.params.stop, run.cut_output) if text else None
        entry = Entry(run, stream, reuse, donor, tag=tag)
        self.entries.append(entry)
        return entry

    def cancel(self, entry: Entry) -> None:
        """End ``entry`` between steps (its caches stay consistent); what it output is learned."""
        if not entry.done:
            self._end(entry)

    def step(self) -> list[tuple[Entry, StepEvent | BaseException]]:
        """One round: prefill the runs that joined, then one step of every run. Returns each
        run's event (with text) or its error; ended runs leave the batch."""
        now = time.perf_counter()
        if self.idle_from is not None:
            for entry in self.entries:
                if entry.run.prefilled:
                    entry.run.paused += now - self.idle_from
        out: list[tuple[Entry, StepEvent | BaseException]] = []
        live = []
        for entry in list(self.entries):
            if entry.run.prefilled:
                live.append(entry)
                continue
            try:
                self.engine.prefill(entry.run, entry.reuse, entry.donor)
                live.append(entry)
            except Exception as err:  # noqa: BLE001 (one run's failure is its own)
                self._fail(entry, err)
                out.append((entry, err))
            except BaseException:
                self._abandon(list(self.entries))
                raise
        try:
            results = self.engine.step([e.run for e in live]) if live else []
        except Exception as err:  # noqa: BLE001 (the step's one model call failed: every run in it)
            for entry in live:
                self._fail(entry, err)
                out.append((entry, err))
            results = []
        except BaseException:
            self._abandon(live)
            raise
        for entry, result in zip(live, results):
            if isinstance(result, BaseException):
                self._fail(entry, result)
                out.append((entry, result))
                continue
            event = entry.text.add_text(result) if entry.text is not None else result
            out.append((entry, event))
            if event.finish_reason:
                self._end(entry)
        self.idle_from = time.perf_counter()
        return out

    def _end(self, entry: Entry) -> None:
        entry.done = True
        self.entries.remove(entry)
        self.engine.finish(entry.run)

    def _fail(self, entry: Entry, err: BaseException) -> None:
        """A run that failed mid-step: its caches may be half-updated, so its slot forgets them
        (the next run there prefills from scratch) and nothing is learned from it."""
        entry.run.slot.reset()
        entry.done = True
        self.entries.remove(entry)
        self.engine.finish(entry.run, learn=False)

    def _abandon(self, entries: list[Entry]) -> None:
        """Interrupted (Ctrl-C, out of memory) inside a step: drop every affected slot's caches."""
        for entry in entries:
            if not entry.done:
                self._fail(entry, KeyboardInterrupt())

    def events(self, entry: Entry) -> Iterator[StepEvent]:
        """``entry``'s events until it ends, stepping this batch (a batch of one: ``generate``).
        Closing the iterator between events cancels the run with its caches consistent."""
        try:
            while not entry.done:
                for got, result in self.step():
                    if got is not entry:
                        continue
                    if isinstance(result, BaseException):
                        raise result
                    yield result
        finally:
            self.cancel(entry)
