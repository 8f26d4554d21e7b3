"""Drafters, one module each behind one interface (base.py): the draft model (model.py) and
prompt lookup (ngram.py, optionally backed by the draft model). ``make_drafter`` is the one
place that names them, so the engine never does; a new drafter is a new module added here."""

from __future__ import annotations

import torch

from cactus_cli.infer.draft.base import Drafter, Proposal
from cactus_cli.infer.draft.model import ModelDrafter
from cactus_cli.infer.draft.ngram import NgramDrafter
from cactus_cli.infer.runners import Runner

__all__ = ["Drafter", "Proposal", "make_drafter"]


def make_drafter(model_runner: Runner | None, lookup: tuple[int, int] | None, vocab_size: int,
                 device: torch.device) -> Drafter | None:
    """The drafter for a run: prompt lookup with ``lookup`` = (n_max, n_min), backed by the
    draft model's runner if there is one; the draft model alone; or None (the verifier alone)."""
    model = ModelDrafter(model_runner) if model_runner is not None else None
    if lookup is not None:
        return NgramDrafter(vocab_size, device, lookup[0], lookup[1], fallback=model)
    return model
