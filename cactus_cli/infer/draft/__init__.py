"""Drafters, one module each behind one interface (base.py): the draft model (model.py; with its
own tokenizer, cross.py) and the drafters that need no model, each a ``Kind`` in the one registry
``KINDS``: prompt lookup (ngram.py) and the suffix trees over the request and earlier requests
(suffix.py), either optionally backed by the draft model. A new model-free drafter is one module
and one line in KINDS: ``--draft NAME`` and ``NAME+MODEL``, its parameters (``--draft-param``, their checks and help), how its accepted
drafts show, its timings in the cost store and ``make_drafter`` all read the registry
(tests/test_toy_drafter.py adds one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cactus_cli.core import defaults
from cactus_cli.core.acceptance import Param
from cactus_cli.core.errors import warn as warn_line
from cactus_cli.core.fileio import check_output_file
from cactus_cli.infer.draft.base import Drafter, DrafterBase, Fallback, Peek, Proposal, one_hot_proposal, propose_all
from cactus_cli.infer.draft.cross import CrossVocabDrafter
from cactus_cli.infer.draft.model import ModelDrafter
from cactus_cli.infer.draft.ngram import NGRAM, NgramDrafter
from cactus_cli.infer.draft.suffix import SUFFIX, SuffixDrafter
from cactus_cli.infer.draft.suffix_tree import History
from cactus_cli.infer.load.vocab import CrossVocab, tokenizer_fingerprint
from cactus_cli.infer.runner import Runner

__all__ = [
    "KINDS",
    "Drafter",
    "DrafterBase",
    "Fallback",
    "Free",
    "History",
    "Kind",
    "param_specs",
    "Peek",
    "Proposal",
    "free_drafting",
    "make_drafter",
    "one_hot_proposal",
    "propose_all",
]


@dataclass(frozen=True)
class Free:
    """Drafting that needs no model, as a run asks for it: the kind's name, its parameters
    (``Kind.params``, resolved), and what it keeps across sequences (the suffix trees'
    remembered history), made once per engine."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    state: Any = field(default=None, compare=False)


@dataclass(frozen=True, kw_only=True)
class Kind:
    """A model-free drafter: ``--draft NAME`` (or ``NAME+MODEL``, the model drafting when it has
    nothing), the source its drafts are timed and counted under, and its own parameters (as a
    rule's: ``--draft-param NAME=VALUE``, a profile's ``draft_params`` or ``NAME:`` at its top;
    given to any other draft, an error)."""

    name: str
    summary: str  # for --help and messages: "prompt lookup (...)"
    label: str  # how its accepted drafts show (ui.STYLES): "copied", "remembered"
    make: Callable[[dict[str, Any], int, torch.device, Any], Drafter]  # (params, vocab, device, state)
    params: tuple[Param, ...] = ()
    check: Callable[[dict[str, Any]], str | None] | None = None  # a problem across its parameters, or None
    state: Callable[[dict[str, Any], Any, int, Callable[[str], None]], Any] | None = None  # (params, tok, V, warn)
    vllm: dict[str, Any] | None = None  # vLLM's proposer of the same idea (its speculative_config); None: none

    def resolve(self, given: dict[str, Any]) -> dict[str, Any]:
        """Its parameters from ``given`` (others' ignored), defaults filled, each checked."""
        out = {p.name: given.get(p.name, p.default) for p in self.params}
        for p in self.params:
            if not (out[p.name] is None and p.default is None) and not p.valid(out[p.name]):
                raise ValueError(f"{p.name} must be {p.valid_range}, got {out[p.name]!r}")
        if self.check is not None and (problem := self.check(out)):
            raise ValueError(problem)
        return out


def param_specs() -> dict[str, Param]:
    """Every drafter parameter by name, read from KINDS each time (a drafter registered later brings
    its own)."""
    return {p.name: p for kind in KINDS.values() for p in kind.params}


def _int_in(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _ngram_order(p: dict[str, Any]) -> str | None:
    return (
        f"ngram_min ({p['ngram_min']}) must not exceed ngram_max ({p['ngram_max']})"
        if p["ngram_min"] > p["ngram_max"]
        else None
    )


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
            name=NGRAM,
            summary="prompt lookup (copying what followed the last occurrence of the current n-gram)",
            label="copied",
            make=lambda o, vocab, device, state: NgramDrafter(vocab, device, o["ngram_max"], o["ngram_min"]),
            params=(
                Param(
                    "ngram_max",
                    defaults.NGRAM_MAX,
                    _int_in(1, 16),
                    "an integer in 1..16",
                    int,
                ),
                Param("ngram_min", defaults.NGRAM_MIN, _int_in(1, 16), "an integer in 1..16", int),
            ),
            check=_ngram_order,
            vllm={"method": "ngram", "prompt_lookup_max": defaults.NGRAM_MAX},
        ),
        Kind(
            name=SUFFIX,
            summary="the suffix trees over the request and earlier requests",
            label="remembered",
            make=lambda o, vocab, device, state: SuffixDrafter(vocab, device, state, o.get("sampled", True)),
            params=(
                Param(
                    "remember",
                    None,
                    lambda v: isinstance(v, str) and bool(v.strip()),
                    "a file path",
                    str,
                ),
            ),
            state=_history,  # (vLLM's suffix decoding needs arctic-inference: not run by --backend vllm)
        ),
    )
}


def free_drafting(kind: str, params: dict[str, Any], tokenizer: Any, vocab_size: int, warn=warn_line) -> Free:
    """``kind``'s drafting for a run with its parameters (``params``: the kind's own are taken,
    defaults filled), its state made now (a history loaded once, not per engine build)."""
    spec = KINDS[kind]
    options = {**params, **spec.resolve(params)}
    state = spec.state(options, tokenizer, vocab_size, warn) if spec.state is not None else None
    return Free(kind, options, state)


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
    spec = KINDS[free.kind]
    primary = spec.make({**free.options, **spec.resolve(free.options)}, vocab_size, device, free.state)
    return Fallback(primary, model) if model is not None else primary
