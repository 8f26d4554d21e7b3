"""The speculative decoding engine: one generator of StepEvents that every command consumes.

Per step: k draft forwards of one token each (the first also feeds what the draft has not
seen yet), one verifier forward over the last token plus the k drafts, the acceptance rule,
then one crop of each KV cache to the accepted length. Nothing else touches a model.
The engine never imports Rich.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from cactus_cli.acceptance import divergences, emitted_distribution, greedy_verify, verify
from cactus_cli.drafting import DraftModelDrafter, Drafter, NgramDrafter
from cactus_cli.errors import ContextLimitError, ModelError
from cactus_cli.events import Piece, StepEvent
from cactus_cli.models import ModelPair
from cactus_cli.policy import KPolicy, acceptance_key, cache_path, probe
from cactus_cli.runners import CompileUnavailable, make_runner, to_device
from cactus_cli.sampling import SamplingParams, probs_from_logits


@dataclass
class GenerationParams:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rule: str = "cactus"
    rule_kwargs: dict[str, Any] = field(default_factory=dict)
    num_draft_tokens: int = 4  # k (k_max when adaptive); 0 runs the verifier alone (autoregressive baseline)
    adaptive_k: bool = False  # -k auto: the engine's KPolicy picks k in 0..num_draft_tokens before each step
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int = 0
    measure: bool = False  # the divergence meter: realized KL/TV per position, verifier log-likelihood


class Detokenizer:
    """Incremental decoding that never emits half a multi-byte character (vLLM's scheme:
    decode a short window and emit what grew past the previous window's text)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""


def eos_ids(pair: ModelPair) -> set[int]:
    ids: set[int] = set()
    for source in (pair.tokenizer, getattr(pair.verifier.model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def cost_key(pair: ModelPair, compiled: bool = False) -> dict[str, Any]:
    """What step costs depend on: the models, device, dtype, threads, torch and compilation."""
    from cactus_cli.models import device_name

    v = pair.verifier
    key = {"verifier": v.path, "draft": pair.draft.path if pair.draft else None, "device": device_name(v.device),
           "dtype": str(v.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
           "torch": torch.__version__}
    if compiled:
        key["compiled"] = True  # (absent when eager, so eager caches from earlier versions still apply)
    if v.quantize != "none":
        key["quantize"] = v.quantize
    if v.tp > 1:
        key["tp"] = v.tp
    return key


def sync(device: torch.device) -> None:
    """Wait for the device, so a timer reads finished work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DRAFT_WIDTHS = (1, 2)  # the draft's compiled steps: one token, or the last draft + the bonus after a full acceptance
MAX_GRAPHS = 4  # verifier widths compiled as asked; a longer list (a sweep over k) is bucketed to powers of two


class SpeculativeEngine:
    def __init__(self, pair: ModelPair, ngram: tuple[int, int] | None = None, compiled: bool = False):
        """``ngram`` = (n_max, n_min) drafts by prompt lookup, with the pair's draft model (if any)
        for when nothing matches. ``compiled``: static caches and compiled steps (runners.py)."""
        self.pair = pair
        self.ngram = ngram
        self.eos = eos_ids(pair)
        limits = [pair.verifier.context_length] + ([pair.draft.context_length] if pair.draft else [])
        self.context_length = min(limits)
        self.tokens: list[int] = []  # the verified sequence; the verifier cache holds tokens[: cache_len]
        self.compile_note: str | None = None  # why a compiled engine runs eagerly, if it does
        self.report: Callable[[str], None] | None = None  # progress lines (a compile during generate)
        self._build(compiled)

    def _build(self, compiled: bool) -> None:
        """Runners, drafter and k policy; called again if compiling turns out not to work."""
        pair, ngram = self.pair, self.ngram
        self.compiled = compiled
        self.verifier = make_runner(pair.verifier, pair.vocab_size, compiled, self.context_length, "verifier")
        model = (DraftModelDrafter(make_runner(pair.draft, pair.vocab_size, compiled, self.context_length, "draft"))
                 if pair.draft else None)
        self.drafter: Drafter | None = model
        if ngram is not None:
            self.drafter = NgramDrafter(pair.vocab_size, pair.verifier.device, ngram[0], ngram[1], fallback=model)
        self.tokens = []
        key = cost_key(pair, compiled)
        self.policy = KPolicy(cache_path(key), key)  # what a step costs here; picks k for -k auto

    def step_widths(self, k: int) -> tuple[int, ...]:
        """The verifier's step width for draft length k (k_max with -k auto): every step of such a
        run, k = 0 and shorter lookups included, is padded to it when compiled."""
        return (k + 1,) if k > 0 and self.drafter is not None else (1,)

    def prepare(self, tokens: int, widths: set[int] | tuple[int, ...], report: Callable[[str], None] | None = None,
                exact: bool = True) -> None:
        """Size the caches for ``tokens`` and compile the verifier's steps of these ``widths`` (and
        the draft's) now, before anything is timed; more than MAX_GRAPHS widths (a sweep over k)
        become power-of-two widths that shorter steps pad to. ``exact=False`` compiles only what no
        compiled width covers. Eager runners: nothing to do. If compiling fails, the engine goes
        eager and ``compile_note`` says why."""
        if not self.compiled:
            return
        tokens = min(tokens, self.context_length + 1)
        widths = sorted(set(widths))
        if len(widths) > MAX_GRAPHS:
            widths = sorted({1 << (w - 1).bit_length() for w in widths})
        try:
            self.verifier.reserve(tokens, tuple(widths), report, exact)
            if self.draft_model is not None:
                self.draft_model.runner.reserve(tokens, DRAFT_WIDTHS, report, exact)
        except CompileUnavailable as err:
            self.compile_note = f"compiling failed ({err}); running eagerly"
            if report is not None:
                report(self.compile_note)
            self._build(False)

    @property
    def compile_seconds(self) -> float:
        runners = [self.verifier] + ([self.draft_model.runner] if self.draft_model else [])
        return sum(getattr(r, "compile_seconds", 0.0) for r in runners)

    @property
    def draft_model(self) -> DraftModelDrafter | None:
        """The draft model's drafter (alone, or behind prompt lookup), if there is a draft model."""
        d = self.drafter.fallback if isinstance(self.drafter, NgramDrafter) else self.drafter
        return d if isinstance(d, DraftModelDrafter) else None

    @property
    def cost_source(self) -> str:
        """Whose draft costs a choice of k mostly rests on: the draft model's, or (lookup alone) none."""
        return "model" if self.draft_model is not None else "ngram"

    def reset(self) -> None:
        """Forget both caches (the next generate prefills from scratch)."""
        self.verifier.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self.tokens = []

    def cache_lengths(self) -> dict[str, int]:
        """For tests and diagnostics: the verifier cache always holds the sequence minus its last token."""
        out = {"sequence": len(self.tokens), "verifier": self.verifier.cache_len}
        model = self.draft_model
        if model is not None:
            out["draft"] = model.runner.cache_len
            out["draft_pending"] = len(model.pending)
        return out

    def probe_costs(self, k_max: int, length: int = 128) -> bool:
        """Seed the cost model with a short timing probe over a synthetic ``length``-token context
        (a few seconds, once per pair, device and dtype: the result is cached). Drops the caches.
        Returns False when the context window is too small to probe."""
        length = min(length, self.context_length - k_max - 3)
        if length < 4:
            return False
        ids = [(7 + 31 * i) % self.pair.vocab_size for i in range(length + k_max + 1)]
        self.prepare(length + k_max + 2, self.step_widths(k_max))  # compiled: every width pads to k_max + 1
        self.reset()
        v = self.verifier
        with torch.inference_mode():
            v.forward(ids[:length], keep=1)

            def verify(w: int) -> None:
                v.forward(ids[length : length + w], keep=w)
                v.crop(length)

            draft = None
            if self.draft_model is not None:
                d = self.draft_model.runner
                d.forward(ids[:length], keep=1)

                def draft() -> None:
                    d.forward(ids[length : length + 1], keep=1)
                    d.crop(length)

            widths = sorted({1, 2, 3, 5, k_max + 1})
            try:
                probe(self.policy.costs, verify, draft, widths, lambda: sync(self.pair.verifier.device))
            finally:
                self.reset()
        self.policy.dirty = True
        self.policy.save()
        return True

    def cost_summary(self, params: GenerationParams) -> dict[str, Any]:
        """The cost model's figures and the acceptance estimate for ``params`` (for --json, /stats)."""
        sp = params.sampling
        akey = acceptance_key(params.rule, params.rule_kwargs, sp.temperature, sp.top_k, sp.top_p)
        out = self.policy.describe(akey, max(params.num_draft_tokens, 1), self.cost_source)
        out["adaptive_k"] = params.adaptive_k
        return out

    def generate(self, prompt_ids: list[int], params: GenerationParams, reuse_cache: bool = False) -> Iterator[StepEvent]:
        """Generate after ``prompt_ids``. With ``reuse_cache`` the KV caches keep the longest prefix
        the prompt shares with the previous sequence (chat turns), so only the new tokens are encoded."""
        if not prompt_ids:
            raise ContextLimitError("the prompt is empty after tokenization; give the model something to continue")
        if len(prompt_ids) >= self.context_length:
            raise ContextLimitError(
                f"the prompt is {len(prompt_ids)} tokens but the context window is {self.context_length}; "
                "shorten the prompt"
            )
        self.prepare(len(prompt_ids) + params.max_tokens + 1, self.step_widths(params.num_draft_tokens), self.report,
                     exact=False)
        return self._run(list(prompt_ids), params, reuse_cache)

    def _run(self, prompt: list[int], params: GenerationParams, reuse: bool) -> Iterator[StepEvent]:
        state = _RunState(self, prompt, params)
        try:
            state.prefill(reuse)
        except BaseException:
            self.reset()  # a half-done prefill leaves caches we cannot trust
            raise
        try:
            while True:
                try:
                    event = state.step()
                except BaseException:
                    # interrupted mid-step (Ctrl-C, OOM): caches may be half-updated; drop them, so the
                    # next call prefills from scratch instead of decoding from a corrupt cache
                    self.reset()
                    raise
                yield event  # closing the generator here (GeneratorExit) leaves consistent caches
                if event.finish_reason:
                    return
        finally:
            self.policy.save()  # what this run learned about step costs, for the next run


class _RunState:
    """The state of one generate() call; ``step`` is one draft/verify/crop round."""

    def __init__(self, engine: SpeculativeEngine, prompt: list[int], params: GenerationParams):
        self.e = engine
        self.prompt = prompt
        self.params = params
        self.sp = params.sampling
        self.vdev = engine.pair.verifier.device
        self.vgen = torch.Generator(device=self.vdev).manual_seed(params.seed)
        self.drafter = engine.drafter if params.num_draft_tokens > 0 else None
        self.akey = acceptance_key(params.rule, params.rule_kwargs, self.sp.temperature, self.sp.top_k, self.sp.top_p)
        self.dgen = None
        if self.drafter is not None:
            ddev = self.drafter.device
            self.dgen = self.vgen if ddev == self.vdev else torch.Generator(device=ddev).manual_seed(params.seed + 1)
        self.detok = Detokenizer(engine.pair.tokenizer)
        self.produced = 0
        self.text = ""
        self.max_stop = max((len(s) for s in params.stop), default=0)
        self.first = True
        self.t_start = time.perf_counter()
        self.prefill_seconds = 0.0
        self.prefill_tokens = 0
        self.reused_tokens = 0
        self.v_passes = engine.verifier.forward_passes
        self.d_passes = self.drafter.forward_passes if self.drafter else 0

    @torch.inference_mode()
    def prefill(self, reuse: bool) -> None:
        """Both caches take the prompt minus its last token, which the first step feeds."""
        e, prompt = self.e, self.prompt
        keep = e.verifier.prefill(prompt, e.tokens, reuse)
        self.reused_tokens = keep
        self.prefill_tokens = len(prompt) - 1 - keep
        e.tokens = list(prompt)
        self.last = to_device(prompt[-1:], self.vdev)  # [1]: the next step's first input
        if self.drafter is not None:
            self.drafter.start(prompt, reuse)
        sync(self.vdev)
        self.prefill_seconds = time.perf_counter() - self.t_start

    @torch.inference_mode()
    def step(self) -> StepEvent:
        e, params, sp, vdev = self.e, self.params, self.sp, self.vdev
        drafter = self.drafter
        room = e.context_length - len(e.tokens)  # positions left for new tokens
        k = 0 if drafter is None else max(0, min(params.num_draft_tokens, room - 1, params.max_tokens - self.produced - 1))
        source = drafter.next_source() if k else None
        if source is None:
            k = 0  # a lookup with nothing to copy: a plain step, at no drafting cost
        elif params.adaptive_k:
            k = e.policy.choose(self.akey, k, source)  # from past steps only: SpS stays lossless
        catch_up = drafter.catch_up if drafter is not None else 0

        t0 = time.perf_counter()
        proposal = drafter.propose(k, sp, self.dgen) if drafter is not None else None
        if proposal is not None:
            sync(proposal.tokens.device)
            k = len(proposal.tokens)  # a lookup may offer fewer than k
            source = proposal.source if k else None
        t1 = time.perf_counter()

        drafts = proposal.tokens.to(vdev) if k else torch.zeros(0, dtype=torch.int64, device=vdev)  # [k]
        logits = e.verifier.forward(torch.cat([self.last, drafts]), keep=k + 1)  # [k+1, V]
        p = q = None
        flags = [torch.isnan(logits).any()]  # never a valid output: an overflow in a low-precision dtype
        if sp.greedy:
            verdict = greedy_verify(drafts.view(1, k), logits.argmax(-1).view(1, k + 1))
        else:
            q = probs_from_logits(logits, sp).unsqueeze(0)  # [1, k+1, V]
            flags.append(~torch.isfinite(q).all())
            p = proposal.probs.to(vdev).unsqueeze(0) if k else q[:, :0]  # [1, k, V]
            verdict = verify(params.rule, p, q, drafts.view(1, k), generator=self.vgen, **params.rule_kwargs)
        # the step's one host sync: accepted count, tokens, drafts and error flags in one copy
        host = torch.cat([verdict.num_accepted[:1], verdict.tokens[0], drafts,
                          torch.stack(flags).to(torch.int64)]).tolist()
        m = host[0]
        new = host[1 : m + 2]  # accepted drafts + one extra token
        draft_list = host[k + 2 : 2 * k + 2]
        t2 = time.perf_counter()
        if host[2 * k + 2]:
            raise ModelError(f"the verifier returned NaN logits (numerical overflow in "
                             f"{str(e.pair.verifier.dtype).removeprefix('torch.')}?); try --dtype float32")
        if len(host) > 2 * k + 3 and host[2 * k + 3]:
            raise ModelError(f"temperature {sp.temperature:g} made the verifier's probabilities non-finite; "
                             "use a larger temperature, or 0 for greedy")
        self.last = verdict.tokens[0, m : m + 1]  # [1], stays on the device for the next step's input
        e.policy.observe(self.akey, k, m, t1 - t0, t2 - t1, catch_up, source or "model")
        meter = self._meter(p, q, logits, new, m, k) if params.measure else ((), (), ())

        # keep both caches to exactly the verified sequence minus its last token
        e.verifier.crop(len(e.tokens) + m)
        if drafter is not None:
            drafter.accept(m, new)
        e.tokens += new

        rejected = tuple(draft_list[m:])
        extra_kind = "verifier" if k == 0 else ("bonus" if m == k else "correction")
        emitted, pieces, finish = self._emit(new, m, extra_kind, "copied" if source == "ngram" else "accepted")
        if finish is None and len(e.tokens) >= e.context_length:
            finish = "context"

        ev = StepEvent(
            num_drafted=k,
            draft_source=source,
            accepted=tuple(new[:m]),
            rejected=rejected,
            extra=new[-1],
            extra_kind=extra_kind,
            emitted=tuple(emitted),
            pieces=tuple(pieces),
            rejected_text=tuple(e.pair.tokenizer.decode([t]) for t in rejected),
            draft_seconds=t1 - t0,
            verify_seconds=t2 - t1,
            prefill_seconds=self.prefill_seconds if self.first else 0.0,
            prefill_tokens=self.prefill_tokens if self.first else 0,
            reused_tokens=self.reused_tokens if self.first else 0,
            elapsed=time.perf_counter() - self.t_start,
            draft_forward_passes=(drafter.forward_passes - self.d_passes) if drafter else 0,
            verifier_forward_passes=e.verifier.forward_passes - self.v_passes,
            prompt_tokens=len(self.prompt),
            finish_reason=finish,
            realized_kl=meter[0][: len(emitted)],
            realized_tv=meter[1][: len(emitted)],
            verifier_loglik=meter[2][: len(emitted)],
        )
        self.v_passes = e.verifier.forward_passes
        self.d_passes = drafter.forward_passes if drafter else 0
        self.first = False
        return ev

    def _meter(self, p, q, logits, new: list[int], m: int, k: int) -> tuple[tuple[float, ...], ...]:
        """Per emitted position decided by the rule: KL(h_alg || q) and TV(h_alg, q) of the exact
        emitted distribution (the bonus position is q itself; greedy is exact), and the verifier's
        log-likelihood (temperature 1, unfiltered) of every token emitted this step."""
        rows = min(m + 1, k)
        if p is None or rows == 0:
            kl = tv = (0.0,) * rows
        else:
            # h_alg lives on supp(p) | supp(q): after top-k / top-p that is a few dozen tokens, so
            # compute it there (exactly) instead of over the whole vocabulary
            pr, qr = p[0, :rows], q[0, :rows]  # [rows, V]
            support = ((pr > 0) | (qr > 0)).any(0).nonzero().squeeze(-1)  # [U]
            pr, qr = pr[:, support], qr[:, support]
            h = emitted_distribution(self.params.rule, pr, qr, **self.params.rule_kwargs)
            kl_t, tv_t = divergences(h, qr)
            kl, tv = tuple(kl_t.tolist()), tuple(tv_t.tolist())
        logp = torch.log_softmax(logits[: m + 1].float(), -1)  # [m+1, V]
        ll = logp.gather(-1, torch.tensor(new, device=logp.device).view(-1, 1)).squeeze(-1)
        return kl, tv, tuple(ll.tolist())

    def _emit(self, new: list[int], m: int, extra_kind: str, accepted_kind: str) -> tuple[list[int], list[Piece], str | None]:
        """Turn verified tokens into output, cut at EOS, a stop string or max_tokens."""
        params = self.params
        emitted: list[int] = []
        pieces: list[Piece] = []
        for i, token in enumerate(new):
            kind = accepted_kind if i < m else extra_kind
            emitted.append(token)
            self.produced += 1
            if token in self.e.eos and not params.ignore_eos:
                return emitted, pieces, "eos"
            piece = self.detok.add(token)
            finish = None
            if params.stop and piece:
                tail = self.text[-self.max_stop :]
                window = tail + piece
                hits = [window.find(s) for s in params.stop if s in window]
                if hits:  # cut where the stop string starts (text already shown stays shown)
                    piece = piece[: max(min(hits) - len(tail), 0)]
                    finish = "stop"
            self.text += piece
            pieces.append(Piece(piece, kind))
            if finish:
                return emitted, pieces, finish
            if self.produced >= params.max_tokens:
                return emitted, pieces, "length"
        return emitted, pieces, None
