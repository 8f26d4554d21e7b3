"""The speculative decoding engine: one generator of StepEvents that every command consumes.

The engine holds the models (one runner per model, each holding one sequence per slot), its
slots (slot.py: one sequence's caches) and what every request reads of it (context.py). A request
(request.py: one generation's own state, waiting, prefilling, decoding, done) borrows a slot.
``step`` is one round for a set of requests ("runs" below), each in its own slot: choose every
run's k together (policy.allocate: the whole step's expected tokens per second under the measured
cost of its width), draft for all of them (the draft model steps every run's row in one call per
position), verify (ONE verifier call over every run's row, then each run's rule over its own
ragged drafts, read back in the step's one host sync; nothing is committed), commit (the policies
learn, each slot's caches are cropped to what it accepted).
batch.py runs the loop: ``generate`` is a batch of one, `cactus serve` a batch that requests
join and leave. The engine speaks tokens: text, stop strings and the rejected drafts as text are
added by text.py's stream around it, outside the timed region. The engine never imports Rich
and never names a concrete drafter or runner (factories do).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from cactus_cli.core.conditions import Conditions
from cactus_cli.core.errors import ContextLimitError
from cactus_cli.core.events import MODEL, StepEvent
from cactus_cli.core.verify import verify_rows
from cactus_cli.infer.backends.registry import backend_of
from cactus_cli.infer.decode.batch import Batch, Chunk
from cactus_cli.infer.decode.context import EngineContext
from cactus_cli.infer.decode.grammar import Grammars
from cactus_cli.infer.decode.request import GenerationParams, Request
from cactus_cli.infer.decode.slot import Slot
from cactus_cli.infer.decode.verdict import Timing
from cactus_cli.infer.draft import KINDS, Free, free_drafting, make_drafter, propose_all
from cactus_cli.infer.kpolicy.costs import probe, probe_widths
from cactus_cli.infer.kpolicy.policy import AdaptiveK, FixedK, KPolicy, Learned, acceptance_key, allocate
from cactus_cli.infer.kpolicy.store import SAVE_EVERY, CostStore
from cactus_cli.infer.pair.keys import cost_key
from cactus_cli.infer.runner import MAX_STEP_WIDTH, CompileUnavailable, Runner, sync

__all__ = ["GenerationParams", "SpeculativeEngine"]
from cactus_cli.infer.load.sources import ModelPair, eos_ids

DRAFT_WIDTHS = (1, 2)  # the draft's compiled steps: one token, or the last draft + the bonus after a full acceptance
MAX_GRAPHS = 4  # verifier widths compiled as asked; a longer list (a sweep over k) is bucketed to powers of two


class SpeculativeEngine:
    def __init__(self, pair: ModelPair, free: Free | None = None, compiled: bool = False, sequences: int = 1):
        """``free`` drafts without a model (draft/__init__.KINDS: prompt lookup, the suffix trees), with the pair's draft model
        (if any) for when they have nothing. ``compiled``: static caches and compiled steps
        (backends/torch/compiled.py; one sequence). ``sequences``: the slots, each a sequence in every
        model's KV cache (runs in different slots step together); a compiled engine holds one
        (the load plan decides: plan.choose_compile)."""
        if compiled and sequences > 1:
            raise ValueError(
                f"compiled steps hold one sequence, not {sequences}: "
                "build a compiled engine with sequences=1, or an eager one (compiled=False) for several slots"
            )
        self.pair = pair
        if free is not None and free.state is None:  # (its state made once: every slot's drafter shares it)
            free = free_drafting(free.kind, free.options, pair.tokenizer, pair.vocab_size)
        self.free = free
        eos = frozenset(eos_ids(pair))
        limits = [pair.verifier.context_length] + ([pair.draft.context_length] if pair.draft else [])
        self.context = EngineContext(  # what each run reads of the engine (the same whatever _build makes)
            eos=eos,
            context_length=min(limits),
            vocab_size=pair.vocab_size,
            device=pair.verifier.device,
            dtype=pair.verifier.dtype,
            grammars=Grammars(pair.tokenizer, pair.vocab_size, sorted(eos)),  # (JSON output; built when asked)
        )
        self.sequences = sequences
        self.compile_note: str | None = None  # why a compiled engine runs eagerly, if it does
        self.report: Callable[[str], None] | None = None  # progress lines (a compile during generate)
        self._build(compiled)

    @property
    def eos(self) -> frozenset[int]:
        return self.context.eos

    @eos.setter
    def eos(self, ids) -> None:
        """Other end tokens for the runs started from now on (tests make a chosen token the end)."""
        self.context = dataclasses.replace(self.context, eos=frozenset(ids))

    @property
    def context_length(self) -> int:
        return self.context.context_length

    @property
    def grammars(self) -> Grammars:
        return self.context.grammars

    def _build(self, compiled: bool) -> None:
        """Runners, slots (each with its caches and drafter), the cost store and what -k auto
        learns beside it (each run's own policy shares both); called again if compiling turns out
        not to work."""
        pair = self.pair
        self.compiled = compiled
        backend = backend_of(pair.verifier.backend)
        n = self.sequences
        verifier = backend.runner(pair.verifier, pair.vocab_size, compiled, self.context_length, "verifier", n)
        draft = None
        if pair.draft is not None:  # (a draft with its own tokenizer runs eagerly: its token count differs)
            draft = backend.runner(
                pair.draft,
                pair.cross.rows if pair.cross else pair.vocab_size,
                compiled and pair.cross is None,
                self.context_length,
                "draft",
                n,
            )
        self.costs = CostStore.read(cost_key(pair, compiled), tuple(KINDS))  # what a step costs here
        self.learned = Learned()  # the catch-up overheads and width re-timing, shared by the runs' -k auto
        # the models' runners, the verifier's first: each the one its backend made (sequence 0), not a slot's view
        self.runners: list[Runner] = [verifier] + ([draft] if draft is not None else [])
        self.step_block = verifier.step_block  # (its steps' widths cost least in multiples of it: batch.next_width)
        self.slots = [
            Slot(
                i,
                verifier.sequence(i),
                make_drafter(
                    draft.sequence(i) if draft is not None else None,
                    self.free,
                    pair.vocab_size,
                    pair.verifier.device,
                    pair.cross,
                    pair.tokenizer,
                ),
            )
            for i in range(n)
        ]

    def cache_lengths(self, slot: int = 0) -> dict[str, int]:
        """For tests and diagnostics (Slot.cache_lengths)."""
        return self.slots[slot].cache_lengths()

    @property
    def has_drafter(self) -> bool:
        """Whether a run can draft at all: a draft model, or drafting without one (every slot has its drafter then)."""
        return self.pair.draft is not None or self.free is not None

    def step_widths(self, k: int) -> tuple[int, ...]:
        """The verifier's step width for draft length k (k_max with -k auto): every step of such a
        run, k = 0 and shorter lookups included, is padded to it when compiled."""
        return (k + 1,) if k > 0 and self.has_drafter else (1,)

    def prepare(
        self,
        tokens: int,
        widths: set[int] | tuple[int, ...],
        report: Callable[[str], None] | None = None,
        exact: bool = True,
        slot: int = 0,
    ) -> None:
        """Size ``slot``'s caches for ``tokens`` and compile the verifier's steps of these ``widths`` (and
        the draft's) now, before anything is timed; more than MAX_GRAPHS widths (a sweep over k)
        become power-of-two widths that shorter steps pad to. ``exact=False`` compiles only what no
        compiled width covers. Eager runners: nothing to do. If compiling fails, the engine goes
        eager and ``compile_note`` says why."""
        tokens = min(tokens, self.context_length + 1)
        s = self.slots[slot]
        if not self.compiled:  # (llama.cpp sizes its context now, not mid-run; a no-op for transformers)
            for runner in [s.verifier] + ([s.draft_runner] if s.draft_runner is not None else []):
                runner.reserve(tokens, tuple(widths))
            return
        widths = sorted(set(widths))
        if len(widths) > MAX_GRAPHS:
            widths = sorted({1 << (w - 1).bit_length() for w in widths})
        try:
            s.verifier.reserve(tokens, tuple(widths), report, exact)
            if s.draft_runner is not None:
                s.draft_runner.reserve(tokens, DRAFT_WIDTHS, report, exact)
        except CompileUnavailable as err:
            self.compile_note = f"compiling failed ({err}); running eagerly"
            if report is not None:
                report(self.compile_note)
            self._build(False)

    def kv_bytes_per_token(self) -> int:
        """Bytes one cached token takes in every model's KV cache: what a slot costs per token."""
        backend = backend_of(self.pair.verifier.backend)
        return sum(backend.kv_bytes_per_token(lm) for lm in (self.pair.verifier, self.pair.draft) if lm is not None)

    @property
    def compile_seconds(self) -> float:
        return sum(r.compile_seconds for r in self.runners)

    @property
    def cost_source(self) -> str:
        """Whose draft costs a choice of k mostly rests on: the draft model's, else the free drafter's."""
        return MODEL if self.pair.draft is not None or self.free is None else self.free.kind

    def reset(self) -> None:
        """Forget every slot's caches (the next generate prefills from scratch; a drafter rebuilds the rest
        of its state when it starts the next sequence)."""
        for slot in self.slots:
            slot.reset()

    def score(self, ids: list[int], keep: int) -> torch.Tensor:
        """The verifier's logits [keep, V] (float32, a copy) for the last ``keep`` positions of ``ids``,
        read in slot 0 from empty caches (scoring: temperature 1, nothing filtered); every slot's
        caches are dropped before and after."""
        self.reset()
        try:
            return self.slots[0].verifier.forward(ids, keep=keep).float().clone()  # (llama.cpp: a view of its buffer)
        finally:
            self.reset()

    def probe_costs(self, k_max: int, length: int = 128) -> bool:
        """Seed the cost store with a short timing probe over a synthetic ``length``-token context
        (a few seconds, once per pair, device and dtype: the result is cached). Drops the caches.
        Returns False when the context window is too small to probe."""
        length = min(length, self.context_length - k_max - 3)
        if length < 4:
            return False
        ids = [(7 + 31 * i) % self.pair.vocab_size for i in range(length + k_max + 1)]
        self.prepare(length + k_max + 2, self.step_widths(k_max))  # compiled: every width pads to k_max + 1
        probed = self.slots[0]  # (it times slot 0's sequences; the other slots keep what they cache)
        probed.reset()
        v, d = probed.verifier, probed.draft_runner
        with torch.inference_mode():
            v.forward(ids[:length], keep=1)

            def verify_forward(w: int) -> None:
                v.forward(ids[length : length + w], keep=w)
                v.crop(length)

            dids = [t % d.vocab_size for t in ids] if d is not None else []  # (a draft may have its own vocabulary)

            def draft_forward() -> None:
                d.forward(dids[length : length + 1], keep=1)
                d.crop(length)

            if d is not None:
                d.forward(dids[:length], keep=1)

            def timed() -> None:
                probe(
                    self.costs.costs,
                    verify_forward,
                    draft_forward if d is not None else None,
                    probe_widths(k_max),
                    lambda: sync(self.pair.verifier.device),
                )

            conditions = Conditions.start()
            try:
                if self.pair.verifier.device.type == "cpu":  # (the share of the CPU its threads got)
                    conditions.measure(self.pair.verifier.threads or torch.get_num_threads(), timed, "probe")
                else:
                    timed()
            finally:
                probed.reset()
        self.costs.probed(conditions.finish())
        return True

    def cost_summary(self, params: GenerationParams) -> dict[str, Any]:
        """The cost model's figures and the acceptance estimate for ``params`` (for --json, /stats)."""
        sp = params.sampling
        akey = acceptance_key(params.rule, params.rule_kwargs, sp.temperature, sp.top_k, sp.top_p)
        out = self.costs.describe(akey, max(params.num_draft_tokens, 1), self.cost_source)
        out["adaptive_k"] = params.adaptive_k
        return out

    def generate(
        self, prompt_ids: list[int], params: GenerationParams, reuse_cache: bool = False
    ) -> Iterator[StepEvent]:
        """Step events with text for ``prompt_ids`` in slot 0: each event's pieces, rejected drafts
        as text, stop strings (where the text stops, the run's output ends too). With
        ``reuse_cache`` the KV caches keep the longest prefix the prompt shares with the previous
        sequence (chat turns), so only the new tokens are encoded. A generation started earlier
        and not finished loses the caches: its next step is an error, never a step on another's."""
        return self.events(self.start(prompt_ids, params), reuse_cache)

    def steps(self, prompt_ids: list[int], params: GenerationParams, reuse_cache: bool = False) -> Iterator[StepEvent]:
        """Token events after ``prompt_ids`` (no text)."""
        return self.events(self.start(prompt_ids, params), reuse_cache, text=False)

    def events(self, run: Request, reuse_cache: bool = False, text: bool = True) -> Iterator[StepEvent]:
        """``run``'s events (placed already) in a batch of its own, stepped only when the caller asks."""
        return (batch := Batch(self)).events(batch.add(run, reuse_cache, text))

    def request(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        deliver: Callable[[Any], None] | None = None,
        label: str = "",
    ) -> Request:
        """A request for ``prompt_ids`` (waiting for a slot: ``place``), checked, with its own k policy."""
        if not prompt_ids:
            raise ContextLimitError("the prompt is empty after tokenization; give the model something to continue")
        if len(prompt_ids) >= self.context_length:
            raise ContextLimitError(
                f"the prompt is {len(prompt_ids)} tokens but the context window is {self.context_length}; "
                "shorten the prompt"
            )
        policy = self.policy(params)
        return Request(self.context, prompt_ids, params, policy, deliver, label)

    def place(self, run: Request, slot: int = 0, probe: bool = False) -> Request:
        """``run`` will run in ``slot``: its caches are sized for it (a compiled engine compiles
        what no compiled width covers) and, with ``probe``, a pair never timed here is timed for
        its -k auto first (it drops ``slot``'s caches: only when no other run holds them)."""
        params = run.params
        if probe and params.adaptive_k and self.probe_due():
            self.probe_costs(params.num_draft_tokens)
        # (an answer without a cap grows an eager cache as it goes; a static one is sized once)
        ahead = params.max_tokens if self.compiled else min(params.max_tokens, RESERVE_AHEAD)
        self.prepare(len(run.prompt) + ahead + 1, self.step_widths(params.num_draft_tokens), self.report, False, slot)
        run.place(self.slots[slot])
        return run

    def start(self, prompt_ids: list[int], params: GenerationParams, slot: int = 0) -> Request:
        return self.place(self.request(prompt_ids, params), slot)  # (made, then placed in ``slot``)

    def probe_due(self) -> bool:
        """Whether -k auto has nothing (or only a provisional figure) measured here to go on."""
        return self.has_drafter and self.costs.needs_probe(self.cost_source)

    def policy(self, params: GenerationParams) -> KPolicy:
        """A run's own k policy over the engine's store and ``learned`` (a warm-up's learns nothing)."""
        if not params.learn:
            return FixedK(None) if not params.adaptive_k else AdaptiveK(CostStore(kinds=tuple(KINDS)))
        return AdaptiveK(self.costs, self.learned) if params.adaptive_k else FixedK(self.costs)

    def admit(self, run: Request) -> None:
        """The run takes its slot's caches (a run there not finished loses them), keeping what
        they hold of its prompt (``run.reuse``; or a ``run.donor``'s); the rest is fed by
        ``prefill`` or chunk by chunk (batch.py)."""
        run.slot.owner = run
        run.slot.used = time.monotonic()
        run.begin()
        run.admit()

    def prefill(self, run: Request) -> None:
        """``admit``, then the rest of the prompt in one call."""
        self.admit(run)
        with torch.inference_mode():
            for runner, ids in ((run.slot.verifier, run.pending), (run.draft_runner, run.draft_pending)):
                if ids:
                    runner.forward(ids, keep=1)
            run.pending, run.draft_pending = [], []
            run.settle()

    def finish(self, run: Request, learn: bool = True) -> None:
        """The run is done: its drafter learns what it output (unless it failed), the store is saved."""
        if run.slot.owner is run:
            run.slot.owner = None
            if run.drafter is not None and run.prefilled:  # (one ended mid-prefill never started its drafter)
                run.drafter.finish(run.output() if learn else [])
        if run.params.learn:
            self.costs.save(
                every=SAVE_EVERY
            )  # what this run learned, for the next run (a server's: at most once a second)

    @torch.inference_mode()
    def step(self, runs: list[Request], chunks: Sequence[Chunk] = ()) -> list[StepEvent | Exception]:
        """One round for every run: choose k together, draft, one verifier call, each run's rule,
        one host read, commit. ``chunks``: prompt chunks of runs still prefilling (batch.py), fed
        to the verifier in the same call (no logits read), and to a draft model that reads the
        prompt in one call after it. Returns each run's event, or its own error (the others' go on)."""
        for run in runs:
            if run.slot.owner is not run:
                raise RuntimeError(
                    "this generation's caches were taken by a later one on the same engine; "
                    "finish (or close) one generator before starting the next"
                )
        wants = [run.want() for run in runs]
        asked = [(i, w) for i, w in enumerate(wants) if w is not None]
        costs = runs[0].policy.store.costs if len(runs) == 1 and runs[0].policy.store is not None else self.costs.costs
        width = MAX_STEP_WIDTH - (len(runs) - len(asked))  # (the runs that draft nothing verify one token each)
        for (i, w), k in zip(asked, allocate(costs, [w for _, w in asked], width) if asked else []):
            runs[i].k = runs[i].policy.settle(w, k)
        t0 = time.perf_counter()
        forced = {}  # (a grammar that forces the next tokens drafts them itself; the drafter rests)
        for i, run in enumerate(runs):
            if run.constraint is not None and (proposal := run.forced()) is not None:
                forced[i], run.k = proposal, 0
        items = [(r.drafter, r.tokens, r.k, r.sp, r.dgen) for r in runs if r.k]
        made = iter(propose_all(items)) if items else iter(())
        proposals = [forced[i] if i in forced else next(made) if r.k else None for i, r in enumerate(runs)]
        for i, (run, proposal) in enumerate(zip(runs, proposals)):
            if proposal is not None:
                sync(proposal.tokens.device)
                run.k = len(proposal.tokens)  # a lookup may offer fewer than k
                run.source = proposal.source if run.k else None
            if run.constraint is not None:
                proposals[i] = run.constrain(proposal)
        t1 = time.perf_counter()
        verdicts, forward = self._verify(runs, proposals, chunks)
        timing = Timing(t1 - t0, time.perf_counter() - t1, forward)
        if fed := [(run.draft_runner, ids, 0) for run, _, ids in chunks if ids]:
            fed[0][0].forward_rows(fed)
        alone = len(runs) == 1 and not chunks  # (a step with a chunk in it times more than its verifies)
        if not alone and not chunks and all(r.params.learn for r in runs):
            self.costs.observe_verify(sum(r.k + 1 for r in runs), timing.verify_seconds)
        out: list[StepEvent | Exception] = []
        for run, proposal, verified in zip(runs, proposals, verdicts):
            if isinstance(verified, Exception):
                out.append(verified)
                continue
            out.append(run.commit(verified, proposal.fed if proposal is not None else 0, timing, alone))
        return out

    def _verify(self, runs: list[Request], proposals: list, chunks: Sequence[Chunk] = ()) -> tuple[list, float]:
        """One verifier call over every run's row (its last token and its drafts) and every
        prompt chunk, each run's rule over its own row, and ONE host read of every verdict; and
        the seconds the call took."""
        vdev = self.pair.verifier.device
        rows, drafts = [], []
        for run, proposal in zip(runs, proposals):
            slot = run.slot
            if slot.verifier.cache_len != len(slot.tokens) - 1:  # (the invariant every step starts from)
                raise RuntimeError(
                    f"internal error: the verifier caches {slot.verifier.cache_len} tokens of a "
                    f"{len(slot.tokens)}-token sequence; it must hold all but the last"
                )
            d = proposal.tokens.to(vdev) if run.k else torch.zeros(0, dtype=torch.int64, device=vdev)  # [k]
            drafts.append(d)
            rows.append((slot.verifier, torch.cat([run.last, d]), run.k + 1))
        rows += [(run.slot.verifier, ids, 0) for run, ids, _ in chunks if ids]
        t0 = time.perf_counter()
        first = rows[0][0]  # (any sequence's runner calls its model for every row)
        logits = first.forward_rows(rows) if len(rows) > 1 else [first.forward(*rows[0][1:])]
        forward = time.perf_counter() - t0
        logits = logits[: len(runs)]
        decided = [run.decide(lg, pr, d) for run, lg, pr, d in zip(runs, logits, proposals, drafts)]
        ruled = [d for d in decided if d.row is not None]
        for d, verdict in zip(ruled, verify_rows([d.row for d in ruled]) if ruled else []):
            d.verdict = verdict  # (every rule row of the step in one call: each its own rule, k and generator)
        packed = [d.packed() for d in decided]
        host = torch.cat(packed).tolist() if len(packed) > 1 else packed[0].tolist()  # (the sync)
        out, at = [], 0
        for run, d, pk in zip(runs, decided, packed):
            try:
                out.append(run.verified(host[at : at + pk.shape[0]], d))
            except Exception as err:  # noqa: BLE001 (a NaN or non-finite row ends its run alone)
                out.append(err)
            at += pk.shape[0]
        return out, forward


RESERVE_AHEAD = 2048  # tokens of room made ahead of a prompt at most; an answer that runs longer grows the caches
