"""The step event: one record per verification step, the only thing commands see of the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MODEL = "model"  # the draft source of a draft model; a model-free drafter's is its kind (infer/draft KINDS)
ExtraKind = Literal["correction", "bonus", "verifier"]  # verifier: autoregressive step, no drafts


@dataclass(frozen=True)
class Piece:
    """A piece of emitted text and where its token came from."""

    text: str
    kind: str  # accepted (a model's draft), a model-free drafter's label (copied, remembered: its KINDS entry),
    # correction, bonus or verifier


@dataclass(frozen=True)
class StepEvent:
    num_drafted: int  # k for this step (may shrink near max_tokens or the context limit)
    draft_source: str | None  # "model", or a model-free drafter's kind ("ngram", "suffix"); None for a plain step
    accepted: tuple[int, ...]  # draft tokens the verifier kept
    rejected: tuple[int, ...]  # draft tokens thrown away
    extra: int  # the correction (after a rejection), the bonus (all accepted), or the verifier's token
    extra_kind: ExtraKind
    emitted: tuple[int, ...]  # tokens added to the output (accepted + extra, cut at EOS/stop/max_tokens)
    pieces: tuple[Piece, ...]  # the text those tokens added, one piece per token
    rejected_text: tuple[str, ...]  # the rejected drafts as text, for the live view
    draft_seconds: float
    verify_seconds: float
    prefill_seconds: float  # non-zero on the first step only
    prefill_tokens: int  # prompt tokens encoded by the prefill (first step only)
    reused_tokens: int  # prompt tokens found in the KV cache from the previous turn (first step only)
    elapsed: float  # seconds since generation started, at the end of this step
    draft_forward_passes: int  # model calls this step (prefill counted on the first step)
    verifier_forward_passes: int
    prompt_tokens: int
    finish_reason: str | None = None  # "eos", "stop", "length", "context" on the last step
    # of verify_seconds, the verifier's model call alone (llama_decode, the forward); the rest is the
    # rule, sampling and the host read (on CUDA the call only queues the work: the split means little)
    verify_forward_seconds: float = 0.0
    # the divergence meter (GenerationParams.measure), per emitted token decided by the rule:
    realized_kl: tuple[float, ...] = ()  # KL(h_alg || q) of the exact emitted distribution
    realized_tv: tuple[float, ...] = ()  # TV(h_alg, q)
    verifier_loglik: tuple[float, ...] = ()  # log q(token) under the raw verifier, every emitted token
    # per drafted position the rule decided: KL(h^(n) || q) of the target that draft n was verified
    # against (the per-token budget as used: <= delta for exact-KL Cactus; rules without a target: none)
    draft_budget: tuple[float, ...] = ()
    # GenerationParams.logprobs: per emitted token, (log q(token), ((id, log q(id)), ...) the most likely)
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)
