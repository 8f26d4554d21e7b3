"""Prompt-lookup drafting: find the most recent earlier occurrence of the sequence's last n tokens
(n from ``n_max`` down to ``n_min``) and propose what followed it."""

from __future__ import annotations

import torch

from cactus_cli.core.events import NGRAM
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.draft.base import Drafter, Proposal, WithFallback
from cactus_cli.infer.runners.base import to_device


class NgramDrafter(WithFallback):
    """The draft distribution is one-hot, so every acceptance rule works unchanged (SpS accepts
    with q_n and stays exactly lossless; Cactus accepts with its boosted h_n). With ``fallback``,
    a draft model drafts when nothing matches; its cache stays in step either way (steps it sat
    out are fed in its next forward, as after a k = 0 step).

    Lookups are O(n_max) per token: for each n, a map from every n-gram that has a continuation
    to the start of its latest occurrence, updated as the sequence grows."""

    own_source = NGRAM

    def __init__(self, vocab_size: int, device: torch.device, n_max: int = 4, n_min: int = 1,
                 fallback: Drafter | None = None):
        self.vocab_size = vocab_size
        self._device = device
        self.n_max, self.n_min = n_max, n_min
        self.fallback = fallback
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence with a continuation
        self.indexed = 0  # how much of the sequence the index covers

    def reset(self) -> None:
        self.index, self.indexed = {}, 0
        if self.fallback:
            self.fallback.reset()

    def start(self, prompt: list[int], previous: list[int], reuse: bool = False, memory: str | None = "") -> int:
        self.index, self.indexed = {}, 0
        self._update(prompt)
        return self.fallback.start(prompt, previous, reuse) if self.fallback else 0

    def finish(self, seq: list[int]) -> None:
        pass  # (a lookup reads the current sequence only)

    def _update(self, seq: list[int]) -> None:
        for j in range(self.indexed, len(seq)):  # seq[j] landed: every n-gram ending at j - 1 has a continuation
            for n in range(self.n_min, self.n_max + 1):
                if j >= n:
                    self.index[tuple(seq[j - n : j])] = j - n
        self.indexed = len(seq)

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching tail."""
        self._update(seq)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(seq) <= n:
                continue
            start = self.index.get(tuple(seq[-n:]))
            if start is not None:
                return seq[start + n : start + n + k]
        return []

    def next_source(self, seq: list[int]) -> str | None:
        if self.lookup(seq, 1):
            return NGRAM
        return self.fallback.next_source(seq) if self.fallback else None

    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        tokens = self.lookup(seq, k) if k else []
        if not tokens and self.fallback is not None and k:
            return self.fallback.propose(seq, k, sp, generator)
        ids = to_device(tokens, self.device)  # [k']
        probs = None
        if not sp.greedy and tokens:  # [k', V] one-hot
            probs = torch.zeros(len(tokens), self.vocab_size, device=self.device).scatter_(1, ids.view(-1, 1), 1.0)
        return Proposal(ids, probs, NGRAM)

    def accept(self, seq: list[int], num_accepted: int) -> None:
        if self.fallback:
            self.fallback.accept(seq, num_accepted)  # sat out this step: nothing to crop, the rest is fed later
