"""The speculative decoding engine: one generator of StepEvents that every command consumes.

Per step (``_Run.step``): choose k (the k policy), draft (k draft forwards of one token each, the
first also feeding what the draft has not seen yet), verify (one verifier forward over the last
token plus the k drafts, then the acceptance rule and the step's one host sync; nothing is
committed), commit (the policy learns the step's costs, both KV caches are cropped to the
accepted length, the sequence grows). The engine speaks tokens: text, stop strings and the
rejected drafts as text are added by text.py's stream around it, outside the timed region.
The engine never imports Rich and never names a concrete drafter or runner (factories do).
Long because it holds the engine and its one step loop together: the round of choose-k, draft,
verify, commit reads best in one file, next to the state it changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from cactus_cli.core import defaults
from cactus_cli.core.acceptance import Verdict, greedy_verify, verify
from cactus_cli.core.errors import ContextLimitError, ModelError
from cactus_cli.core.events import MODEL, StepEvent
from cactus_cli.core.exact import meter
from cactus_cli.core.sampling import SamplingParams, probs_from_logits, sample_among, top_probs
from cactus_cli.infer.backends import backend_of
from cactus_cli.infer.costs import CostStore, Step, cost_key, probe, probe_widths
from cactus_cli.infer.draft import Drafter, Free, Proposal, make_drafter
from cactus_cli.infer.policy import AdaptiveK, FixedK, KPolicy, acceptance_key
from cactus_cli.infer.runners.base import Runner, sync, to_device
from cactus_cli.infer.runners.compiled import CompileUnavailable
from cactus_cli.infer.sources import ModelPair, eos_ids
from cactus_cli.infer.text import TextStream


@dataclass(frozen=True)
class GenerationParams:
    """One generation's parameters (copy with ``dataclasses.replace``)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    rule: str = defaults.RULE
    rule_kwargs: dict[str, Any] = field(default_factory=dict)
    num_draft_tokens: int = defaults.NUM_DRAFT_TOKENS  # k (k_max when adaptive); 0 runs the verifier alone
    adaptive_k: bool = False  # -k auto: AdaptiveK picks k in 0..num_draft_tokens before each step
    max_tokens: int = defaults.MAX_TOKENS
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int = 0
    measure: bool = False  # the divergence meter: realized KL/TV per position, verifier log-likelihood
    learn: bool = (
        True  # teach the cost store this run's step costs and a drafter's history this sequence (a warm-up does not)
    )
    memory: str = ""  # which history a drafter with memory reads and extends (bench: one per configuration)


DRAFT_WIDTHS = (1, 2)  # the draft's compiled steps: one token, or the last draft + the bonus after a full acceptance
MAX_GRAPHS = 4  # verifier widths compiled as asked; a longer list (a sweep over k) is bucketed to powers of two


