"""Counters over step events, with vLLM's speculative-decoding metric names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cactus_cli.core.events import StepEvent


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually encoded
    reused_prefix_tokens: int = 0  # prompt tokens served from the KV cache (chat turns)
    num_output_tokens: int = 0
    num_steps: int = 0
    num_drafts: int = 0  # steps that drafted at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejections: int = 0  # drafting steps that ended in a rejection (tested one draft more than kept)
    acceptance_histogram: list[int] = field(default_factory=list)  # [j]: drafts with j accepted
    position_drafted: list[int] = field(default_factory=list)  # [i]: drafts that reached position i
    position_accepted: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i
    drafted_by_source: dict[str, int] = field(default_factory=dict)  # "model" / "ngram" -> drafted tokens
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    k_histogram: list[int] = field(default_factory=list)  # [k]: steps that drafted k tokens (k = 0: plain step)
    verifier_forward_passes: int = 0
    draft_forward_passes: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    verify_forward_seconds: float = 0.0  # of verify_seconds, the model call alone
    time_to_first_token: float | None = None
    total_seconds: float = 0.0
    finish_reason: str | None = None
    realized_kl: list[float] = field(default_factory=list)  # the meter, one value per position
    realized_tv: list[float] = field(default_factory=list)
    verifier_loglik: list[float] = field(default_factory=list)
    draft_budget: list[float] = field(default_factory=list)  # KL(h^(n) || q) per draft decided (the meter)

    def update(self, ev: StepEvent) -> None:
        self.num_steps += 1
        self.num_output_tokens += len(ev.emitted)
        self.verifier_forward_passes += ev.verifier_forward_passes
        self.draft_forward_passes += ev.draft_forward_passes
        self.prefill_seconds += ev.prefill_seconds
        self.prefill_tokens += ev.prefill_tokens
        self.reused_prefix_tokens += ev.reused_tokens
        self.draft_seconds += ev.draft_seconds
        self.verify_seconds += ev.verify_seconds
        self.verify_forward_seconds += ev.verify_forward_seconds
        if self.time_to_first_token is None and ev.emitted:
            self.time_to_first_token = ev.elapsed
        self.total_seconds = ev.elapsed
        self.prompt_tokens = max(self.prompt_tokens, ev.prompt_tokens)
        if ev.finish_reason:
            self.finish_reason = ev.finish_reason
        self.realized_kl += ev.realized_kl
        self.realized_tv += ev.realized_tv
        self.verifier_loglik += ev.verifier_loglik
        self.draft_budget += ev.draft_budget
        k, m = ev.num_drafted, len(ev.accepted)
        _grow(self.k_histogram, k + 1)
        self.k_histogram[k] += 1
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += m
        self.num_rejections += m < k
        src = ev.draft_source or "model"
        self.drafted_by_source[src] = self.drafted_by_source.get(src, 0) + k
        self.accepted_by_source[src] = self.accepted_by_source.get(src, 0) + m
        _grow(self.acceptance_histogram, k + 1)
        _grow(self.position_drafted, k)
        _grow(self.position_accepted, k)
        self.acceptance_histogram[m] += 1
        for i in range(k):
            self.position_drafted[i] += 1
        for i in range(m):
            self.position_accepted[i] += 1

    def merge(self, other: SpecStats) -> None:
        """Add another run's counters (for totals over prompts or chat turns)."""
        for name in (
            "prompt_tokens",
            "prefill_tokens",
            "reused_prefix_tokens",
            "num_output_tokens",
            "num_steps",
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
            "num_rejections",
            "verifier_forward_passes",
            "draft_forward_passes",
            "prefill_seconds",
            "draft_seconds",
            "verify_seconds",
            "verify_forward_seconds",
            "total_seconds",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("realized_kl", "realized_tv", "verifier_loglik", "draft_budget"):
            getattr(self, name).extend(getattr(other, name))
        for name in ("drafted_by_source", "accepted_by_source"):
            mine = getattr(self, name)
            for src, v in getattr(other, name).items():
                mine[src] = mine.get(src, 0) + v
        for name in ("acceptance_histogram", "position_drafted", "position_accepted", "k_histogram"):
            mine, theirs = getattr(self, name), getattr(other, name)
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v
        if other.time_to_first_token is not None:
            self.time_to_first_token = (self.time_to_first_token or 0.0) + other.time_to_first_token
        self.finish_reason = other.finish_reason

    # derived figures ----------------------------------------------------------------

    @property
    def step_split(self) -> dict[str, float] | None:
        """Where decoding time went, as shares of it (after the prefills): drafting, the verifier's
        model call, the verify's Python around it (the rule, sampling, the host read), and the rest
        (the loop, the k choice, cache rewinds, events)."""
        decode = self.total_seconds - self.prefill_seconds
        if decode <= 0:
            return None
        verify_python = self.verify_seconds - self.verify_forward_seconds
        other = decode - self.draft_seconds - self.verify_seconds
        return {
            "draft": self.draft_seconds / decode,
            "verify_forward": self.verify_forward_seconds / decode,
            "verify_python": verify_python / decode,
            "other": other / decode,
        }

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """vLLM's definition: 1 + accepted / drafts (tokens emitted per verifier step)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def mean_accepted_tokens_per_step(self) -> float | None:
        """The paper's AL: accepted draft tokens per step, the bonus/correction not counted."""
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def per_token_acceptance(self) -> float | None:
        """Per-token acceptance `a` of the i.i.d. model (docs/algorithm.md section 5): accepted tokens
        over tokens the rule tested (a step tests tokens up to and including its first rejection)."""
        tested = self.num_accepted_tokens + self.num_rejections  # (k varies: not the histogram's last bucket)
        return self.num_accepted_tokens / tested if tested else None

    @property
    def draft_sources(self) -> dict[str, dict[str, Any]]:
        """Drafted and accepted tokens per draft source (the model, prompt lookup)."""
        return {
            src: {
                "drafted": n,
                "accepted": self.accepted_by_source.get(src, 0),
                "acceptance_rate": self.accepted_by_source.get(src, 0) / n if n else None,
            }
            for src, n in sorted(self.drafted_by_source.items())
        }

    @property
    def mean_k(self) -> float | None:
        """Mean draft length per step, plain (k = 0) steps included."""
        steps = sum(self.k_histogram)
        return sum(k * n for k, n in enumerate(self.k_histogram)) / steps if steps else None

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @property
    def tokens_per_second(self) -> float | None:
        return self.num_output_tokens / self.total_seconds if self.total_seconds > 0 else None

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Output tokens per second after the prompt's prefill (what llama-bench's tg measures)."""
        decode = self.total_seconds - self.prefill_seconds
        return self.num_output_tokens / decode if decode > 0 else None

    @property
    def mean_verifier_loglik(self) -> float | None:
        return sum(self.verifier_loglik) / len(self.verifier_loglik) if self.verifier_loglik else None

    def to_dict(self) -> dict[str, Any]:
        out_tokens = max(self.num_output_tokens, 1)
        meter = {}
        if self.realized_kl or self.verifier_loglik:
            meter = {
                "realized_kl": summarize(self.realized_kl),
                "realized_tv": summarize(self.realized_tv),
                "draft_budget_kl": summarize(self.draft_budget),
                "mean_verifier_loglik": self.mean_verifier_loglik,
            }
        return {
            **meter,
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens,
            "reused_prefix_tokens": self.reused_prefix_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "per_token_acceptance": self.per_token_acceptance,
            "mean_acceptance_length": self.mean_acceptance_length,
            "mean_accepted_tokens_per_step": self.mean_accepted_tokens_per_step,
            "acceptance_histogram": list(self.acceptance_histogram),
            "k_histogram": list(self.k_histogram),
            "draft_sources": self.draft_sources,
            "mean_k": self.mean_k,
            "per_position_acceptance_rate": self.per_position_acceptance_rate,
            "tokens_per_second": self.tokens_per_second,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "time_to_first_token": self.time_to_first_token,
            "total_seconds": self.total_seconds,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "verify_forward_seconds": self.verify_forward_seconds,
            "step_split": self.step_split,
            "verifier_forward_passes": self.verifier_forward_passes,
            "draft_forward_passes": self.draft_forward_passes,
            "verifier_forward_passes_per_token": self.verifier_forward_passes / out_tokens,
            "draft_forward_passes_per_token": self.draft_forward_passes / out_tokens,
            "finish_reason": self.finish_reason,
        }


def summarize(values: list[float]) -> dict[str, Any]:
    """Mean and percentiles of the finite values; ``infinite`` counts the rest (KL where the
    emitted distribution puts mass on a token the verifier rules out)."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return {
            "count": len(values),
            "infinite": len(values),
            "mean": None,
            "p50": None,
            "p90": None,
            "p99": None,
            "max": None,
        }

    def pct(x: float) -> float:
        return finite[min(len(finite) - 1, int(x * len(finite)))]

    return {
        "count": len(values),
        "infinite": len(values) - len(finite),
        "mean": sum(finite) / len(finite),
        "p50": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
        "max": finite[-1],
    }


def _grow(xs: list[int], n: int) -> None:
    xs.extend([0] * (n - len(xs)))
