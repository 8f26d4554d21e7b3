"""The one loop over generations: ``Batch`` holds the requests in flight (request.py), each in its own
slot with its own text stream, and ``step`` moves them all one round (runs added since the last round are
prefilled first, then the engine steps every run in one verifier call). ``generate`` is a batch
of one; `cactus serve` keeps one batch and adds requests as they come (continuous batching);
`bench --concurrency` adds several at once.

A run ends at its finish reason, at a stop string (its text stream cuts it), at its own error
(the others go on), or when cancelled; its drafter then learns what it output and the cost store
is saved. Time spent outside ``step`` (the consumer's: rendering, sending) is not the run's: it
is counted as paused, so tokens per second are the engine's."""

from __future__ import annotations

import time
from typing import Iterator, Protocol, Sequence

from cactus_cli.core.events import StepEvent
from cactus_cli.infer.decode.request import Request
from cactus_cli.infer.decode.slot import Slot
from cactus_cli.infer.decode.text import TextStream
from cactus_cli.infer.kpolicy.costs import CostModel
from cactus_cli.infer.kpolicy.store import CostStore
from cactus_cli.infer.load.sources import ModelPair

STEP_SECONDS = 0.8  # a step that feeds a joining prompt takes about this long: the running streams' longest gap
MIN_WIDTH, MAX_WIDTH = 16, 512  # tokens a chunked step holds in all (512: llama.cpp's batch; a GPU reaches it)
CURVE_WIDTH = 64  # the verify width whose measured cost per token sizes the first chunked step
# leaving whole blocks (llama.cpp: a step's width under 64), the tokens cost up to this much more each
# (measured on the AVX-512 EPYC, the embedded verifier: 1.25x at 1,000 cached tokens, 1.41x at 2,600)
OFF_BLOCK = 1.5


def first_width(costs: CostModel, block: int) -> int:
    """The first chunked step's width: what fits STEP_SECONDS at the measured verify curve's cost
    per token of a CURVE_WIDTH-token verify (nothing measured: 4 MIN_WIDTH), in whole blocks
    where it holds one; each chunked step's own time then corrects it (``next_width``), so a curve
    timed on a busy machine costs a few steps, not a stall."""
    per_token = costs.t_v(CURVE_WIDTH) / CURVE_WIDTH
    width = int(STEP_SECONDS / per_token) if per_token > 0 else 4 * MIN_WIDTH
    return _blocks(max(MIN_WIDTH, min(MAX_WIDTH, width)), block)


def next_width(width: int, seconds: float, block: int) -> int:
    """The next chunked step's width (its decoding rows and its chunks), from this one's
    ``width`` and time: toward a step of STEP_SECONDS (at most double or half at once, so one
    stray step does not swing it), in whole ``block``s of the verifier's (engine.step_block)
    where it holds one. A step that left whole blocks shrinks by OFF_BLOCK more: those tokens
    cost more each, and a step must not overshoot the running streams' gap."""
    scale = min(2.0, max(0.5, STEP_SECONDS / max(seconds, 1e-6)))
    grown = max(MIN_WIDTH, min(MAX_WIDTH, int(width * scale)))
    if block > 1 and width % block == 0 and grown < block:
        grown = max(MIN_WIDTH, int(grown / OFF_BLOCK))
    return _blocks(grown, block)


def _blocks(width: int, block: int) -> int:
    """``width`` in whole blocks where it holds one (a remainder would cost more than it carries)."""
    return width // block * block if width >= block else width


# a request still prefilling, and the next tokens of its prompt for its verifier and for its draft model
Chunk = tuple[Request, list[int], list[int]]


class Engine(Protocol):
    """What a batch drives: engine.py's SpeculativeEngine (which imports this module, so it is
    named here by what the batch uses of it, and nothing more)."""

    pair: ModelPair  # (its tokenizer: each run's text stream)
    costs: CostStore  # (its verify curve: the first chunked step)
    step_block: int  # (the widths its verifier steps fastest in multiples of)

    def admit(self, run: Request) -> None: ...

    def prefill(self, run: Request) -> None: ...

    def step(self, runs: list[Request], chunks: Sequence[Chunk] = ()) -> list[StepEvent | Exception]: ...

    def finish(self, run: Request, learn: bool = True) -> None: ...


