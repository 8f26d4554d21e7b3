"""Drafting with a small causal LM that shares the verifier's tokenizer."""

from __future__ import annotations

import torch

from cactus_cli.core.events import MODEL
from cactus_cli.core.sampling import SamplingParams, probs_from_logits, sample
from cactus_cli.infer.draft.base import DrafterBase, Peek, Proposal
from cactus_cli.infer.runners.base import Runner, common_prefix


class ModelDrafter(DrafterBase):
    """Its cache holds ``seq[: cache_len]``; a proposal's first forward feeds the rest (1 token,
    or 2 after a full acceptance: the last draft and the bonus; more after k = 0 steps), so no
    forward pass is spent only on catching up."""

    def __init__(self, runner: Runner, lazy: bool = False):
        self.runner = runner  # eager or compiled: the same forward / crop calls
        self.lazy = lazy  # start() only keeps the cached prefix; the first proposal feeds the rest
        self._k = 0  # size of the last proposal
        self._base = 0  # the sequence's length when it was made

    def peek(self, seq: list[int]) -> Peek | None:
        return Peek(MODEL)

    def start(self, prompt: list[int], previous: list[int], reuse: bool = False, memory: str | None = "") -> int:
        """Prefill the prompt, or (``lazy``: a model behind a lookup, which may never be asked)
        only keep what the cache shares with it, the rest fed by the first proposal."""
        self._k = 0
        if not self.lazy:
            return self.runner.prefill(prompt, previous, reuse)
        keep = min(common_prefix(previous[: self.runner.cache_len], prompt), len(prompt) - 1) if reuse else 0
        if keep:
            self.runner.crop(keep)
        else:
            self.runner.reset()
        return self.runner.cache_len

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        self._k, self._base = k, len(seq)
        feed: torch.Tensor | list[int] = seq[self.runner.cache_len :]
        fed = len(feed)
        tokens, probs = [], []
        for _ in range(k):
            logits = self.runner.forward(feed, keep=1)[-1]  # [V]
            if sp.greedy:
                tok = logits.argmax(-1, keepdim=True)  # [1]
            else:
                p = probs_from_logits(logits, sp)  # [V]
                tok = sample(p.unsqueeze(0), generator)  # [1]
                probs.append(p)
            tokens.append(tok)
            feed = tok  # the last drafted token is never fed: the verifier decides what follows
        if not tokens:
            return Proposal(torch.zeros(0, dtype=torch.int64, device=self.runner.lm.device), None)
        return Proposal(torch.cat(tokens), torch.stack(probs) if probs else None, MODEL, fed)

    def accept(self, seq: list[int], num_accepted: int) -> None:
        if self._k:  # the cache holds the old sequence + the first k-1 drafts: keep the ones that stayed
            self.runner.crop(self._base + min(num_accepted, self._k - 1))
        self._k = 0
