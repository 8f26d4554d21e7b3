"""Drafts from memory (SuffixDecoding, Oliaro et al., NeurIPS 2025): a suffix tree over the
request (prompt and output so far) and a history tree over earlier requests' prompts and outputs
in this process (chat turns, bench and eval prompts, lm-eval requests), optionally remembered
across runs (``--remember``). Each step drafts the most frequent continuation of the most useful
match, as long as the path's estimated probability stays above MIN_PROB (estimates that trust a
lone occurrence more the longer the matched context: suffix_tree.follow), so the draft's length
follows how predictable the text is (the k policy still caps it by cost).

Sampling (T > 0), each drafted token is drawn from the tree's counts at its node (restricted to
the tokens that keep the path above MIN_PROB), and those counts are the draft distribution the
rule sees: a real distribution, so every rule applies unchanged and SpS stays exactly lossless.
``sampled=False`` (and greedy decoding, always) drafts the most frequent path one-hot instead,
like prompt lookup. Sampled is the default because it measured as good or better
(docs/drafters.md has both). A draft model can stand behind it (base.Fallback) for when neither
tree has a likely continuation.
"""

from __future__ import annotations

import random

import torch

from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.draft.base import DrafterBase, Peek, Proposal, one_hot_proposal
from cactus_cli.infer.draft.suffix_tree import History, Match, SuffixTree, follow
from cactus_cli.infer.runner import to_device

SUFFIX = "suffix"  # its kind (draft/__init__.KINDS) and the source its drafts count under

MIN_PROB = 0.1  # a draft ends where its path's estimated probability would fall below this
MAX_DRAFT = 64  # tokens looked ahead when asked whether there is a draft (the k policy caps it)


class SuffixDrafter(DrafterBase):
    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        history: History | dict[str, History] | None = None,
        sampled: bool = True,
    ):
        """``history``: the remembered history, or every history by memory name as the engine's
        slots share them (each slot's drafter reads and extends the same trees)."""
        self.vocab_size = vocab_size
        self.device = device
        self.sampled = sampled
        self.min_prob = MIN_PROB
        shared = history if isinstance(history, dict) else {"": history if history is not None else History()}
        self.histories: dict[str, History] = shared
        self.memory: str | None = ""  # the history this sequence reads and extends (None: none)
        self.request = SuffixTree()
        self.rng: random.Random | None = None
        self._found: tuple[int, Match | None, History | None] | None = None  # (len(seq), match, its history)

    def start(self, prompt: list[int], previous: list[int], reuse: bool = False, memory: str | None = "") -> None:
        """A new request tree; the history stays."""
        self.request, self._found, self.rng = SuffixTree(), None, None
        self.memory = memory

    def finish(self, seq: list[int]) -> None:
        """The sequence is done: the history remembers it (unless this run reads no history)."""
        if self.memory is not None and seq:
            self.histories.setdefault(self.memory, History()).add(seq)

    def _match(self, seq: list[int]) -> tuple[Match | None, History | None]:
        """The best node to draft from in the request or the history tree (ties: the request's),
        computed once per sequence length."""
        if self._found is None or self._found[0] != len(seq):
            self.request.add(0, seq)
            best, where = self.request.best(seq, MAX_DRAFT, self.min_prob), None
            if self.memory is not None:
                history = self.histories.setdefault(self.memory, History())
                other = history.tree.best(seq, MAX_DRAFT, self.min_prob)
                if other is not None and (best is None or other.score > best.score):
                    best, where = other, history
            self._found = (len(seq), best, where)
        return self._found[1], self._found[2]

    def peek(self, seq: list[int]) -> Peek | None:
        """The tree's estimate for each token of the path it would draft (None: no path)."""
        match = self._match(seq)[0]
        return Peek(SUFFIX, match.steps) if match is not None else None

    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        match, history = self._match(seq) if k else (None, None)
        tokens: list[int] = match.tokens[:k] if match is not None else []
        dists: list[dict[int, float]] = []
        if match is not None and self.sampled and not sp.greedy:
            if self.rng is None:  # seeded by the run's seed: a sampled run replays exactly
                self.rng = random.Random(generator.initial_seed() if generator is not None else 0)
            tokens, dists, _ = follow(match.node, k, self.min_prob, self.rng, match.length)
        if history is not None and tokens:
            history.touch(match.doc)
        if sp.greedy or not dists:
            return one_hot_proposal(tokens, self.vocab_size, self.device, sp, SUFFIX)
        probs = torch.zeros(len(tokens), self.vocab_size)  # [k', V]: the counts each token was drawn from
        for i, dist in enumerate(dists):
            probs[i, list(dist)] = torch.tensor(list(dist.values()))
        return Proposal(to_device(tokens, self.device), probs.to(self.device), SUFFIX)

    def accept(self, seq: list[int], num_accepted: int) -> None:
        self._found = None
