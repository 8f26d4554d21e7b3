"""The drafter interface: propose up to k tokens (with their probabilities) continuing the verified
sequence, then be told how many were accepted. Drafters keep no copy of the sequence: the engine
hands them its own (``seq``, read-only), so they can never drift out of step with it.

The interface is what the engine needs and no more: where the next drafts would come from
(``next_source``; None means nothing to draft, a plain step), the drafter's own estimate of them
if it has one (``confidence``), ``propose``, ``accept``, and ``start`` / ``finish`` of a
sequence. The draft model's runner, if any, is the one attribute besides the source: the engine
reads forward counts and the device from it, sizes and compiles it with the verifier's, and
resets it when a step fails half-way (a drafter rebuilds everything else at ``start``).
``Fallback`` composes a model-free drafter with a draft model, once, for every such drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cactus_cli.core.events import MODEL
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.runners.base import Runner


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k'] int64, on the drafter's device; k' <= k (a lookup may offer fewer)
    probs: torch.Tensor | None  # [k', V] float32 draft probabilities; None when greedy
    source: str = MODEL  # MODEL, NGRAM or SUFFIX
    fed: int = 0  # tokens the first draft forward caught up on (1, 2 after a full acceptance, more after k = 0 steps)


class Drafter(Protocol):
    runner: Runner | None  # the draft model's runner, or None: drafting costs (next to) nothing
    source: str  # whose costs a choice of k rests on: MODEL when a draft model may draft, else NGRAM or SUFFIX

    def next_source(self, seq: list[int]) -> str | None:
        """Where the next proposal's drafts would come from (MODEL, NGRAM, SUFFIX), or None when it
        has nothing to offer (a lookup with no match): then the step is a plain one."""

    def confidence(self, seq: list[int]) -> list[float] | None:
        """The drafter's own estimate of each next draft token's probability, given the ones
        before it (the suffix trees' counts), for -k auto to size the draft by; None when it
        has none (a draft model, prompt lookup): -k auto then uses the acceptance it measured
        per position."""

    def start(self, prompt: list[int], previous: list[int], reuse: bool = False, memory: str | None = "") -> None:
        """Begin a sequence at ``prompt``; with ``reuse``, keep what is cached of the prefix it
        shares with ``previous`` (the last sequence). ``memory`` names the history a drafter
        with memory reads and extends (bench keeps one per configuration; None: none, as in a
        warm-up)."""

    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        """Draft up to k tokens continuing ``seq``."""

    def accept(self, seq: list[int], num_accepted: int) -> None:
        """The verifier kept ``num_accepted`` of the last proposal; ``seq`` has grown by those
        and the correction or bonus token."""

    def finish(self, seq: list[int]) -> None:
        """The sequence is done (finished, stopped or abandoned) at ``seq``, what was output: a
        drafter with memory learns it."""


class Fallback:
    """A model-free drafter (prompt lookup, the suffix trees) with a draft model behind it: the
    first drafts whenever it has something, the model when it has nothing. The model's cache
    stays in step either way: whatever it sat out is fed by its next proposal (a model behind a
    lookup reads even the prompt only then: it may never be asked)."""

    source = MODEL  # (a model may draft: the choice of k rests on its costs)

    def __init__(self, primary: Drafter, model: Drafter):
        self.primary, self.model = primary, model
        self.runner = model.runner

    def _drafting(self, seq: list[int]) -> Drafter:
        return self.primary if self.primary.next_source(seq) is not None else self.model

    def next_source(self, seq: list[int]) -> str | None:
        return self._drafting(seq).next_source(seq)

    def confidence(self, seq: list[int]) -> list[float] | None:
        return self._drafting(seq).confidence(seq)

    def start(self, prompt: list[int], previous: list[int], reuse: bool = False, memory: str | None = "") -> None:
        self.primary.start(prompt, previous, reuse, memory)
        self.model.start(prompt, previous, reuse, memory)

    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        return self._drafting(seq).propose(seq, k, sp, generator)

    def accept(self, seq: list[int], num_accepted: int) -> None:
        self.primary.accept(seq, num_accepted)
        self.model.accept(seq, num_accepted)  # (nothing to crop when it sat the step out)

    def finish(self, seq: list[int]) -> None:
        self.primary.finish(seq)
        self.model.finish(seq)
