"""The drafter interface: propose up to k tokens (with their probabilities) continuing the verified
sequence, then be told how many were accepted. Drafters keep no copy of the sequence: the engine
hands them its own (``seq``, read-only), so they can never drift out of step with it."""

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


class OnRunner:
    """What the drafters that run a draft model (same vocabulary or another) share: the forward
    count and device of their runner, the MODEL cost source, no estimates, nothing to learn."""

    cost_source = MODEL
    runner: Runner

    @property
    def forward_passes(self) -> int:
        return self.runner.forward_passes

    @property
    def device(self) -> torch.device:
        return self.runner.lm.device

    def confidence(self, seq: list[int]) -> list[float] | None:
        return None

    def finish(self, seq: list[int]) -> None:
        pass


class WithFallback:
    """What a model-free drafter (prompt lookup, the suffix trees) shares when a draft model may
    stand behind it (``fallback``): the model's runner, forward count, device and cost source,
    or its own (``own_source``: drafts cost nothing) when there is none."""

    own_source = MODEL
    fallback: Drafter | None = None
    _device: torch.device

    @property
    def forward_passes(self) -> int:
        return self.fallback.forward_passes if self.fallback else 0

    @property
    def runner(self) -> Runner | None:
        return self.fallback.runner if self.fallback else None

    @property
    def cost_source(self) -> str:
        return self.fallback.cost_source if self.fallback else self.own_source

    @property
    def device(self) -> torch.device:
        return self.fallback.device if self.fallback else self._device

    def confidence(self, seq: list[int]) -> list[float] | None:
        return None


class Drafter(Protocol):
    device: torch.device
    forward_passes: int  # draft model calls so far (0 for lookup alone)
    runner: Runner | None  # the draft model's runner (sized and compiled with the verifier's), if any
    cost_source: str  # whose draft costs a choice of k mostly rests on: MODEL, or NGRAM (lookup alone)

    def next_source(self, seq: list[int]) -> str | None:
        """Where the next proposal's drafts would come from (MODEL, NGRAM, SUFFIX), or None when it has
        nothing to offer (a lookup with no match): then the step is a plain one."""

    def confidence(self, seq: list[int]) -> list[float] | None:
        """The drafter's own estimate of each next draft token's probability, given the ones
        before it (the suffix trees' counts), for -k auto to size the draft by; None when it
        has none (a draft model, prompt lookup): -k auto then uses the acceptance it measured
        per position."""

    def reset(self) -> None:
        """Forget everything cached."""

    def start(self, prompt: list[int], previous: list[int], reuse: bool = False, memory: str | None = "") -> int:
        """Begin a sequence at ``prompt``; with ``reuse``, keep what is cached of the prefix it
        shares with ``previous`` (the last sequence). ``memory`` names the history a drafter
        with memory reads and extends (bench keeps one per configuration; None: none, as in a
        warm-up). Returns how many tokens were reused."""

    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        """Draft up to k tokens continuing ``seq``."""

    def accept(self, seq: list[int], num_accepted: int) -> None:
        """The verifier kept ``num_accepted`` of the last proposal; ``seq`` has grown by those
        and the correction or bonus token."""

    def finish(self, seq: list[int]) -> None:
        """The sequence is done (finished, stopped or abandoned): a drafter with memory learns it."""
