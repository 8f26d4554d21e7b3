"""Drafters, one module each behind one interface (base.py): the draft model (model.py; with its
own tokenizer, cross.py) and the drafters that need no model, each a ``Kind`` in the one registry
``KINDS``: prompt lookup (ngram.py) and the suffix trees over the request and earlier requests
(suffix.py), either optionally backed by the draft model. A new model-free drafter is one module
and one line in KINDS: ``--draft NAME`` and ``NAME+MODEL``, its settings' checks, how its accepted
drafts show, its timings in the cost store and ``make_drafter`` all read the registry
(tests/test_toy_drafter.py adds one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cactus_cli.core import defaults
from cactus_cli.core.errors import warn as warn_line
from cactus_cli.core.fileio import check_output_file
from cactus_cli.infer.draft.base import Drafter, DrafterBase, Fallback, Peek, Proposal, one_hot_proposal, propose_all
from cactus_cli.infer.draft.cross import CrossVocabDrafter
from cactus_cli.infer.draft.model import ModelDrafter
from cactus_cli.infer.draft.ngram import NGRAM, NgramDrafter
from cactus_cli.infer.draft.suffix import SUFFIX, SuffixDrafter
from cactus_cli.infer.draft.suffix_tree import History
from cactus_cli.infer.load.vocab import CrossVocab, tokenizer_fingerprint
from cactus_cli.infer.runners.base import Runner

__all__ = [
    "KINDS",
    "Drafter",
    "DrafterBase",
    "Fallback",
    "Free",
    "History",
    "Kind",
    "Peek",
    "Proposal",
    "free_drafting",
    "make_drafter",
    "one_hot_proposal",
    "propose_all",
]


@dataclass(frozen=True)
class Free:
    """Drafting that needs no model, as a run asks for it: the kind's name, the values of the
    settings it reads (``Kind.settings``), and what it keeps across sequences (the suffix trees'
    remembered history), made once per engine."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    state: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class Kind:
    """A model-free drafter: ``--draft NAME`` (or ``NAME+MODEL``, the model drafting when it has
    nothing), and the source its drafts are timed and counted under."""

    name: str
    summary: str  # for --help and messages: "prompt lookup"
    label: str  # how its accepted drafts show (ui.STYLES): "copied", "remembered"
    settings: tuple[str, ...]  # the Settings keys it reads (any other draft given one: an error)
    make: Callable[[dict[str, Any], int, torch.device, Any], Drafter]  # (options, vocab, device, state)
    state: Callable[[dict[str, Any], Any, int, Callable[[str], None]], Any] | None = None  # (options, tok, V, warn)


def _history(
    options: dict[str, Any], tokenizer: Any, vocab_size: int, warn: Callable[[str], None]
) -> dict[str, History]:
    """The suffix trees' histories by memory name, shared by every slot's drafter: the remembered
    one under "" (``remember``: a file it is loaded from and saved to; one that cannot serve is
    one warning and an empty history)."""
    if not options.get("remember"):
        return {"": History()}
    path = check_output_file(options["remember"], "--remember")
    history, note = History.load(path, tokenizer_fingerprint(tokenizer), vocab_size)
    if note:
        warn(note)
    history.on_error = history.on_note = warn
    return {"": history}


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            NGRAM,
            "prompt lookup (copying what followed the last occurrence of the current n-gram)",
            "copied",
            ("ngram_max", "ngram_min"),
            lambda o, vocab, device, state: NgramDrafter(
                vocab, device, o.get("ngram_max", defaults.NGRAM_MAX), o.get("ngram_min", defaults.NGRAM_MIN)
            ),
        ),
        Kind(
            SUFFIX,
            "the suffix trees over the request and earlier requests",
            "remembered",
            ("remember",),
            lambda o, vocab, device, state: SuffixDrafter(vocab, device, state, o.get("sampled", True)),
            _history,
        ),
    )
}


def free_drafting(kind: str, options: dict[str, Any], tokenizer: Any, vocab_size: int, warn=warn_line) -> Free:
    """``kind``'s drafting for a run, its state made now (a history loaded once, not per engine build)."""
    spec = KINDS[kind]
    state = spec.state(options, tokenizer, vocab_size, warn) if spec.state is not None else None
    return Free(kind, dict(options), state)


def make_drafter(
    model_runner: Runner | None,
    free: Free | None,
    vocab_size: int,
    device: torch.device,
    cross: CrossVocab | None = None,
    tokenizer: Any = None,
) -> Drafter | None:
    """The drafter for a run: ``free`` backed by the draft model's runner if there is one (which
    then reads a prompt only when it is first asked to draft: it may never be); the draft model
    alone (``cross``: with its own tokenizer, the verifier's being ``tokenizer``); or None (the
    verifier alone)."""
    model: Drafter | None = None
    if model_runner is not None:
        model = (
            CrossVocabDrafter(model_runner, cross.method, cross.tokenizer, tokenizer, cross.vmap, vocab_size)
            if cross is not None
            else ModelDrafter(model_runner, lazy=free is not None)
        )
    if free is None:
        return model
    primary = KINDS[free.kind].make(free.options, vocab_size, device, free.state)
    return Fallback(primary, model) if model is not None else primary