class Batch:
    def __init__(self, engine: Engine, chunk: int | None = None):
        """``engine``: the SpeculativeEngine whose slots the runs hold (its prefill, step, finish).
        ``chunk``: prompt tokens a step feeds beside the decoding runs (None: the step's width,
        its decoding rows and chunks, sized from the verifier's measured cost per width, then from
        each chunked step's time, toward STEP_SECONDS: ``next_width``)."""
        self.engine = engine
        self.chunk = chunk
        self.width: int | None = None  # (sized at the first chunked step)
        self.runs: list[Request] = []  # in flight, in the order they joined
        self.idle_from: float | None = None

    def __len__(self) -> int:
        return len(self.runs)

    def add(self, run: Request, reuse: bool = False, text: bool = True, donor: Slot | None = None) -> Request:
        """``run`` (placed in its slot: engine.place) joins at the next step (prefilled then), with
        a text stream unless ``text`` is False (token events only: engine.steps); ``reuse``: keep what
        its slot's caches hold of its prompt; ``donor``: a slot whose caches hold a longer prefix of
        it (adopted instead of prefilled)."""
        if run.slot is None:
            raise ValueError("a request joins a batch once it has a slot (engine.place)")
        run.text = TextStream(self.engine.pair.tokenizer, run.params.stop, run.cut_output) if text else None
        run.reuse, run.donor = reuse, donor
        self.runs.append(run)
        return run

    def cancel(self, run: Request) -> None:
        """End ``run`` between steps (its caches stay consistent); what it output is learned."""
        if not run.done:
            self._end(run)

    def step(self) -> list[tuple[Request, StepEvent | BaseException]]:
        """One round in three passes: schedule (the runs that joined take their slots; with runs
        decoding, a joining prompt gets a chunk, ``chunk`` tokens in all, so a long prompt no
        longer stalls the running streams for its whole prefill; with none, it is prefilled whole),
        execute (one step of every decoding run: one verifier call that also feeds the chunks),
        commit (each run's event with text, or its error; a prompt read to its end decodes from
        the next step; ended runs leave the batch)."""
        now = time.perf_counter()
        if self.idle_from is not None:
            for run in self.runs:
                if run.admitted:
                    run.paused += now - self.idle_from
        out: list[tuple[Request, StepEvent | BaseException]] = []
        live, chunks = self._schedule(out)
        t0 = time.perf_counter()
        try:
            results = self.engine.step(live, chunks) if live else []
        except Exception as err:  # noqa: BLE001 (the step's one model call failed: every run in it)
            for run in live + [e for e, _, _ in chunks]:
                self._fail(run, err)
                out.append((run, err))
            live, chunks, results = [], [], []
        except BaseException:
            self._abandon(live + [e for e, _, _ in chunks])
            raise
        fed = sum(len(ids) for _, ids, _ in chunks)
        if chunks and self.chunk is None and fed >= self.width - len(live):  # (a prompt's short last chunk: no)
            rows = sum(r.k + 1 for r in live)
            self.width = next_width(rows + fed, time.perf_counter() - t0, self.engine.step_block)
        self._commit(live, results, chunks, out)
        self.idle_from = time.perf_counter()
        return out

    def _schedule(self, out: list) -> tuple[list[Request], list[Chunk]]:
        """The runs this step decodes, and the prompt chunks it feeds: (a run still prefilling, its
        verifier's next tokens, its draft model's). A run that fails here is its own error in ``out``."""
        live = [e for e in self.runs if e.prefilled]
        chunked = bool(live)  # (streams are running: a joining prompt shares their steps)
        chunks, budget = [], self.chunk or 0
        if chunked and self.chunk is None:
            if self.width is None:
                self.width = first_width(self.engine.costs.costs, self.engine.step_block)
            # (the decoding rows counted one token each: a run that drafts widens the step past its blocks)
            budget = max(MIN_WIDTH, self.width - len(live))
        for run in [e for e in self.runs if not e.prefilled]:
            try:
                if not chunked:
                    self.engine.prefill(run)
                    live.append(run)
                    continue
                if not run.admitted:
                    self.engine.admit(run)
                if not run.pending and not run.draft_pending:  # (all of it cached already)
                    run.settle()
                    live.append(run)
                elif budget > 0:
                    chunks.append((run, run.pending[:budget], run.draft_pending[:budget]))
                    budget -= max(len(chunks[-1][1]), len(chunks[-1][2]))
            except Exception as err:  # noqa: BLE001 (one run's failure is its own)
                self._fail(run, err)
                out.append((run, err))
            except BaseException:
                self._abandon(list(self.runs))
                raise
        return live, chunks

    def _commit(self, live: list[Request], results: list, chunks: list, out: list) -> None:
        """Each chunk's run moves on (settled once its prompt is read); each decoding run's event,
        with text, or its error, into ``out``."""
        for run, ids, draft in chunks:
            run.pending, run.draft_pending = run.pending[len(ids) :], run.draft_pending[len(draft) :]
            if not run.pending and not run.draft_pending:
                try:
                    run.settle()
                except Exception as err:  # noqa: BLE001 (one run's failure is its own)
                    self._fail(run, err)
                    out.append((run, err))
        for run, result in zip(live, results):
            if isinstance(result, BaseException):
                self._fail(run, result)
                out.append((run, result))
                continue
            event = run.text.add_text(result) if run.text is not None else result
            run.stats.update(event)
            out.append((run, event))
            if event.finish_reason:
                self._end(run)

    def _end(self, run: Request) -> None:
        run.done = True
        self.runs.remove(run)
        self.engine.finish(run)

    def _fail(self, run: Request, err: BaseException) -> None:
        """A run that failed mid-step: its caches may be half-updated, so its slot forgets them
        (the next run there prefills from scratch) and nothing is learned from it."""
        run.slot.reset()
        run.done = True
        self.runs.remove(run)
        self.engine.finish(run, learn=False)

    def _abandon(self, runs: list[Request]) -> None:
        """Interrupted (Ctrl-C, out of memory) inside a step: drop every affected slot's caches."""
        for run in runs:
            if not run.done:
                self._fail(run, KeyboardInterrupt())

    def events(self, run: Request) -> Iterator[StepEvent]:
        """``run``'s events until it ends, stepping this batch (a batch of one: ``generate``).
        Closing the iterator between events cancels the run with its caches consistent."""
        try:
            while not run.done:
                for got, result in self.step():
                    if got is not run:
                        continue
                    if isinstance(result, BaseException):
                        raise result
                    yield result
        finally:
            self.cancel(run)