class SpeculativeEngine:
    def __init__(self, pair: ModelPair, free: Free | None = None, compiled: bool = False):
        """``free`` drafts without a model (draft/__init__.KINDS: prompt lookup, the suffix trees), with the pair's draft model
        (if any) for when they have nothing. ``compiled``: static caches and compiled steps
        (runners/compiled.py)."""
        self.pair = pair
        self.free = free
        self.eos = eos_ids(pair)
        limits = [pair.verifier.context_length] + ([pair.draft.context_length] if pair.draft else [])
        self.context_length = min(limits)
        self.tokens: list[int] = []  # what the caches hold: the verifier's holds tokens[: cache_len]
        self.owner: _Run | None = None  # the generation whose caches these are, while it runs
        self.compile_note: str | None = None  # why a compiled engine runs eagerly, if it does
        self.report: Callable[[str], None] | None = None  # progress lines (a compile during generate)
        self._build(compiled)

    def _build(self, compiled: bool) -> None:
        """Runners, drafter and cost store; called again if compiling turns out not to work."""
        pair = self.pair
        self.compiled = compiled
        backend = backend_of(pair.verifier.backend)
        self.verifier: Runner = backend.runner(
            pair.verifier, pair.vocab_size, compiled, self.context_length, "verifier"
        )
        draft = None
        if pair.draft is not None:  # (a draft with its own tokenizer runs eagerly: its token count differs)
            draft = backend.runner(
                pair.draft,
                pair.cross.rows if pair.cross else pair.vocab_size,
                compiled and pair.cross is None,
                self.context_length,
                "draft",
            )
        self.drafter: Drafter | None = make_drafter(
            draft, self.free, pair.vocab_size, pair.verifier.device, pair.cross, pair.tokenizer
        )
        self.tokens = []
        self.costs = CostStore.read(cost_key(pair, compiled))  # what a step costs here
        self.auto_k = AdaptiveK(self.costs)  # -k auto (its exploration spans runs)

    @property
    def draft_runner(self) -> Runner | None:
        return self.drafter.runner if self.drafter is not None else None

    @property
    def runners(self) -> list[Runner]:
        return [self.verifier] + ([self.draft_runner] if self.draft_runner is not None else [])

    def step_widths(self, k: int) -> tuple[int, ...]:
        """The verifier's step width for draft length k (k_max with -k auto): every step of such a
        run, k = 0 and shorter lookups included, is padded to it when compiled."""
        return (k + 1,) if k > 0 and self.drafter is not None else (1,)

    def prepare(
        self,
        tokens: int,
        widths: set[int] | tuple[int, ...],
        report: Callable[[str], None] | None = None,
        exact: bool = True,
    ) -> None:
        """Size the caches for ``tokens`` and compile the verifier's steps of these ``widths`` (and
        the draft's) now, before anything is timed; more than MAX_GRAPHS widths (a sweep over k)
        become power-of-two widths that shorter steps pad to. ``exact=False`` compiles only what no
        compiled width covers. Eager runners: nothing to do. If compiling fails, the engine goes
        eager and ``compile_note`` says why."""
        tokens = min(tokens, self.context_length + 1)
        if not self.compiled:  # (llama.cpp sizes its context now, not mid-run; a no-op for transformers)
            for runner in self.runners:
                runner.reserve(tokens, tuple(widths))
            return
        widths = sorted(set(widths))
        if len(widths) > MAX_GRAPHS:
            widths = sorted({1 << (w - 1).bit_length() for w in widths})
        try:
            self.verifier.reserve(tokens, tuple(widths), report, exact)
            if self.draft_runner is not None:
                self.draft_runner.reserve(tokens, DRAFT_WIDTHS, report, exact)
        except CompileUnavailable as err:
            self.compile_note = f"compiling failed ({err}); running eagerly"
            if report is not None:
                report(self.compile_note)
            self._build(False)

    @property
    def compile_seconds(self) -> float:
        return sum(r.compile_seconds for r in self.runners)

    @property
    def cost_source(self) -> str:
        """Whose draft costs a choice of k mostly rests on: the draft model's, else the free drafter's."""
        return MODEL if self.draft_runner is not None or self.free is None else self.free.kind

    def reset(self) -> None:
        """Forget both caches (the next generate prefills from scratch; a drafter rebuilds the rest
        of its state when it starts the next sequence)."""
        self.verifier.reset()
        if self.draft_runner is not None:
            self.draft_runner.reset()
        self.tokens = []

    def cache_lengths(self) -> dict[str, int]:
        """For tests and diagnostics: the verifier cache always holds the sequence minus its last
        token; the draft's holds a prefix of it, the rest (``draft_pending``) fed by its next forward."""
        out = {"sequence": len(self.tokens), "verifier": self.verifier.cache_len}
        if self.draft_runner is not None:
            out["draft"] = self.draft_runner.cache_len
            out["draft_pending"] = len(self.tokens) - self.draft_runner.cache_len
        return out

    def probe_costs(self, k_max: int, length: int = 128) -> bool:
        """Seed the cost store with a short timing probe over a synthetic ``length``-token context
        (a few seconds, once per pair, device and dtype: the result is cached). Drops the caches.
        Returns False when the context window is too small to probe."""
        length = min(length, self.context_length - k_max - 3)
        if length < 4:
            return False
        ids = [(7 + 31 * i) % self.pair.vocab_size for i in range(length + k_max + 1)]
        self.prepare(length + k_max + 2, self.step_widths(k_max))  # compiled: every width pads to k_max + 1
        self.reset()
        v, d = self.verifier, self.draft_runner
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
            try:
                probe(
                    self.costs.costs,
                    verify_forward,
                    draft_forward if d is not None else None,
                    probe_widths(k_max),
                    lambda: sync(self.pair.verifier.device),
                )
            finally:
                self.reset()
        self.costs.dirty = True
        self.costs.save()
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
        """``steps`` with text: each event's pieces, rejected drafts as text, stop strings (where
        the text stops, the run's output ends too: ``_Run.cut_output``)."""
        run = self._start(prompt_ids, params)
        return TextStream(self.pair.tokenizer, params.stop, run.cut_output).wrap(self._loop(run, reuse_cache))

    def steps(self, prompt_ids: list[int], params: GenerationParams, reuse_cache: bool = False) -> Iterator[StepEvent]:
        """Token events after ``prompt_ids`` (no text). With ``reuse_cache`` the KV caches keep the
        longest prefix the prompt shares with the previous sequence (chat turns), so only the new
        tokens are encoded."""
        return self._loop(self._start(prompt_ids, params), reuse_cache)

    def _start(self, prompt_ids: list[int], params: GenerationParams) -> "_Run":
        """Check the prompt, size the caches, and make the run: the one generation's state, held by
        the generator the caller iterates (the engine keeps only its caches and what they hold)."""
        if not prompt_ids:
            raise ContextLimitError("the prompt is empty after tokenization; give the model something to continue")
        if len(prompt_ids) >= self.context_length:
            raise ContextLimitError(
                f"the prompt is {len(prompt_ids)} tokens but the context window is {self.context_length}; "
                "shorten the prompt"
            )
        self.prepare(
            len(prompt_ids) + params.max_tokens + 1, self.step_widths(params.num_draft_tokens), self.report, exact=False
        )
        return _Run(self, list(prompt_ids), params, self.policy(params))

    def policy(self, params: GenerationParams) -> KPolicy:
        if not params.learn:
            return FixedK(None) if not params.adaptive_k else AdaptiveK(CostStore())
        return self.auto_k if params.adaptive_k else FixedK(self.costs)

    def _loop(self, run: "_Run", reuse: bool) -> Iterator[StepEvent]:
        """One generation: it takes the caches (a generation started earlier and not finished
        loses them: its next step is an error, never a step on another's caches), prefills, then
        steps until a finish reason."""
        self.owner = run
        run.begin()
        try:
            run.prefill(reuse)
        except BaseException:
            self.reset()  # a half-done prefill leaves caches we cannot trust
            self.owner = None
            raise
        try:
            while True:
                if self.owner is not run:
                    raise RuntimeError(
                        "this generation's caches were taken by a later one on the same engine; "
                        "finish (or close) one generator before starting the next"
                    )
                try:
                    event = run.step()
                except BaseException:
                    # interrupted mid-step (Ctrl-C, OOM): caches may be half-updated; drop them, so the
                    # next call prefills from scratch instead of decoding from a corrupt cache
                    self.reset()
                    raise
                paused = time.perf_counter()
                yield event  # closing the generator here (GeneratorExit) leaves consistent caches
                run.paused += time.perf_counter() - paused  # the consumer's time (text, display) is not ours
                if event.finish_reason:
                    return
        finally:
            if self.owner is run:
                self.owner = None
                if run.drafter is not None:  # what was output (not what a verified block held past EOS or a stop)
                    run.drafter.finish(self.tokens[: len(run.prompt) + run.produced] if self.tokens else [])
            if run.params.learn:
                self.costs.save()  # what this run learned about step costs, for the next run


