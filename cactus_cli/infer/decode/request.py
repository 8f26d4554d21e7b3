"""A request: one sequence's generation, from waiting for a slot to done, and everything that is
its own: its parameters (rule, rule parameters, k, sampling, stop, max tokens), its generators,
its k policy (kpolicy/policy.py says what it shares with the machine), its grammar, its text
stream (stop strings), its counters (``stats``) and clock, its cancel flag, and where its output
goes (``deliver``: serve's client; None: the caller reads ``Batch.step``). The engine makes it
(``engine.request``: every command's, serve's too) and places it in a ``Slot`` (slot.py), which
lends it caches; the engine's ``EngineContext`` is all it reads of the engine.

The engine (engine.py) steps a set of requests together: every request's k, then every draft,
then one verifier call over every request's row, then each request's ``decide`` (its rule over its
own ragged drafts) and ``commit``. Batch 1 is the same code with one request."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cactus_cli.core import defaults
from cactus_cli.core.errors import ModelError
from cactus_cli.core.events import MODEL, StepEvent
from cactus_cli.core.exact import meter
from cactus_cli.core.sampling import SamplingParams, biased, probs_from_logits, sample_among, top_probs
from cactus_cli.core.stats import SpecStats
from cactus_cli.core.verify import Row, Verdict, greedy_verify
from cactus_cli.infer.decode.context import EngineContext
from cactus_cli.infer.decode.grammar import GRAMMAR, MAX_FORCED, Grammar, mask_logits, mask_probs
from cactus_cli.infer.decode.slot import Slot
from cactus_cli.infer.decode.text import TextStream
from cactus_cli.infer.decode.verdict import Decision, HostRead, Timing, Verified, token_logprobs
from cactus_cli.infer.draft import Proposal
from cactus_cli.infer.kpolicy.costs import Step
from cactus_cli.infer.kpolicy.policy import KPolicy, Want, acceptance_key
from cactus_cli.infer.runner import cached_prefix, common_prefix, sync, to_device


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
    # learn: teach the cost store this run's step costs and a drafter's history this sequence (a warm-up does not)
    learn: bool = True
    memory: str = ""  # which history a drafter with memory reads and extends (bench: one per configuration)
    logprobs: int | None = None  # each emitted token's log-probability under the verifier, and this many alternatives
    grammar: Grammar | None = None  # what the output must match (grammar.py: JSON output), or anything


class Request:
    """One generation; the engine places it in a slot and steps it (choose k, draft, verify, commit)."""

    def __init__(
        self,
        ctx: EngineContext,
        prompt: list[int],
        params: GenerationParams,
        policy: KPolicy,
        deliver: Callable[[Any], None] | None = None,
        label: str = "",
    ):
        """``ctx``: what it reads of the engine stepping it (end tokens, context length, vocabulary,
        grammars); ``deliver``: where its events go (serve: from the worker thread, each event, then
        the end or an error); ``label``: what a log names it by (serve --log-requests: its text)."""
        self.ctx = ctx
        self.prompt = list(prompt)
        self.params = params
        self.policy = policy
        self.deliver, self.label = deliver, label
        self.stats = SpecStats()  # its own, as its events come (batch.py counts each one)
        self.cancelled = False  # asked to end (its client left): it ends between steps
        self.text: TextStream | None = None  # its text and stop strings (batch.py; None: token events only)
        self.reuse, self.donor = False, None  # keep what its slot holds of its prompt; a slot to adopt it from
        self.done = False  # ended: finished, failed or cancelled
        self.slot: Slot | None = None  # placed by the engine when a slot is free (``place``)
        self.sp = params.sampling
        self.vdev = ctx.device
        self.vgen = torch.Generator(device=self.vdev).manual_seed(params.seed)
        self.akey = acceptance_key(params.rule, params.rule_kwargs, self.sp.temperature, self.sp.top_k, self.sp.top_p)
        self.drafter = self.draft_runner = self.dgen = None  # (its slot's: ``place``)
        self.produced = 0
        self.first = True
        self.admitted = self.prefilled = False  # admit: the slot's caches are its own; settle: they hold its prompt
        self.pending: list[int] = []  # the prompt the verifier has still to read (and the draft, if it reads it)
        self.draft_pending: list[int] = []
        self.paused = 0.0  # seconds the consumer held the run between steps
        self.prefill_seconds = 0.0
        self.prefill_tokens = 0
        self.reused_tokens = 0
        self.k = 0  # this step's choice, and where its drafts come from
        self.source: str | None = None
        self.confidence: list[float] | None = None
        self.constraint = ctx.grammars.constraint(params.grammar) if params.grammar is not None else None
        self.allowed: torch.Tensor | None = None  # [k+1, V] this step's grammar masks

    def place(self, slot: Slot) -> None:
        """The slot it will run in: its drafter (when it drafts) and the draft's generator."""
        self.slot = slot
        self.drafter = slot.drafter if self.params.num_draft_tokens > 0 else None
        self.draft_runner = self.drafter.runner if self.drafter is not None else None
        if self.drafter is not None:
            ddev = self.draft_runner.lm.device if self.draft_runner is not None else self.vdev
            self.dgen = (
                self.vgen if ddev == self.vdev else torch.Generator(device=ddev).manual_seed(self.params.seed + 1)
            )
        self.begin()

    def cancel(self) -> None:
        """End it between steps (from any thread: its client has gone, or it has what it needs)."""
        self.cancelled = True

    @property
    def state(self) -> str:
        """waiting (for a slot, or for its slot's caches), prefilling, decoding or done."""
        if self.done:
            return "done"
        return "decoding" if self.prefilled else "prefilling" if self.admitted else "waiting"

    @property
    def tokens(self) -> list[int]:
        return self.slot.tokens if self.slot is not None else []

    def begin(self) -> None:
        """The clock and the pass counters start when the run is first stepped."""
        self.t_start = time.perf_counter()
        self.v_passes = self.slot.verifier.forward_passes
        self.d_passes = self._draft_passes()

    def cut_output(self, dropped: int) -> None:
        """A stop string ended the text ``dropped`` emitted tokens before the last event's end:
        the run's output (what a drafter with memory learns) ends there too."""
        self.produced -= dropped

    def output(self) -> list[int]:
        """What was output (not what a verified block held past EOS or a stop)."""
        return self.tokens[: len(self.prompt) + self.produced] if self.tokens else []

    def _draft_passes(self) -> int:
        return self.draft_runner.forward_passes if self.draft_runner is not None else 0

    def admit(self) -> None:
        """The run takes its slot's caches, keeping what they hold of the prompt (``reuse``), or what
        ``donor`` (another slot whose caches hold a longer prefix of it) holds, adopted rather
        than computed again. What the verifier still has to read of the prompt minus its last
        token is ``pending``: fed whole (engine.prefill) or in chunks that share the steps of the runs
        already decoding (batch.py); then ``settle``."""
        slot, prompt, reuse, donor = self.slot, self.prompt, self.reuse, self.donor
        previous = slot.tokens
        if donor is not None and reuse:
            shared = slot.verifier.adopt(
                donor.verifier, common_prefix(donor.tokens[: donor.verifier.cache_len], prompt)
            )
            if shared:
                previous = donor.tokens[:shared]
                if slot.draft_runner is not None and donor.draft_runner is not None:
                    slot.draft_runner.adopt(donor.draft_runner, min(shared, donor.draft_runner.cache_len))
                    if slot.draft_runner.cache_len < shared:
                        slot.draft_runner.reset()
        keep = cached_prefix(slot.verifier, prompt, previous, reuse)
        if self.drafter is not None and self.drafter.reads_prompt:  # (its model reads the prompt as the verifier does)
            self.draft_pending = prompt[cached_prefix(self.draft_runner, prompt, previous, reuse) : -1]
        self.previous = previous
        self.reused_tokens = keep
        self.prefill_tokens = len(prompt) - 1 - keep
        self.pending = prompt[keep:-1]
        slot.tokens = list(prompt)  # (the verifier's cache holds its first cache_len tokens as it fills)
        self.admitted = True

    @torch.inference_mode()
    def settle(self) -> None:
        """The verifier holds the prompt minus its last token: the draft side starts (a draft
        model that is not behind a lookup prefills now), and the prefill's clock stops."""
        slot, prompt, previous, reuse = self.slot, self.prompt, self.previous, self.reuse
        self.last = to_device(prompt[-1:], self.vdev)  # [1]: the next step's first input
        draft = slot.draft_runner
        if self.drafter is None and draft is not None and draft.cache_len:
            # a run that does not draft leaves the draft model's cache behind: keep only what the new
            # sequence shares with it, so it holds a prefix of the slot's tokens for the next run
            shared = common_prefix(previous[: draft.cache_len], prompt) if reuse else 0
            if shared:
                draft.crop(shared)
            else:
                draft.reset()
        if self.drafter is not None:
            if self.drafter.reads_prompt:  # (fed here already: its start finds the prompt cached)
                previous, reuse = prompt, True
            self.drafter.start(prompt, previous, reuse, self.params.memory if self.params.learn else None)
            draft = self.draft_runner  # (a model behind a lookup reads the prompt when first asked to draft)
            self.policy.started(max(len(prompt) - 1 - draft.cache_len, 0) if draft else 0)
        sync(self.vdev)
        self.prefill_seconds = time.perf_counter() - self.t_start - self.paused
        self.prefilled = True

    def want(self) -> Want | None:
        """What this run's next step could draft (None: a plain step, at no drafting cost), and
        where from; the drafter's own estimate of each token, if it has one, is kept for commit."""
        params, drafter = self.params, self.drafter
        self.k, self.source, self.confidence = 0, None, None
        if drafter is None:
            return None
        room = self.ctx.context_length - len(self.tokens)  # positions left for new tokens
        k = max(0, min(params.num_draft_tokens, room - 1, params.max_tokens - self.produced - 1))
        peek = drafter.peek(self.tokens) if k else None
        if peek is None:
            return None  # a lookup with nothing to copy: a plain step
        self.source, self.confidence = peek.source, peek.confidence
        # from past steps and the tree's counts only, never this step's draws: SpS stays lossless
        return self.policy.want(self.akey, k, peek.source, peek.confidence)

    def forced(self) -> Proposal | None:
        """With a grammar that forces the next tokens: those tokens as this step's drafts (source
        ``grammar``, drafted at no cost, each with probability 1), instead of asking the drafter."""
        room = min(self.ctx.context_length - len(self.tokens), self.params.max_tokens - self.produced) - 1
        ahead = self.constraint.forced()[: max(0, min(room, MAX_FORCED))]
        if not ahead:
            return None
        tokens = torch.tensor(ahead, dtype=torch.int64, device=self.vdev)
        probs = None
        if not self.sp.greedy:
            probs = torch.zeros(len(ahead), self.ctx.vocab_size, device=self.vdev)
            probs[torch.arange(len(ahead), device=self.vdev), tokens] = 1.0
        return Proposal(tokens, probs, GRAMMAR, 0)

    def constrain(self, proposal: Proposal | None) -> Proposal | None:
        """With a grammar: the drafts cut before the first one it refuses, and the masks at each
        position of the verify block (grammar.py says why the rules stay exact)."""
        drafts = proposal.tokens.tolist() if proposal is not None and self.k else []
        n = self.constraint.valid_prefix(drafts)
        self.allowed = self.constraint.masks(drafts[:n])
        if n < len(drafts):
            probs = proposal.probs[:n] if proposal.probs is not None else None
            proposal = dataclasses.replace(proposal, tokens=proposal.tokens[:n], probs=probs)
            self.k = n
            self.source = proposal.source if n else None
        return proposal

    def decide(self, logits: torch.Tensor, proposal: Proposal | None, drafts: torch.Tensor) -> Decision:
        """This run's part of the step's verdicts, from its row [k+1, V] of the verifier call:
        greedy and plain steps decided here, a rule's verdict left as a ``Row`` for the step's one
        ``verify_rows`` call. Commits nothing."""
        k, sp, vdev = self.k, self.sp, self.vdev
        if self.allowed is not None:
            logits = mask_logits(logits, self.allowed)
        # never a valid output (an overflow in a low-precision dtype); a NaN anywhere makes the sum NaN,
        # one pass without a [k+1, V] mask (at k = 64 the masks cost more than the rule)
        flags = [torch.isnan(logits.sum())]
        if sp.greedy:
            verdict = greedy_verify(drafts.view(1, k), biased(logits, sp).argmax(-1).view(1, k + 1))
            return Decision(flags, drafts, logits, verdict)
        if k == 0 and 0 < sp.top_k < logits.shape[-1] and not self.params.measure:
            # a plain step: its token comes from the verifier's top-k alone (q is 0 elsewhere), drawn
            # as verify draws it, with no [V] row built (0.5 ms a token on a CPU)
            small, ids = top_probs(logits[0], sp)  # [top_k] each
            flags.append(~torch.isfinite(small.sum()))
            token = sample_among(small, ids, self.vgen).view(1, 1)
            verdict = Verdict(torch.zeros(1, dtype=torch.int64, device=vdev), token, small.new_zeros(1, 0))
            return Decision(flags, drafts, logits, verdict)
        q = probs_from_logits(logits, sp)  # [k+1, V]
        flags.append(~torch.isfinite(q.sum(-1)).all())
        p = proposal.probs.to(vdev) if k else q[:0]  # [k, V]
        if k and self.allowed is not None:
            p = mask_probs(p, self.allowed[:k])
        row = Row(self.params.rule, self.params.rule_kwargs, p, q, drafts, self.vgen)
        return Decision(flags, drafts, logits, None, row, p.unsqueeze(0), q.unsqueeze(0))

    def verified(self, host: list[int], d: Decision) -> Verified:
        """This run's part of the host read, checked (a NaN or non-finite row ends this run alone)."""
        read = HostRead.read(host, self.k)
        if read.nan_logits:
            raise ModelError(
                f"the verifier returned NaN logits (numerical overflow in "
                f"{str(self.ctx.dtype).removeprefix('torch.')}?); try --dtype float32"
            )
        if read.nonfinite_probs:
            raise ModelError(
                f"temperature {self.sp.temperature:g} made the verifier's probabilities non-finite; "
                "use a larger temperature, or 0 for greedy"
            )
        m = read.accepted
        return Verified(m, read.tokens[: m + 1], read.drafts, d.verdict.tokens[0, m : m + 1], d.p, d.q, d.logits)

    def commit(self, v: Verified, fed: int, timing: Timing, timed: bool = True) -> StepEvent:
        """The policy learns the step (``timed``: its timings too, when it stepped alone); both
        caches rewind to the verified sequence; the sequence grows; the emitted tokens are cut at
        EOS or max_tokens, and so are the accepted ones counted (a draft past the cut was
        verified, never output)."""
        m, new, k, source = v.accepted, v.new, self.k, self.source if self.k else None
        self.last = v.next_input  # stays on the device for the next step's input
        step = Step(
            self.akey, k, m, timing.draft_seconds, timing.verify_seconds, fed, source or MODEL, self.confidence, timed
        )
        self.policy.observe(step)
        measured = (
            meter(self.params.rule, self.params.rule_kwargs, v.p, v.q, v.logits, new, m, k, v.drafts)
            if self.params.measure
            else ((), (), (), ())
        )
        self.rewind(m, new)
        emitted, finish = self.emit(new)
        if self.constraint is not None:
            self.constraint.advance(emitted)
        logprobs = token_logprobs(v.logits, emitted, self.params.logprobs) if self.params.logprobs is not None else ()
        if finish is None and len(self.tokens) >= self.ctx.context_length:
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
            verify_forward_seconds=timing.forward_seconds,
            prefill_seconds=self.prefill_seconds if self.first else 0.0,
            prefill_tokens=self.prefill_tokens if self.first else 0,
            reused_tokens=self.reused_tokens if self.first else 0,
            elapsed=time.perf_counter() - self.t_start - self.paused,
            draft_forward_passes=self._draft_passes() - self.d_passes,
            verifier_forward_passes=self.slot.verifier.forward_passes - self.v_passes,
            prompt_tokens=len(self.prompt),
            finish_reason=finish,
            realized_kl=measured[0][:n],
            realized_tv=measured[1][:n],
            verifier_loglik=measured[2][:n],
            draft_budget=measured[3],
            logprobs=logprobs,
        )
        self.v_passes = self.slot.verifier.forward_passes
        self.d_passes = self._draft_passes()
        self.first = False
        return ev

    def rewind(self, m: int, new: list[int]) -> None:
        """The one place both KV caches go back after a verify. Before: the verifier held the
        sequence minus its last token, then the last token and all k drafts; the draft model
        held a prefix of the sequence plus its own first k - 1 drafts. After: the verifier holds
        the sequence (now grown by the m accepted drafts and the correction or bonus) minus its
        last token, and the drafter crops its cache to the accepted drafts (accept)."""
        slot = self.slot
        slot.verifier.crop(len(slot.tokens) + m)
        slot.tokens += new
        if self.drafter is not None:
            self.drafter.accept(slot.tokens, m)

    def emit(self, new: list[int]) -> tuple[list[int], str | None]:
        """The verified tokens that become output, cut at EOS (kept, it adds no text) or max_tokens."""
        emitted: list[int] = []
        for token in new:
            emitted.append(token)
            self.produced += 1
            if token in self.ctx.eos and not self.params.ignore_eos:
                return emitted, "eos"
            if self.produced >= self.params.max_tokens:
                return emitted, "length"
        return emitted, None
