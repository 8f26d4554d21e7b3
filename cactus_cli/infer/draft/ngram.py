"""Prompt-lookup drafting: find the most recent earlier occurrence of the sequence's last n tokens
(n from ``n_max`` down to ``n_min``) and propose what followed it."""

from __future__ import annotations

import torch

from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.draft.base import DrafterBase, Peek, Proposal, one_hot_proposal

NGRAM = "ngram"  # its kind (draft/__init__.KINDS) and the source its drafts count under


class NgramDrafter(DrafterBase):
    """The draft distribution is one-hot, so every acceptance rule works unchanged (SpS accepts
    with q_n and stays exactly lossless; Cactus accepts with its boosted h_n). A draft model can
    stand behind it (base.Fallback) for when nothing matches.

    Lookups are O(n_max) per token: for each n, a map from every n-gram that has a continuation
    to the start of its latest occurrence, updated as the sequence grows."""

    def __init__(self, vocab_size: int, device: torch.device, n_max: int = 4, n_min: int = 1):
        self.vocab_size = vocab_size
        self.device = device
        self.n_max, self.n_min = n_max, n_min
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence with a continuation
        self.indexed = 0  # how much of the sequence the index covers

    def start(self, prompt: list[int], previous: list[int], reuse: bool = False, memory: str | None = "") -> None:
        self.index, self.indexed = {}, 0
        self._update(prompt)

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

    def peek(self, seq: list[int]) -> Peek | None:
        return Peek(NGRAM) if self.lookup(seq, 1) else None

    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        return one_hot_proposal(self.lookup(seq, k) if k else [], self.vocab_size, self.device, sp, NGRAM)
