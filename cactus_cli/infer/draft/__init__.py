"""Drafters, one module each behind one interface (base.py): the draft model (model.py; with its
own tokenizer, cross.py), prompt lookup (ngram.py) and the suffix trees over the request and
earlier requests (suffix.py), the last two optionally backed by the draft model. ``make_drafter`` is the one place that names
them, so the engine never does; a new drafter is a new module added here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cactus_cli.core import defaults
from cactus_cli.core.events import NGRAM, SUFFIX
from cactus_cli.infer.draft.base import Drafter, Fallback, Proposal
from cactus_cli.infer.draft.cross import CrossVocabDrafter
from cactus_cli.infer.draft.model import ModelDrafter
from cactus_cli.infer.draft.ngram import NgramDrafter
from cactus_cli.infer.draft.suffix import SuffixDrafter
from cactus_cli.infer.draft.suffix_tree import History
from cactus_cli.infer.runners.base import Runner
from cactus_cli.infer.vocab import CrossVocab

__all__ = ["Drafter", "Fallback", "History", "Lookup", "Proposal", "make_drafter"]


@dataclass(frozen=True)
class Lookup:
    """Drafting that needs no model: prompt lookup (NGRAM) or the suffix trees (SUFFIX)."""

    kind: str = NGRAM
    n_max: int = defaults.NGRAM_MAX  # prompt lookup: the longest n-gram matched ...
    n_min: int = defaults.NGRAM_MIN  # ... and the shortest
    history: History | None = field(default=None, compare=False)  # suffix: the remembered history (--remember)
    sampled: bool = True  # suffix, T > 0: drafts drawn from the tree's counts (False: its most frequent path)


def make_drafter(
    model_runner: Runner | None,
    lookup: Lookup | None,
    vocab_size: int,
    device: torch.device,
    cross: CrossVocab | None = None,
    tokenizer: Any = None,
) -> Drafter | None:
    """The drafter for a run: ``lookup`` backed by the draft model's runner if there is one (which
    then reads a prompt only when it is first asked to draft: it may never be); the draft model alone (``cross``: with its own tokenizer, the verifier's being
    ``tokenizer``); or None (the verifier alone)."""
    model: Drafter | None = None
    if model_runner is not None:
        model = (
            CrossVocabDrafter(model_runner, cross.method, cross.tokenizer, tokenizer, cross.vmap, vocab_size)
            if cross is not None
            else ModelDrafter(model_runner, lazy=lookup is not None)
        )
    if lookup is None:
        return model
    primary: Drafter = (
        SuffixDrafter(vocab_size, device, lookup.history, sampled=lookup.sampled)
        if lookup.kind == SUFFIX
        else NgramDrafter(vocab_size, device, lookup.n_max, lookup.n_min)
    )
    return Fallback(primary, model) if model is not None else primary