@dataclass
class _Verified:
    """What the verifier decided about one proposal (nothing committed yet)."""

    accepted: int  # m: drafts kept
    new: list[int]  # the m accepted drafts and the correction or bonus token
    drafts: list[int]
    next_input: torch.Tensor  # [1] on the verifier's device: the next step's first input
    p: torch.Tensor | None  # [1, k, V] draft probabilities (None when greedy)
    q: torch.Tensor | None  # [1, k+1, V] verifier probabilities (None when greedy)
    logits: torch.Tensor  # [k+1, V]


@dataclass(frozen=True)
class HostRead:
    """The step's one device-to-host copy, packed as one int64 vector and unpacked here:

    [m, tokens[0..k], drafts[0..k-1], nan, nonfinite?]
     1  k+1 (the m accepted, the extra, then -1s)  k  1   1 (sampling only)
    """

    accepted: int
    tokens: list[int]  # [k+1]: the verdict's row
    drafts: list[int]  # [k]
    nan_logits: bool
    nonfinite_probs: bool

    @staticmethod
    def pack(verdict: Verdict, drafts: torch.Tensor, flags: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([verdict.num_accepted[:1], verdict.tokens[0], drafts, torch.stack(flags).to(torch.int64)])

    @classmethod
    def read(cls, packed: torch.Tensor, k: int) -> "HostRead":
        host = packed.tolist()  # (the sync)
        return cls(
            host[0],
            host[1 : k + 2],
            host[k + 2 : 2 * k + 2],
            bool(host[2 * k + 2]),
            len(host) > 2 * k + 3 and bool(host[2 * k + 3]),
        )


@dataclass(frozen=True)
class Timing:
    draft_seconds: float
    verify_seconds: float


class _Run:
    """The state of one generation; ``step`` is one choose-k / draft / verify / commit round."""

    def __init__(self, engine: SpeculativeEngine, prompt: list[int], params: GenerationParams, policy: KPolicy):
        self.e = engine
        self.prompt = prompt
        self.params = params
        self.policy = policy
        self.sp = params.sampling
        self.vdev = engine.pair.verifier.device
        self.vgen = torch.Generator(device=self.vdev).manual_seed(params.seed)
        self.drafter = engine.drafter if params.num_draft_tokens > 0 else None
        self.draft_runner = self.drafter.runner if self.drafter is not None else None
        self.akey = acceptance_key(params.rule, params.rule_kwargs, self.sp.temperature, self.sp.top_k, self.sp.top_p)
        self.dgen = None
        if self.drafter is not None:
            ddev = self.draft_runner.lm.device if self.draft_runner is not None else self.vdev
            self.dgen = self.vgen if ddev == self.vdev else torch.Generator(device=ddev).manual_seed(params.seed + 1)
        self.produced = 0
        self.first = True
        self.paused = 0.0  # seconds the consumer held the generator between steps
        self.prefill_seconds = 0.0
        self.prefill_tokens = 0
        self.reused_tokens = 0
        self.begin()

    def begin(self) -> None:
        """The clock and the pass counters start when the caller first asks for an event."""
        self.t_start = time.perf_counter()
        self.v_passes = self.e.verifier.forward_passes
        self.d_passes = self._draft_passes()

    def cut_output(self, dropped: int) -> None:
        """A stop string ended the text ``dropped`` emitted tokens before the last event's end:
        the run's output (what a drafter with memory learns) ends there too."""
        self.produced -= dropped

    def _draft_passes(self) -> int:
        return self.draft_runner.forward_passes if self.draft_runner is not None else 0

    @torch.inference_mode()
    def prefill(self, reuse: bool) -> None:
        """Both caches take the prompt minus its last token, which the first step feeds."""
        e, prompt = self.e, self.prompt
        previous = e.tokens
        keep = e.verifier.prefill(prompt, previous, reuse)
        self.reused_tokens = keep
        self.prefill_tokens = len(prompt) - 1 - keep
        e.tokens = list(prompt)
        self.last = to_device(prompt[-1:], self.vdev)  # [1]: the next step's first input
        if self.drafter is not None:
            self.drafter.start(prompt, previous, reuse, self.params.memory if self.params.learn else None)
            draft = self.draft_runner  # (a model behind a lookup reads the prompt when first asked to draft)
            self.policy.started(max(len(prompt) - 1 - draft.cache_len, 0) if draft else 0)
        sync(self.vdev)
        self.prefill_seconds = time.perf_counter() - self.t_start

    @torch.inference_mode()
    def step(self) -> StepEvent:
        k, source, confidence = self.choose_k()
        t0 = time.perf_counter()
        proposal = self.draft(k)
        if proposal is not None:
            k = len(proposal.tokens)  # a lookup may offer fewer than k
            source = proposal.source
        source = source if k else None  # (a plain step drafts nothing, from nowhere)
        t1 = time.perf_counter()
        verified = self.verify(proposal, k)
        timing = Timing(t1 - t0, time.perf_counter() - t1)
        return self.commit(verified, k, source, proposal.fed if proposal is not None else 0, timing, confidence)

    def choose_k(self) -> tuple[int, str | None, list[float] | None]:
        """k for this step, where its drafts come from (None: a plain step), and the drafter's
        own estimate of each token, if it has one."""
        e, params, drafter = self.e, self.params, self.drafter
        if drafter is None:
            return 0, None, None
        room = e.context_length - len(e.tokens)  # positions left for new tokens
        k = max(0, min(params.num_draft_tokens, room - 1, params.max_tokens - self.produced - 1))
        peek = drafter.peek(e.tokens) if k else None
        if peek is None:
            return 0, None, None  # a lookup with nothing to copy: a plain step, at no drafting cost
        source, confidence = peek.source, peek.confidence
        # from past steps and the tree's counts only, never this step's draws: SpS stays lossless
        return self.policy.choose(self.akey, k, source, confidence), source, confidence

    def draft(self, k: int) -> Proposal | None:
        if self.drafter is None or not k:  # (a plain step: the drafter is not asked, it catches up later)
            return None
        proposal = self.drafter.propose(self.e.tokens, k, self.sp, self.dgen)
        sync(proposal.tokens.device)
        return proposal

    def verify(self, proposal: Proposal | None, k: int) -> _Verified:
        """The verifier's forward and the rule's verdict, read back in the step's one host sync
        (accepted count, tokens, drafts and error flags in one copy). Commits nothing."""
        e, sp, vdev = self.e, self.sp, self.vdev
        if e.verifier.cache_len != len(e.tokens) - 1:  # (the invariant every step starts from: a host compare)
            raise RuntimeError(
                f"internal error: the verifier caches {e.verifier.cache_len} tokens of a "
                f"{len(e.tokens)}-token sequence; it must hold all but the last"
            )
        drafts = proposal.tokens.to(vdev) if k else torch.zeros(0, dtype=torch.int64, device=vdev)  # [k]
        logits = e.verifier.forward(torch.cat([self.last, drafts]), keep=k + 1)  # [k+1, V]
        p = q = None
        # never a valid output (an overflow in a low-precision dtype); a NaN anywhere makes the sum NaN,
        # one pass without a [k+1, V] mask (at k = 64 the masks cost more than the rule)
        flags = [torch.isnan(logits.sum())]
        if sp.greedy:
            verdict: Verdict = greedy_verify(drafts.view(1, k), logits.argmax(-1).view(1, k + 1))
        elif k == 0 and 0 < sp.top_k < logits.shape[-1] and not self.params.measure:
            # a plain step: its token comes from the verifier's top-k alone (q is 0 elsewhere), drawn
            # as verify draws it, with no [V] row built (0.5 ms a token on a CPU)
            small, ids = top_probs(logits[0], sp)  # [top_k] each
            flags.append(~torch.isfinite(small.sum()))
            token = sample_among(small, ids, self.vgen).view(1, 1)
            verdict = Verdict(torch.zeros(1, dtype=torch.int64, device=vdev), token, small.new_zeros(1, 0))
        else:
            q = probs_from_logits(logits, sp).unsqueeze(0)  # [1, k+1, V]
            flags.append(~torch.isfinite(q.sum(-1)).all())
            p = proposal.probs.to(vdev).unsqueeze(0) if k else q[:, :0]  # [1, k, V]
            verdict = verify(self.params.rule, p, q, drafts.view(1, k), generator=self.vgen, **self.params.rule_kwargs)
        host = HostRead.read(HostRead.pack(verdict, drafts, flags), k)
        if host.nan_logits:
            raise ModelError(
                f"the verifier returned NaN logits (numerical overflow in "
                f"{str(e.pair.verifier.dtype).removeprefix('torch.')}?); try --dtype float32"
            )
        if host.nonfinite_probs:
            raise ModelError(
                f"temperature {sp.temperature:g} made the verifier's probabilities non-finite; "
                "use a larger temperature, or 0 for greedy"
            )
        m = host.accepted
        return _Verified(m, host.tokens[: m + 1], host.drafts, verdict.tokens[0, m : m + 1], p, q, logits)

    def commit(
        self, v: _Verified, k: int, source: str | None, fed: int, timing: Timing, confidence: list[float] | None = None
    ) -> StepEvent:
        """The policy learns the step; both caches rewind to the verified sequence; the sequence
        grows; the emitted tokens are cut at EOS or max_tokens, and so are the accepted ones
        counted (a draft past the cut was verified, never output)."""
        e, m, new = self.e, v.accepted, v.new
        self.last = v.next_input  # stays on the device for the next step's input
        self.policy.observe(
            Step(self.akey, k, m, timing.draft_seconds, timing.verify_seconds, fed, source or MODEL, confidence)
        )
        measured = (
            meter(self.params.rule, self.params.rule_kwargs, v.p, v.q, v.logits, new, m, k, v.drafts)
            if self.params.measure
            else ((), (), (), ())
        )
        self.rewind(m, new)
        emitted, finish = self.emit(new)
        if finish is None and len(e.tokens) >= e.context_length:
            finish = "context"
        n = len(emitted)
        ev = StepEvent(
            num_drafted=k,
            draft_source=source,
            accepted=tuple(new[: min(m, n)]),
            rejected=tuple(v.drafts[m:]),
            extra=new[-1],
            extra_kind="verifier" if k == 0 else ("bonus" if m == k else "correction"),
            emitted=tuple(emitted),
            pieces=(),
            rejected_text=(),
            draft_seconds=timing.draft_seconds,
            verify_seconds=timing.verify_seconds,
            prefill_seconds=self.prefill_seconds if self.first else 0.0,
            prefill_tokens=self.prefill_tokens if self.first else 0,
            reused_tokens=self.reused_tokens if self.first else 0,
            elapsed=time.perf_counter() - self.t_start - self.paused,
            draft_forward_passes=self._draft_passes() - self.d_passes,
            verifier_forward_passes=e.verifier.forward_passes - self.v_passes,
            prompt_tokens=len(self.prompt),
            finish_reason=finish,
            realized_kl=measured[0][:n],
            realized_tv=measured[1][:n],
            verifier_loglik=measured[2][:n],
            draft_budget=measured[3],
        )
        self.v_passes = e.verifier.forward_passes
        self.d_passes = self._draft_passes()
        self.first = False
        return ev

    def rewind(self, m: int, new: list[int]) -> None:
        """The one place both KV caches go back after a verify. Before: the verifier held the
        sequence minus its last token, then the last token and all k drafts; the draft model
        held a prefix of the sequence plus its own first k - 1 drafts. After: the verifier holds
        the sequence (now grown by the m accepted drafts and the correction or bonus) minus its
        last token, and the drafter crops its cache to the accepted drafts (accept)."""
        e = self.e
        e.verifier.crop(len(e.tokens) + m)
        e.tokens += new
        if self.drafter is not None:
            self.drafter.accept(e.tokens, m)

    def emit(self, new: list[int]) -> tuple[list[int], str | None]:
        """The verified tokens that become output, cut at EOS (kept, it adds no text) or max_tokens."""
        emitted: list[int] = []
        for token in new:
            emitted.append(token)
            self.produced += 1
            if token in self.e.eos and not self.params.ignore_eos:
                return emitted, "eos"
            if self.produced >= self.params.max_tokens:
                return emitted, "length"
        return emitted, None
