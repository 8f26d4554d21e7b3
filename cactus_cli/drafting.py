"""Drafting behind a small interface: propose k tokens with their probabilities, then be told
how many were accepted. Two implementations: the draft model (``DraftModelDrafter``) and prompt
lookup (``NgramDrafter``: copy what followed the last occurrence of the current n-gram, with an
optional draft model for when nothing matches)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cactus_cli.runners import CachedLM, to_device
from cactus_cli.sampling import SamplingParams, probs_from_logits, sample


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k'] int64, on the drafter's device; k' <= k (a lookup may offer fewer)
    probs: torch.Tensor | None  # [k', V] float32 draft probabilities; None when greedy
    source: str = "model"  # "model" or "ngram"


class Drafter(Protocol):
    forward_passes: int
    catch_up: int  # tokens the next proposal's first forward feeds (more than 2 after k = 0 steps)
    device: torch.device

    def next_source(self) -> str | None:
        """Where the next proposal's drafts would come from ("model", "ngram"), or None when it
        has nothing to offer (a lookup with no match): then the step is a plain one."""

    def reset(self) -> None:
        """Forget everything cached."""

    def start(self, prefix: list[int], reuse: bool = False) -> int:
        """Begin a sequence; ``prefix`` is every token so far (the prompt). With ``reuse``, keep
        what is cached of a shared prefix; return how many tokens were reused."""

    def propose(self, k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        """Draft k tokens continuing the sequence."""

    def accept(self, num_accepted: int, new_tokens: list[int]) -> None:
        """The verifier kept ``num_accepted`` of the last proposal; ``new_tokens`` is everything
        the sequence grew by (the accepted drafts and the correction or bonus token)."""


class DraftModelDrafter:
    """Drafts with a small causal LM sharing the verifier's tokenizer.

    Its cache holds the sequence minus ``pending`` tokens; the next proposal feeds ``pending``
    (1 token, or 2 after a full acceptance: the last draft and the bonus) in its first
    forward, so no forward pass is spent only on catching up."""

    def __init__(self, runner: CachedLM):
        self.runner = runner  # eager or compiled: the same forward / crop calls
        self.seq: list[int] = []  # the sequence so far; the cache holds seq[: cache_len]
        self.pending: list[int] = []  # seq[cache_len:], fed by the next proposal
        self._k = 0  # size of the last proposal

    @property
    def forward_passes(self) -> int:
        return self.runner.forward_passes

    @property
    def device(self) -> torch.device:
        return self.runner.lm.device

    @property
    def catch_up(self) -> int:
        return len(self.pending)

    def next_source(self) -> str | None:
        return "model"

    def reset(self) -> None:
        self.runner.reset()
        self.seq, self.pending = [], []

    def start(self, prefix: list[int], reuse: bool = False) -> int:
        """Take ``prefix`` (all but its last token into the cache). With ``reuse``, the longest
        cached prefix it shares with the previous sequence is kept. Returns tokens reused."""
        keep = self.runner.prefill(prefix, self.seq, reuse)
        self.seq = list(prefix)
        self.pending = prefix[-1:]
        return keep

    @torch.inference_mode()
    def propose(self, k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        self._k = k
        tokens, probs = [], []
        feed: torch.Tensor | list[int] = self.pending
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
            return Proposal(torch.zeros(0, dtype=torch.int64, device=self.device), None)
        self.pending = []
        return Proposal(torch.cat(tokens), torch.stack(probs) if probs else None)

    def accept(self, num_accepted: int, new_tokens: list[int]) -> None:
        if self._k == 0:  # nothing was fed this step
            self.pending = self.pending + new_tokens
        else:
            # the cache holds the old sequence + the first k-1 drafts; keep the ones that stayed
            fed = min(num_accepted, self._k - 1)
            self.runner.crop(len(self.seq) + fed)
            self.pending = new_tokens[fed:]
        self.seq += new_tokens
        self._k = 0


class NgramDrafter:
    """Prompt-lookup drafting: find the most recent earlier occurrence of the sequence's last n
    tokens (n from ``n_max`` down to ``n_min``) and propose what followed it. The draft
    distribution is one-hot, so every acceptance rule works unchanged (SpS accepts with q_n and
    stays exactly lossless; Cactus accepts with its boosted h_n). With ``fallback``, a draft model
    drafts when nothing matches; its cache stays in sync either way (steps it sat out are fed in
    its next forward, as after a k = 0 step).

    Lookups are O(n_max) per token: for each n, a map from every n-gram that has a continuation to
    the start of its latest occurrence, updated as tokens arrive."""

    def __init__(self, vocab_size: int, device: torch.device, n_max: int = 4, n_min: int = 1,
                 fallback: DraftModelDrafter | None = None):
        self.vocab_size = vocab_size
        self._device = device
        self.n_max, self.n_min = n_max, n_min
        self.fallback = fallback
        self.seq: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence with a continuation

    @property
    def forward_passes(self) -> int:
        return self.fallback.forward_passes if self.fallback else 0

    @property
    def catch_up(self) -> int:
        return self.fallback.catch_up if self.fallback else 0

    @property
    def device(self) -> torch.device:
        return self.fallback.device if self.fallback else self._device

    def reset(self) -> None:
        self.seq, self.index = [], {}
        if self.fallback:
            self.fallback.reset()

    def start(self, prefix: list[int], reuse: bool = False) -> int:
        self.seq, self.index = [], {}
        self._extend(list(prefix))
        return self.fallback.start(prefix, reuse) if self.fallback else 0

    def _extend(self, tokens: list[int]) -> None:
        for t in tokens:
            j = len(self.seq)  # t lands at position j: every n-gram ending at j - 1 now has a continuation
            for n in range(self.n_min, self.n_max + 1):
                if j >= n:
                    self.index[tuple(self.seq[j - n : j])] = j - n
            self.seq.append(t)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching tail."""
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(self.seq) <= n:
                continue
            start = self.index.get(tuple(self.seq[-n:]))
            if start is not None:
                return self.seq[start + n : start + n + k]
        return []

    def next_source(self) -> str | None:
        if self.lookup(1):
            return "ngram"
        return "model" if self.fallback else None

    def propose(self, k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        tokens = self.lookup(k) if k else []
        if not tokens and self.fallback is not None and k:
            return self.fallback.propose(k, sp, generator)
        ids = to_device(tokens, self.device)  # [k']
        probs = None
        if not sp.greedy and tokens:  # [k', V] one-hot
            probs = torch.zeros(len(tokens), self.vocab_size, device=self.device).scatter_(1, ids.view(-1, 1), 1.0)
        return Proposal(ids, probs, "ngram")

    def accept(self, num_accepted: int, new_tokens: list[int]) -> None:
        if self.fallback:
            self.fallback.accept(num_accepted, new_tokens)  # sat out this step: it queues new_tokens
        self._extend(new_tokens)


def parse_draft(spec: str | None) -> tuple[bool, str | None]:
    """A --draft value: ``MODEL``, ``ngram`` (prompt lookup alone) or ``ngram+MODEL`` (lookup,
    the model when nothing matches). Returns (use lookup, model source or None)."""
    from cactus_cli.errors import ConfigError

    if spec is None:
        return False, None
    if spec == "ngram":
        return True, None
    if spec.startswith("ngram+"):
        model = spec[len("ngram+"):].strip()
        if not model:
            raise ConfigError("--draft ngram+MODEL: name the draft model after the +, e.g. ngram+embedded:qwen2.5-coder-0.5b")
        return True, model
    return False, spec

