"""Two tokenizers side by side, for a draft whose vocabulary differs from the verifier's (Timor
et al., ICML 2025): the tokens both vocabularies share, matched by the exact bytes each adds to
the text, and the text of a verified sequence as the draft tokenizes it.

Spellings are compared as bytes, not as the vocabulary's raw strings, so families with
different conventions still match: byte-level BPE (GPT-2, Qwen, Llama 3: ``Ġworld`` is the
bytes `` world`` through the byte-to-unicode table), SentencePiece (Llama 2, Gemma, Mistral:
``▁world`` is `` world``, ``<0x0A>`` is the byte 0x0A) and plain vocabularies (a word-level
tokenizer's words). Special tokens are never shared by spelling; the end-of-sequence tokens
are mapped to each other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from cactus_cli.core.errors import ModelError

SPIECE = "\u2581"  # SentencePiece's word-boundary mark


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table, inverted: the character each byte is spelled with."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def spelling_scheme(tokenizer: Any) -> str:
    """``bytelevel``, ``sentencepiece`` or ``plain``, from the fast tokenizer's decoder."""
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError):
        decoder = {}
    text = json.dumps(decoder, ensure_ascii=False)
    if '"ByteLevel"' in text:
        return "bytelevel"
    if '"Metaspace"' in text or SPIECE in text or '"ByteFallback"' in text:
        return "sentencepiece"
    return "plain"


def token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Each ordinary token's id -> the bytes it adds to the text (special tokens left out)."""
    scheme = spelling_scheme(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    table = _byte_decoder()
    out: dict[int, bytes] = {}
    for piece, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if scheme == "bytelevel":
            if all(ch in table for ch in piece):
                out[i] = bytes(table[ch] for ch in piece)
        elif scheme == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out[i] = bytes([int(piece[3:5], 16)])
            else:
                out[i] = piece.replace(SPIECE, " ").encode()
        else:
            out[i] = piece.encode()
    return out


def eos_id(tokenizer: Any) -> int | None:
    value = getattr(tokenizer, "eos_token_id", None)
    return value if isinstance(value, int) else None


@dataclass
class VocabMap:
    """The shared tokens of a draft and a verifier vocabulary: ``draft_ids[i]`` and
    ``verifier_ids[i]`` spell the same bytes; EOS maps to EOS."""

    draft_ids: torch.Tensor  # [S] int64
    verifier_ids: torch.Tensor  # [S] int64
    draft_vocab: int  # ordinary tokens of the draft's vocabulary
    to_verifier: dict[int, int]  # draft id -> verifier id, for the shared ones

    @property
    def shared(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def coverage(self) -> float:
        """The share of the draft's vocabulary the verifier also has."""
        return self.shared / max(self.draft_vocab, 1)

    @classmethod
    def build(cls, draft_tok: Any, verifier_tok: Any, draft_rows: int, verifier_rows: int) -> VocabMap:
        """Ids at or past a model's output rows are left out (they have no logit)."""
        vb = {b: i for i, b in token_bytes(verifier_tok).items() if i < verifier_rows}
        db = token_bytes(draft_tok)
        pairs = sorted((d, vb[b]) for d, b in db.items() if b in vb and d < draft_rows)
        de, ve = eos_id(draft_tok), eos_id(verifier_tok)
        if de is not None and ve is not None and de < draft_rows and ve < verifier_rows:
            pairs.append((de, ve))
        d = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        v = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        return cls(d, v, len(db), dict(pairs))


METHODS = ("auto", "string", "intersection")
MIN_COVERAGE = 0.1  # intersection: below this share of the draft's vocabulary, drafts would rarely be whole words


@dataclass
class CrossVocab:
    """How a draft with its own tokenizer drafts for this verifier."""

    method: str  # "string" or "intersection"
    tokenizer: Any  # the draft's
    vmap: VocabMap
    rows: int  # the draft's logits columns in use: its vocabulary
    why: str  # for --json: why this method

    @classmethod
    def build(
        cls, dtok: Any, vtok: Any, draft_rows: int, verifier_rows: int, method: str, draft: str, verifier: str
    ) -> CrossVocab:
        rows = len(dtok)
        if not draft_rows - max(1024, draft_rows // 100) <= rows <= draft_rows:
            raise ModelError(
                f"draft {draft!r} has {draft_rows} output rows but its tokenizer has {rows} tokens; "
                "the tokenizer does not belong to this model"
            )
        return cls.choose(dtok, VocabMap.build(dtok, vtok, rows, verifier_rows), rows, method, draft, verifier)

    @classmethod
    def choose(cls, dtok: Any, vmap: VocabMap, rows: int, method: str, draft: str, verifier: str) -> CrossVocab:
        """The method for a built map: ``auto`` is string; intersection needs MIN_COVERAGE."""
        share = f"{vmap.shared} of the draft's {vmap.draft_vocab} tokens ({vmap.coverage:.0%}) spelled alike in the verifier's"
        if method == "intersection" and vmap.coverage < MIN_COVERAGE:
            raise ModelError(
                f"--cross-vocab intersection: draft {draft!r} and verifier {verifier!r} share too little "
                f"vocabulary ({share}); use --cross-vocab string"
            )
        if method == "auto":
            method, why = (
                "string",
                (f"auto: string (re-tokenized drafts follow the verifier's own spelling of a text; {share})"),
            )
        else:
            why = f"as asked ({share})"
        return cls(method, dtok, vmap, rows, why)


def visible_text(tokenizer: Any, ids: list[int]) -> str:
    """The text of ``ids`` without special tokens and without a trailing incomplete character
    (a byte-level token can end mid-way through a UTF-8 sequence)."""
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return text.rstrip("\ufffd")


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Names the vocabulary token ids belong to (a saved history is refused by another one)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]
    return f"{len(vocab)} tokens, sha256 {digest}"
