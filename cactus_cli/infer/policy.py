"""The k policy: how many tokens to draft before each step, behind one pair of calls,
``choose(akey, k_max, source)`` and ``observe(...)`` (which teaches the cost store).

- ``FixedK``: always k (``-k 4``); its steps still teach the store what steps cost.
- ``AdaptiveK`` (``-k auto``): the ``k`` in ``0 .. k_max`` with the most expected tokens per
  second under the store's costs and acceptance. ``k = 0`` is plain decoding. While ``k = 0``
  wins, an occasional ``k = 1`` step keeps ``a`` fresh, so the engine notices when the text
  becomes easy to draft (each probe that leaves ``k = 0`` winning doubles the spacing, up to
  MAX_BACKOFF times, so a draft that does not pay costs less and less); while drafting wins, an occasional plain step keeps ``t_v(1)``, the
  yardstick of every choice, fresh. The choice depends only on past steps, never on the current
  step's random draws, so SpS stays exactly lossless.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from cactus_cli.core.events import MODEL
from cactus_cli.infer.costs import CostModel, CostStore, best_k

EXPLORE_BUDGET = 0.03  # while k = 0 wins, spend at most ~3% of the time re-testing k = 1 ...
MAX_BACKOFF = 8  # ... and, as probes keep confirming it, down to 3% / 8 (a probe every 64+ steps)
REFRESH_EVERY = 64  # while drafting wins, one plain step in this many keeps t_v(1) fresh (~1% cost)


def acceptance_key(rule: str, rule_kwargs: dict[str, Any], temperature: float, top_k: int, top_p: float) -> str:
    """Acceptance is estimated per (rule, parameters, sampling): each changes it."""
    if temperature == 0:
        return "greedy"
    params = ",".join(f"{k}={v}" for k, v in sorted(rule_kwargs.items()))
    return f"{rule}({params}) T={temperature:g} top_k={top_k} top_p={top_p:g}"


class KPolicy(Protocol):
    def choose(self, akey: str, k_max: int, source: str = MODEL) -> int:
        """k for the next step (at most ``k_max``), whose drafts will come from ``source``."""

    def observe(self, akey: str, k: int, accepted: int, draft_seconds: float, verify_seconds: float,
                draft_catch_up: int = 1, source: str = MODEL) -> None:
        """One finished step (see CostStore.observe)."""


class FixedK:
    """``-k N``: N drafts every step (fewer near max_tokens or the context limit). With no store
    (a warm-up run), nothing is learned."""

    def __init__(self, store: CostStore | None = None):
        self.store = store

    def choose(self, akey: str, k_max: int, source: str = MODEL) -> int:
        return k_max

    def observe(self, akey: str, k: int, accepted: int, draft_seconds: float, verify_seconds: float,
                draft_catch_up: int = 1, source: str = MODEL) -> None:
        if self.store is not None:
            self.store.observe(akey, k, accepted, draft_seconds, verify_seconds, draft_catch_up, source)


class AdaptiveK(FixedK):
    """``-k auto``: asked before each step for k; the store is told afterwards what it cost."""

    def __init__(self, store: CostStore | None = None):
        super().__init__(store if store is not None else CostStore())
        self.plain_steps = 0  # consecutive k = 0 steps (for the occasional k = 1 probe)
        self.draft_steps = 0  # consecutive k > 0 steps (for the occasional plain step)
        self.backoff = 1  # the probe spacing's multiplier: doubled by each probe after which k = 0 still wins
        self.probed = False  # the last step was a probe

    @property
    def costs(self) -> CostModel:
        return self.store.costs

    def choose(self, akey: str, k_max: int, source: str = MODEL) -> int:
        k = best_k(self.costs, self.store.rates(akey, k_max, source), k_max, source)
        if k > 0 or k_max == 0:
            self.plain_steps, self.probed = 0, False
            self.backoff = 1 if k > 0 else self.backoff
            self.draft_steps += 1
            if self.draft_steps >= REFRESH_EVERY and self.costs.knows(source):
                self.draft_steps = 0
                return 0
            return k
        self.draft_steps = 0
        # k = 0 wins: now and then draft one token anyway, so a stays fresh. A probe step costs
        # about t_d + t_v(2) - t_v(1) extra (more for a draft that first catches up on the text
        # verified since it last drafted); spacing probes by that over EXPLORE_BUDGET * t_v(1)
        # keeps their overhead near EXPLORE_BUDGET of plain decoding, and backing off while
        # probes keep confirming plain decoding brings it toward zero (measured: README).
        if self.probed:
            self.probed, self.backoff = False, min(2 * self.backoff, MAX_BACKOFF)
        self.plain_steps += 1
        t1 = self.costs.t_v(1)
        extra = max(self.costs.t_d(source) + self.costs.t_v(2) - t1, 0.0)
        every = max(8, math.ceil(extra / (EXPLORE_BUDGET * t1))) if t1 > 0 else 8
        if self.plain_steps >= every * self.backoff:
            self.plain_steps, self.probed = 0, True
            return 1
        return 0
