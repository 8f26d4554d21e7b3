"""Drafting with a small causal LM that shares the verifier's tokenizer."""

from __future__ import annotations

import torch

from cactus_cli.core.events import MODEL
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.draft.base import DrafterBase, Item, Peek, Proposal, draw
from cactus_cli.infer.runner import Runner, common_prefix


class ModelDrafter(DrafterBase):
    """Its cache holds ``seq[: cache_len]``; a proposal's first forward feeds the rest (1 token,
    or 2 after a full acceptance: the last draft and the bonus; more after k = 0 steps), so no
    forward pass is spent only on catching up."""

    def __init__(self, runner: Runner, lazy: bool = False):
        self.runner = runner  # eager or compiled: the same forward / crop calls
        self.lazy = lazy  # start() only keeps the cached prefix; the first proposal feeds the rest
        self.reads_prompt = not lazy
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

    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        return self.propose_many([(self, seq, k, sp, generator)])[0]

    @staticmethod
    @torch.inference_mode()
    def propose_many(items: list[Item]) -> list[Proposal]:
        """Draft for several sequences of one draft model: at each draft position, one model call
        over every sequence still drafting (``Runner.forward_rows``), each row sampled with its
        own sampling and generator as it would be alone."""
        feeds, state = [], []
        for d, seq, k, sp, gen in items:
            d._k, d._base = k, len(seq)
            feed = seq[d.runner.cache_len :]
            feeds.append(feed)
            state.append(([], [], len(feed)))
        for j in range(max((k for _, _, k, _, _ in items), default=0)):
            live = [i for i, (_, _, k, _, _) in enumerate(items) if k > j]
            rows = [(items[i][0].runner, feeds[i], 1) for i in live]
            for i, logits in zip(live, items[live[0]][0].runner.forward_rows(rows)):
                d, seq, k, sp, gen = items[i]
                logits = logits[-1]  # [V]
                tokens, probs, _ = state[i]
                tok = draw(logits, sp, gen, probs)  # [1]
                tokens.append(tok)
                feeds[i] = tok  # the last drafted token is never fed: the verifier decides what follows
        out = []
        for (d, _, _, _, _), (tokens, probs, fed) in zip(items, state):
            if not tokens:
                out.append(Proposal(torch.zeros(0, dtype=torch.int64, device=d.runner.lm.device), None))
            else:
                out.append(Proposal(torch.cat(tokens), torch.stack(probs) if probs else None, MODEL, fed))
        return out

    def accept(self, seq: list[int], num_accepted: int) -> None:
        if self._k:  # the cache holds the old sequence + the first k-1 drafts: keep the ones that stayed
            self.runner.crop(self._base + min(num_accepted, self._k - 1))
        self._k = 0
