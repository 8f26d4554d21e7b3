"""The speculative decoding engine: one generator of StepEvents that every command consumes.

Per step: k draft forwards of one token each (the first also feeds what the draft has not
seen yet), one verifier forward over the last token plus the k drafts, the acceptance rule,
then one crop of each KV cache to the accepted length. Nothing else touches a model.
The engine never imports Rich.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from cactus_cli.acceptance import greedy_verify, verify
from cactus_cli.drafting import CachedLM, DraftModelDrafter, Drafter
from cactus_cli.errors import ContextLimitError
from cactus_cli.events import Piece, StepEvent
from cactus_cli.models import ModelPair
from cactus_cli.sampling import SamplingParams, probs_from_logits


@dataclass
class GenerationParams:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rule: str = "cactus"
    rule_kwargs: dict[str, Any] = field(default_factory=dict)
    num_draft_tokens: int = 4  # k; 0 runs the verifier alone (autoregressive baseline)
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int = 0


class Detokenizer:
    """Incremental decoding that never emits half a multi-byte character (vLLM's scheme:
    decode a short window and emit what grew past the previous window's text)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""


def eos_ids(pair: ModelPair) -> set[int]:
    ids: set[int] = set()
    for source in (pair.tokenizer, getattr(pair.verifier.model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeEngine:
    def __init__(self, pair: ModelPair):
        self.pair = pair
        self.verifier = CachedLM(pair.verifier, pair.vocab_size)
        self.drafter: Drafter | None = DraftModelDrafter(pair.draft, pair.vocab_size) if pair.draft else None
        self.eos = eos_ids(pair)
        limits = [pair.verifier.context_length] + ([pair.draft.context_length] if pair.draft else [])
        self.context_length = min(limits)
        self.seq_len = 0

    def cache_lengths(self) -> dict[str, int]:
        """For tests and diagnostics: the verifier cache always holds the sequence minus its last token."""
        out = {"sequence": self.seq_len, "verifier": self.verifier.cache_len}
        if isinstance(self.drafter, DraftModelDrafter):
            out["draft"] = self.drafter.runner.cache_len
            out["draft_pending"] = len(self.drafter.pending)
        return out

    def generate(self, prompt_ids: list[int], params: GenerationParams) -> Iterator[StepEvent]:
        if not prompt_ids:
            raise ContextLimitError("the prompt is empty after tokenization; give the model something to continue")
        if len(prompt_ids) >= self.context_length:
            raise ContextLimitError(
                f"the prompt is {len(prompt_ids)} tokens but the context window is {self.context_length}; "
                "shorten the prompt"
            )
        return self._run(list(prompt_ids), params)

    @torch.inference_mode()
    def _run(self, prompt: list[int], params: GenerationParams) -> Iterator[StepEvent]:
        sp = params.sampling
        vdev = self.pair.verifier.device
        vgen = torch.Generator(device=vdev).manual_seed(params.seed)
        drafter = self.drafter if params.num_draft_tokens > 0 else None
        dgen = None
        if drafter is not None:
            ddev = self.pair.draft.device
            dgen = vgen if ddev == vdev else torch.Generator(device=ddev).manual_seed(params.seed + 1)

        t_start = time.perf_counter()
        v_passes0 = self.verifier.forward_passes
        d_passes0 = drafter.forward_passes if drafter else 0
        # prefill: both caches take the prompt minus its last token, which each step feeds
        self.verifier.reset()
        if len(prompt) > 1:
            self.verifier.forward(prompt[:-1], keep=1)
        if drafter is not None:
            drafter.start(prompt)
        _sync(vdev)
        prefill_seconds = time.perf_counter() - t_start

        detok = Detokenizer(self.pair.tokenizer)
        last = prompt[-1]
        self.seq_len = len(prompt)
        produced = 0
        text = ""
        max_stop = max((len(s) for s in params.stop), default=0)
        first = True
        while True:
            room = self.context_length - self.seq_len  # positions left for new tokens
            k = 0 if drafter is None else max(0, min(params.num_draft_tokens, room - 1, params.max_tokens - produced - 1))

            t0 = time.perf_counter()
            proposal = drafter.propose(k, sp, dgen) if drafter is not None else None
            if proposal is not None:
                _sync(proposal.tokens.device)
            t1 = time.perf_counter()

            drafts = proposal.tokens.to(vdev) if k else torch.zeros(0, dtype=torch.int64, device=vdev)  # [k]
            logits = self.verifier.forward(torch.cat([torch.tensor([last], device=vdev), drafts]), keep=k + 1)
            if sp.greedy:
                verdict = greedy_verify(drafts.view(1, k), logits.argmax(-1).view(1, k + 1))
            else:
                q = probs_from_logits(logits, sp).unsqueeze(0)  # [1, k+1, V]
                p = proposal.probs.to(vdev).unsqueeze(0) if k else q[:, :0]  # [1, k, V]
                verdict = verify(params.rule, p, q, drafts.view(1, k), generator=vgen, **params.rule_kwargs)
            m = int(verdict.num_accepted[0])
            new = verdict.tokens[0, : m + 1].tolist()  # accepted drafts + one extra token
            t2 = time.perf_counter()

            # keep both caches to exactly the sequence minus its last token
            self.verifier.crop(self.seq_len + m)
            if drafter is not None:
                drafter.accept(m, new)
            self.seq_len += len(new)
            last = new[-1]

            draft_list = drafts.tolist()
            rejected = tuple(draft_list[m:])
            extra_kind = "verifier" if k == 0 else ("bonus" if m == k else "correction")
            emitted: list[int] = []
            pieces: list[Piece] = []
            finish = None
            for i, token in enumerate(new):
                kind = "accepted" if i < m else extra_kind
                emitted.append(token)
                produced += 1
                if token in self.eos and not params.ignore_eos:
                    finish = "eos"
                    break
                piece = detok.add(token)
                if params.stop and piece:
                    window = text[-max_stop:] + piece
                    hits = [window.find(s) for s in params.stop if s in window]
                    if hits:
                        cut = min(hits) - len(text[-max_stop:])  # where the stop string starts within piece
                        piece = piece[: max(cut, 0)]
                        finish = "stop"
                text += piece
                pieces.append(Piece(piece, kind))
                if finish:
                    break
                if produced >= params.max_tokens:
                    finish = "length"
                    break
            if finish is None and self.seq_len >= self.context_length:
                finish = "context"

            rejected_text = tuple(self.pair.tokenizer.decode([t]) for t in rejected)
            ev = StepEvent(
                num_drafted=k,
                accepted=tuple(new[:m]),
                rejected=rejected,
                extra=new[-1],
                extra_kind=extra_kind,
                emitted=tuple(emitted),
                pieces=tuple(pieces),
                rejected_text=rejected_text,
                draft_seconds=t1 - t0,
                verify_seconds=t2 - t1,
                prefill_seconds=prefill_seconds if first else 0.0,
                elapsed=time.perf_counter() - t_start,
                draft_forward_passes=(drafter.forward_passes - d_passes0) if drafter else 0,
                verifier_forward_passes=self.verifier.forward_passes - v_passes0,
                prompt_tokens=len(prompt),
                finish_reason=finish,
            )
            v_passes0 = self.verifier.forward_passes
            d_passes0 = drafter.forward_passes if drafter else 0
            first = False
            yield ev
            if finish:
                return
