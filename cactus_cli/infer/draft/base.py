"""The drafter interface: say where the next drafts would come from, propose up to k tokens (with
their probabilities) continuing the verified sequence, then be told how many were accepted.
Drafters keep no copy of the sequence: the engine hands them its own (``seq``, read-only), so they
can never drift out of step with it.

Eight members, what the engine needs and no more: ``peek`` (where the next proposal's drafts come
from and the drafter's own estimate of them, or None: nothing to draft, a plain step),
``propose``, ``accept``, ``start`` / ``finish`` of a sequence, ``route`` (which drafter will
propose: a Fallback's lookup or its model), ``runner``, the draft model's runner if any (the
engine reads forward counts and the device from it, sizes and compiles it with the verifier's,
and resets it when a step fails half-way; a drafter rebuilds everything else at ``start``), and
``reads_prompt``: whether ``start`` feeds that runner the whole prompt, in the verifier's tokens
(then a prompt read in chunks beside running streams is fed to it chunk by chunk too).
``DrafterBase`` gives the defaults a drafter without a model and without memory needs;
``Fallback`` composes a model-free drafter with a draft model, once, for every such drafter.

One drafter serves one sequence (an engine slot); ``propose_all`` drafts for several at once,
each drafter type doing it its own way (``propose_many``: the draft model steps every sequence's
row in one model call per draft position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cactus_cli.core.events import MODEL
from cactus_cli.core.sampling import SamplingParams, biased, probs_from_logits, sample
from cactus_cli.infer.runner import Runner, to_device


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k'] int64, on the drafter's device; k' <= k (a lookup may offer fewer)
    probs: torch.Tensor | None  # [k', V] float32 draft probabilities; None when greedy
    source: str = MODEL  # MODEL, or the kind of a model-free drafter (draft/__init__.KINDS)
    fed: int = 0  # tokens the first draft forward caught up on (1, 2 after a full acceptance, more after k = 0 steps)


@dataclass(frozen=True)
class Peek:
    """What the next proposal would be: where its drafts come from, and the drafter's own
    estimate of each next token's probability given the ones before it (the suffix trees'
    counts, for -k auto to size the draft by), or None when it has none."""

    source: str
    confidence: list[float] | None = None


class Drafter(Protocol):
    runner: Runner | None  # the draft model's runner, or None: drafting costs (next to) nothing
    reads_prompt: bool  # start() feeds ``runner`` the prompt (same tokens as the verifier's)

    def peek(self, seq: list[int]) -> Peek | None:
        """Where the next proposal's drafts would come from, or None when there is nothing to
        offer (a lookup with no match): then the step is a plain one."""

    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        """Draft up to k tokens continuing ``seq``."""

    def accept(self, seq: list[int], num_accepted: int) -> None:
        """The verifier kept ``num_accepted`` of the last proposal; ``seq`` has grown by those
        and the correction or bonus token."""

    def start(self, prompt: list[int], previous: list[int], reuse: bool = False, memory: str | None = "") -> None:
        """Begin a sequence at ``prompt``; with ``reuse``, keep what is cached of the prefix it
        shares with ``previous`` (the last sequence). ``memory`` names the history a drafter
        with memory reads and extends (bench keeps one per configuration; None: none, as in a
        warm-up)."""

    def finish(self, seq: list[int]) -> None:
        """The sequence is done (finished, stopped or abandoned) at ``seq``, what was output: a
        drafter with memory learns it."""

    def route(self, seq: list[int]) -> "Drafter":
        """The drafter that will propose the next draft for ``seq`` (itself, or what it composes)."""


Item = tuple[
    "Drafter", list[int], int, SamplingParams, "torch.Generator | None"
]  # (drafter, seq, k, sampling, generator)


def draw(
    logits: torch.Tensor, sp: SamplingParams, generator: torch.Generator | None, rows: list, greedy: bool = False
) -> torch.Tensor:
    """A model's next draft token from its logits ``[V]``: the most likely when sampling is greedy
    (or ``greedy``), else one drawn from its distribution, which is kept in ``rows`` (the draft's
    ``p`` that the rule reads). Returns ``[1]``."""
    if greedy or sp.greedy:
        return biased(logits, sp).argmax(-1, keepdim=True)
    p = probs_from_logits(logits, sp)  # [V]
    rows.append(p)
    return sample(p.unsqueeze(0), generator)


def propose_all(items: list[Item]) -> list[Proposal]:
    """A proposal for each (drafter, seq, k, sampling, generator), drafted together where the
    drafters can: each routed drafter's type drafts its group at once (``propose_many``)."""
    routed = [(d.route(seq), seq, k, sp, gen) for d, seq, k, sp, gen in items]
    out: list[Proposal | None] = [None] * len(items)
    groups: dict[type, list[int]] = {}
    for i, (d, *_rest) in enumerate(routed):
        groups.setdefault(type(d), []).append(i)
    for kind, idx in groups.items():
        for i, proposal in zip(idx, kind.propose_many([routed[i] for i in idx])):
            out[i] = proposal
    return out


