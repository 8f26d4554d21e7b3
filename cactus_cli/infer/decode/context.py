"""What a run reads of its engine: a small frozen context, made once by the engine and handed to
each request (request.py's ``Request``), so a request never reaches into the engine, its pair or its slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cactus_cli.infer.decode.grammar import Grammars


@dataclass(frozen=True)
class EngineContext:
    """The engine's fixed facts a generation needs (none of them changes when the engine's
    runners are rebuilt: compiling or not, the pair is the same)."""

    eos: frozenset[int]  # the end tokens: a run ends at one (unless it ignores them)
    context_length: int  # positions every model's cache holds (the smallest window of the pair)
    vocab_size: int  # the verifier's vocabulary (a grammar's forced drafts are one-hot rows of it)
    device: torch.device  # the verifier's: where a run's tokens, generator and masks live
    dtype: torch.dtype  # the verifier's (named when its logits overflow)
    grammars: Grammars  # makes a run's grammar constraint (``constraint``)
