"""Constrained decoding: a grammar (a JSON schema, a Lark grammar or a regular expression) that
every emitted token must keep, as a token mask from llguidance.

A run with a grammar (``GenerationParams.grammar``) keeps a matcher of what it has emitted. Each
step its drafts are cut before the first one that leaves the grammar, and the verifier's rows and
the drafts' rows are masked to what the grammar allows at each position (one call computes the
k + 1 masks along the drafts). The rule then decides over the masked distributions: SpS emits
exactly the masked verifier distribution q~ and Cactus stays within its budget of it, because a
drafter that offers a valid token drawn from p (so from p~, p masked and renormalized) or, past
the first invalid one, nothing at all, is still a drafter, and each rule's guarantee holds for
any drafter (docs/serve.md, "JSON output"). EOS is allowed where the grammar may end, and only
EOS once it must.

llguidance was chosen by measurement (benchmarks/grammar_masks.py): on the 151k Qwen vocabulary a
mask costs ~0.01 ms and a verify block's 9 masks ~0.1 ms (xgrammar: about the same, 20x the
compile time, and triton among its dependencies); it rolls back and masks along drafts natively."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch

from cactus_cli.core.errors import ConfigError

KINDS = ("json_schema", "lark", "regex")
GRAMMAR = "grammar"  # the draft source of the tokens a grammar forces (a schema's keys, its punctuation)
MAX_FORCED = 16  # forced tokens offered as one step's drafts at most
# the model's own JSON layout (compact or pretty-printed), but never a run of more than 32 blanks: a model
# that falls into emitting whitespace cannot spend the answer on it
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,32}"}


@dataclass(frozen=True)
class Grammar:
    """What a run's output must match: ``kind`` one of KINDS, ``text`` the schema (JSON text), the
    Lark grammar or the regular expression."""

    kind: str
    text: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | None = None) -> Grammar:
        """Any JSON object (``None``), or one that validates against ``schema``."""
        return cls("json_schema", json.dumps(schema if schema is not None else {"type": "object"}))


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError as err:  # (a dependency of the project; a broken install says so in one line)
        raise ConfigError(f"constrained output needs the llguidance package ({err}); pip install llguidance") from err
    return llguidance


class Grammars:
    """Compiles grammars against one tokenizer (its llguidance view is built once: ~1.5 s on a
    151k vocabulary) and makes each run's ``Constraint``."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]):
        self.hf = tokenizer
        self.vocab_size = vocab_size
        self.eos = sorted(eos)
        self._tok = None

    def _tokenizer(self):
        if self._tok is None:
            llg = _llguidance()
            eos = self.eos or None
            try:
                self._tok = llg.hf.from_tokenizer(self.hf, n_vocab=self.vocab_size, eos_token=eos)
            except ValueError:  # (a tokenizer llguidance cannot read whole, e.g. word-level with no decoder)
                wrapped = llg.TokenizerWrapper(_TokenBytes(self.hf, self.vocab_size))
                self._tok = llg.LLTokenizer(wrapped, n_vocab=self.vocab_size, eos_token=eos)
        return self._tok

    def source(self, grammar: Grammar) -> str:
        """llguidance's grammar text, or a ConfigError naming what is wrong with it."""
        llg = _llguidance()
        try:
            if grammar.kind == "json_schema":
                if not isinstance(json.loads(grammar.text), dict):
                    raise ValueError("a JSON schema is a JSON object")
                return llg.LLMatcher.grammar_from_json_schema(grammar.text, defaults=JSON_OPTIONS)
            if grammar.kind == "lark":
                return llg.LLMatcher.grammar_from_lark(grammar.text)
            if grammar.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(grammar.text)
        except ValueError as err:
            raise ConfigError(f"the {grammar.kind} is not valid: {err}") from err
        raise ConfigError(f"unknown grammar kind {grammar.kind!r}; choose one of: {', '.join(KINDS)}")

    def check(self, grammar: Grammar) -> None:
        """Raise a ConfigError if ``grammar`` does not compile (before a request is queued)."""
        llg = _llguidance()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(self.source(grammar), self._tokenizer())
        if failed:
            first = " ".join((messages[0] if messages else "invalid").split("\n")[:3]).strip()
            raise ConfigError(f"the {grammar.kind} cannot be used: {first}")
        self.constraint(grammar).masks([])  # (a vocabulary that cannot start it, e.g. no "{": refused now)

    def constraint(self, grammar: Grammar) -> Constraint:
        llg = _llguidance()
        matcher = llg.LLMatcher(self._tokenizer(), self.source(grammar), log_level=0)
        if matcher.is_error():
            raise ConfigError(f"the {grammar.kind} cannot be used: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, llg, set(self.eos))


class _TokenBytes:
    """A tokenizer as llguidance's TokenizerWrapper reads it: each id's bytes, and encoding."""

    def __init__(self, hf: Any, vocab_size: int):
        special = set(hf.all_special_ids)
        self.eos_token_id = hf.eos_token_id
        self.bos_token_id = hf.bos_token_id
        self.special_token_ids = sorted(special)
        n = len(hf)
        self.tokens = [
            (hf.convert_ids_to_tokens(i) if i in special else hf.decode([i])).encode() if i < n else b""
            for i in range(vocab_size)
        ]
        self.ids = {t: i for i, t in enumerate(self.tokens) if t and i not in special}
        self.longest = max((len(t) for t in self.ids), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        """Longest match over the tokens' bytes: the tokenization llguidance's masks assume (the
        tokenizer's own encode may split words first, so forced bytes would come back unknown)."""
        data = text.encode() if isinstance(text, str) else text
        out, at = [], 0
        while at < len(data):
            for n in range(min(self.longest, len(data) - at), 0, -1):
                if (tid := self.ids.get(data[at : at + n])) is not None:
                    out.append(tid)
                    at += n
                    break
            else:
                at += 1  # (a byte no token holds: skipped)
        return out


class Constraint:
    """One run's grammar state: the matcher has consumed every token the run emitted."""

    def __init__(self, matcher: Any, vocab_size: int, llg: Any, eos: set[int]):
        self.matcher = matcher
        self.eos = eos
        self.vocab_size = vocab_size
        self.llg = llg
        self.executor = llg.LLExecutor(1)

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of ``drafts`` the grammar keeps, in order."""
        return self.matcher.validate_tokens(drafts) if drafts else 0

    def masks(self, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, V] bool: what the grammar allows now and after each of ``drafts`` (all
        valid), computed in one call; the matcher is left where it was."""
        n = len(drafts)
        packed = self.llg.numpy.allocate_token_bitmask(n + 1, self.vocab_size)
        if drafts:
            masks = self.llg.numpy.fill_next_token_bitmask_par_with_draft_tokens
            masks(self.executor, [(self.matcher, 0, drafts)], packed)
        else:
            self.llg.numpy.fill_next_token_bitmask(self.matcher, packed, 0)
        if self.matcher.is_error():
            self._failed("the grammar matcher failed")
        # bit j of word i is token 32 i + j: little-endian words, bits read least significant first
        bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")[:, : self.vocab_size]
        allowed = torch.from_numpy(bits.view(np.bool_))
        if not bool(allowed.any(-1).all()):
            raise ConfigError("the model's vocabulary cannot write the requested output format (no token continues it)")
        return allowed

    def advance(self, tokens: list[int]) -> None:
        """The run emitted ``tokens`` (each one allowed by its mask; EOS, which ends the run, is not
        fed: a complete grammar takes nothing more)."""
        tokens = [t for t in tokens if t not in self.eos]
        if tokens and not self.matcher.consume_tokens(tokens):
            self._failed("an emitted token left the grammar")

    def _failed(self, what: str) -> NoReturn:
        """The matcher stopped: past one of llguidance's limits (a schema too large for its parser,
        e.g. 2,000 properties in one object) it is the request's to fix; anything else is ours."""
        error = self.matcher.get_error() or ""
        first = error.split("\n")[0].removeprefix("Parser Error: ")[:200]
        if "ParserTooComplex" in error or "too complex" in error.lower() or "; max is " in first:
            raise ConfigError(f"the requested output format is too large for the grammar parser ({first}); simplify it")
        if "NoExtensionBias" in error:  # (no token of this vocabulary continues it: a word-level one has no "{")
            raise ConfigError("the model's vocabulary cannot write the requested output format (no token continues it)")
        raise RuntimeError(f"internal error: {what} ({first})")

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (its canonical tokenization of the bytes it forces):
        free drafts, which the masked verifier accepts unless the model would spell them otherwise."""
        return self.matcher.compute_ff_tokens()

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more but EOS."""
        return self.matcher.is_stopped()


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[n, V] logits with what the grammar forbids set to -inf."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def mask_probs(p: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[n, V] draft probabilities restricted to what the grammar allows, renormalized (a drafted token
    the grammar keeps was drawn from exactly this)."""
    kept = p * allowed.to(p.device, p.dtype)
    return kept / kept.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