class DrafterBase:
    """Defaults: no model, nothing to keep between steps or sequences."""

    runner: Runner | None = None
    reads_prompt = False

    def route(self, seq: list[int]) -> Drafter:
        return self

    @staticmethod
    def propose_many(items: list[Item]) -> list[Proposal]:
        """Each item's proposal, one by one (a drafter that can draft several at once overrides it)."""
        return [d.propose(seq, k, sp, gen) for d, seq, k, sp, gen in items]

    def peek(self, seq: list[int]) -> Peek | None:
        raise NotImplementedError

    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        raise NotImplementedError

    def accept(self, seq: list[int], num_accepted: int) -> None:
        pass

    def start(self, prompt: list[int], previous: list[int], reuse: bool = False, memory: str | None = "") -> None:
        pass

    def finish(self, seq: list[int]) -> None:
        pass


def one_hot_proposal(tokens: list[int], vocab_size: int, device: torch.device, sp: SamplingParams, source: str):
    """A proposal of ``tokens`` drawn with certainty (prompt lookup, a most-frequent path, a
    re-tokenized draft): one-hot rows, so every rule applies unchanged and SpS stays lossless."""
    ids = to_device(tokens, device)  # [k']
    probs = None
    if not sp.greedy and tokens:  # [k', V]
        probs = torch.zeros(len(tokens), vocab_size, device=device).scatter_(1, ids.view(-1, 1), 1.0)
    return Proposal(ids, probs, source)


class Fallback(DrafterBase):
    """A model-free drafter (prompt lookup, the suffix trees) with a draft model behind it: the
    first drafts whenever it has something, the model when it has nothing. The model's cache
    stays in step either way: whatever it sat out is fed by its next proposal (a model behind a
    lookup reads even the prompt only then: it may never be asked)."""

    def __init__(self, primary: Drafter, model: Drafter):
        self.primary, self.model = primary, model
        self.runner = model.runner

    def _drafting(self, seq: list[int]) -> tuple[Drafter, Peek | None]:
        peek = self.primary.peek(seq)
        return (self.primary, peek) if peek is not None else (self.model, self.model.peek(seq))

    def peek(self, seq: list[int]) -> Peek | None:
        return self._drafting(seq)[1]

    def route(self, seq: list[int]) -> Drafter:
        return self._drafting(seq)[0].route(seq)

    def start(self, prompt: list[int], previous: list[int], reuse: bool = False, memory: str | None = "") -> None:
        self.primary.start(prompt, previous, reuse, memory)
        self.model.start(prompt, previous, reuse, memory)

    def propose(self, seq: list[int], k: int, sp: SamplingParams, generator: torch.Generator | None) -> Proposal:
        return self._drafting(seq)[0].propose(seq, k, sp, generator)

    def accept(self, seq: list[int], num_accepted: int) -> None:
        self.primary.accept(seq, num_accepted)
        self.model.accept(seq, num_accepted)  # (nothing to crop when it sat the step out)

    def finish(self, seq: list[int]) -> None:
        self.primary.finish(seq)
        self.model.finish(seq)
