"""A draft model whose tokenizer differs from the verifier's (Timor et al., "Accelerating LLM
Inference with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies", ICML 2025).

The draft reads the verified text in its own tokens: the visible text of the verified sequence
(special tokens left out: the draft sees the conversation's text, not the verifier's chat
template, whose markers would be foreign text to another family) re-encoded by the draft's
tokenizer. Its cache keeps the longest prefix it shares with that encoding, so each step
re-feeds only what changed (usually the verifier's last token or two).

Two methods (``--cross-vocab``):

- ``string`` (SLEM): the draft writes k tokens of its own; their text, appended to the decoded
  last few verified tokens, is encoded by the verifier's tokenizer, and the verifier tokens
  after those are proposed, the last one left out (the draft's text may end inside it). Drafts
  are one-hot: any rule applies, SpS stays exactly lossless (a one-hot draft is accepted with
  q(x), whatever produced x), Cactus accepts with its boosted h. Since any x is lossless, the
  draft writes its most likely text (argmax), its best guess at a large q(x): sampling it at
  the run's temperature adds less likely tokens, often ones the verifier's top-k / top-p cut
  (q = 0, which no rule accepts). Measured: more accepted under SpS and Cactus (README).
- ``intersection`` (TLI): the draft's distribution restricted to the tokens both vocabularies
  spell the same (vocab.py), renormalized and mapped to verifier ids: a real distribution over
  the verifier's vocabulary, so every rule applies unchanged, exactness included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cactus_cli.core.events import MODEL
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.draft.base import DrafterBase, Peek, Proposal, draw, one_hot_proposal
from cactus_cli.infer.load.vocab import VocabMap, encode, eos_id, visible_text
from cactus_cli.infer.runner import Runner, common_prefix

STRING, INTERSECTION = "string", "intersection"
ANCHOR = 4  # verified tokens decoded before the draft's text, so the verifier encodes it in context


class CrossVocabDrafter(DrafterBase):
    def __init__(
        self, runner: Runner, method: str, draft_tok: Any, verifier_tok: Any, vmap: VocabMap, verifier_vocab: int
    ):
        self.runner = runner
        self.method = method
        self.dtok, self.vtok = draft_tok, verifier_tok
        self.vmap = vmap
        self.verifier_vocab = verifier_vocab
        self.d_eos, self.v_eos = eos_id(draft_tok), eos_id(verifier_tok)
        self.cached: list[int] = []  # the draft ids its cache holds
        self.target: list[int] = []  # the verified text in draft ids
        self._synced = -1  # the sequence length ``target`` was encoded for
        dev = runner.lm.device
        self.shared = torch.zeros(runner.vocab_size, dtype=torch.bool, device=dev)
        self.shared[vmap.draft_ids.to(dev)] = True
        self.to_verifier = torch.zeros(runner.vocab_size, dtype=torch.int64, device=dev)
        self.to_verifier[vmap.draft_ids.to(dev)] = vmap.verifier_ids.to(dev)

    def peek(self, seq: list[int]) -> Peek | None:
        return Peek(MODEL) if seq else None  # (not re-encoded here: a plain step must cost nothing)

    @property
    def device(self) -> torch.device:
        return self.runner.lm.device

    def start(self, prompt: list[int], previous: list[int], reuse: bool = False, memory: str | None = "") -> int:
        self.cached = self.cached[: self.runner.cache_len]  # (the engine may have reset the runner)
        self._synced = -1
        self._sync(prompt)
        kept = self.runner.prefill(self.target, self.cached, reuse) if len(self.target) > 1 else 0
        if len(self.target) <= 1:
            self.runner.reset()
        self.cached = self.target[:-1] if self.target else []
        return kept

    def _sync(self, seq: list[int]) -> None:
        """``target`` = the verified text in draft ids; the cache keeps what it shares with it."""
        if self._synced == len(seq):
            return
        text = visible_text(self.vtok, seq)
        self.target = list(self.dtok(text)["input_ids"])  # (with the draft's BOS, if it uses one)
        self._synced = len(seq)
        keep = min(common_prefix(self.cached, self.target), max(len(self.target) - 1, 0))
        if keep < len(self.cached):
            self.runner.crop(keep)
            self.cached = self.cached[: self.runner.cache_len]  # (less if a sliding window forgot)

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        empty = Proposal(torch.zeros(0, dtype=torch.int64, device=self.device), None)
        if not k:  # a plain step (the k policy's choice when drafts do not pay): no re-encoding either
            return empty
        self._sync(seq)
        if not self.target:
            return empty
        feed: list[int] | torch.Tensor = self.target[len(self.cached) :]
        fed = len(feed)
        self.cached = list(self.target)
        drafted, rows = [], []
        own = dataclasses.replace(sp, logit_bias=())  # (the bias names verifier ids; the rule keeps it exact)
        steps = k + 1 if self.method == STRING else k  # (string: one more, so the k-th verifier token is whole)
        for i in range(steps):
            logits = self.runner.forward(feed, keep=1)[-1]  # [V_draft]
            if self.method == INTERSECTION:
                logits = logits.masked_fill(~self.shared, float("-inf"))  # only tokens the verifier spells alike
            tok = draw(logits, own, generator, rows, greedy=self.method == STRING)  # (string: its most likely text)
            drafted.append(tok)
            if i < steps - 1:
                feed = tok  # the last drafted token is never fed: the verifier decides what follows
        ids = torch.cat(drafted)  # [k] draft ids
        host = ids.tolist()
        self.cached += host[:-1]
        if self.method == INTERSECTION:
            return self._intersection(ids, rows, fed)
        return self._string(seq, host, k, sp, fed)

    def _intersection(self, ids: torch.Tensor, rows: list[torch.Tensor], fed: int) -> Proposal:
        tokens = self.to_verifier[ids]  # [k] verifier ids
        probs = None
        if rows:  # [k, V_verifier]: the restricted draft distribution, moved to the verifier's ids
            p = torch.stack(rows)[:, self.vmap.draft_ids.to(self.device)]  # [k, S]
            probs = torch.zeros(len(rows), self.verifier_vocab, device=self.device)
            probs[:, self.vmap.verifier_ids.to(self.device)] = p
        return Proposal(tokens, probs, MODEL, fed)

    def _string(self, seq: list[int], drafted: list[int], k: int, sp: SamplingParams, fed: int) -> Proposal:
        """The verifier tokens the draft's text determines."""
        ended = self.d_eos is not None and self.d_eos in drafted
        if ended:
            drafted = drafted[: drafted.index(self.d_eos)]
        tail = self.target[-ANCHOR:]
        before = self.dtok.decode(tail, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        after = self.dtok.decode(tail + drafted, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        text = after[len(before) :].rstrip("\ufffd") if after.startswith(before) else ""
        anchor = seq[-ANCHOR:]
        head = self.vtok.decode(anchor, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        new: list[int] = []
        if text and "\ufffd" not in head:
            ids = encode(self.vtok, head + text)
            if ids[: len(anchor)] == anchor:
                new = ids[len(anchor) :]
                new = new if ended else new[:-1]
        if ended and self.v_eos is not None and (new or not text):
            new = new + [self.v_eos]
        new = new[:k]
        if any(t >= self.verifier_vocab for t in new):  # (an id past the verifier's logits: cut there)
            new = new[: next(i for i, t in enumerate(new) if t >= self.verifier_vocab)]
        return dataclasses.replace(one_hot_proposal(new, self.verifier_vocab, self.device, sp, MODEL), fed=fed)

    # (accept: the next step re-encodes the verified text and crops the cache to what it shares)
