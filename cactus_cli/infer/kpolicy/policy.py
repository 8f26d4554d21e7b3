"""The k policy: how many tokens to draft before each step, behind one pair of calls,
``choose(akey, k_max, source)`` and ``observe(...)`` (which teaches the cost store).

- ``FixedK``: always k (``-k 4``); its steps still teach the store what steps cost.
- ``AdaptiveK`` (``-k auto``): the ``k`` in ``0 .. k_max`` with the most expected tokens per
  second under the store's costs and acceptance. ``k = 0`` is plain decoding. While ``k = 0``
  wins, an occasional ``k = 1`` step keeps ``a`` fresh, so the engine notices when the text
  becomes easy to draft (each probe that leaves ``k = 0`` winning doubles the spacing, up to
  MAX_BACKOFF times, so a draft that does not pay costs less and less); while drafting wins,
  an occasional plain step keeps ``t_v(1)``, the yardstick of every choice, fresh, and while
  the drafter offers more than k, an occasional wider step (the next width of the ladder above)
  times a width this run has not timed, paced by what the wider step is expected to lose
  (``explore_up``), so a wide verify that a stale or contended cache overprices is timed and,
  if it pays, taken. The choice depends only on past steps, never on the current step's random
  draws, so SpS stays exactly lossless.
- A drafting step costs more than k t_d when the draft first catches up on the tokens verified
  since it last drafted (a draft model after plain steps; a cross-vocabulary draft also
  re-encodes the text and drafts one token more): ``Overhead`` learns that extra as a line in
  the number of tokens behind, so leaving plain decoding is charged what it costs, and a draft
  that does not pay is not drafted on a lucky estimate.
- A drafter that estimates its own tokens (the suffix trees: ``Drafter.confidence``) is sized
  draft by draft: ``Calibration`` learns how often the rule accepts a token the drafter gave
  probability ``c``, so a likely path is drafted long and an unlikely one not at all, where
  per-position rates would size every draft from memory alike.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from cactus_cli.core.events import MODEL
from cactus_cli.infer.kpolicy.costs import WINDOW, CostModel, Step, best_k, probe_widths, slope, tokens_per_second
from cactus_cli.infer.kpolicy.rates import Calibration, expected_by_k
from cactus_cli.infer.kpolicy.store import CostStore

EXPLORE_BUDGET = 0.03  # while k = 0 wins, spend at most ~3% of the time re-testing k = 1 ...
MAX_BACKOFF = 8  # ... and, as probes keep confirming it, down to 3% / 8 (a probe every 64+ steps) ...
MAX_SPACING = 64  # ... but never fewer than one probe in 8 * 64 steps (a catch-up that grows with the gap)
REFRESH_EVERY = 64  # while drafting wins, one plain step in this many keeps t_v(1) fresh (~1% cost) ...
REFRESH_FIRST = 8  # ... the first after this many when this run has not timed t_v(1) yet
RETIME_EVERY = 16  # widths all timed: a wider step at least this many steps apart (times the back-off)


def acceptance_key(rule: str, rule_kwargs: dict[str, Any], temperature: float, top_k: int, top_p: float) -> str:
    """Acceptance is estimated per (rule, parameters, sampling): each changes it."""
    if temperature == 0:
        return "greedy"
    params = ",".join(f"{k}={v}" for k, v in sorted(rule_kwargs.items()))
    return f"{rule}({params}) T={temperature:g} top_k={top_k} top_p={top_p:g}"


def _cal_key(akey: str, source: str, run: bool) -> str:
    """Calibrations are kept apart inside a run of accepted drafts and outside one: the same
    estimate means more while the text is being copied (after a fully accepted step, measured:
    a first draft token kept 9 times in 10) than after a rejection or a plain step, where a long
    match ends at the next edit or the tree matched prose by chance."""
    return f"{akey} {source} {'run' if run else 'fresh'}"


class Overhead:
    """Seconds a drafting step costs beyond ``k t_d``, as a line ``o + c * behind`` (``behind``:
    tokens verified since the draft last drafted) fitted to the last WINDOW drafting steps
    (least squares, c >= 0); nothing is charged until a few steps were seen."""

    def __init__(self) -> None:
        self.points: deque[tuple[int, float]] = deque(maxlen=WINDOW)

    def add(self, behind: int, seconds: float) -> None:
        if math.isfinite(seconds):
            self.points.append((behind, seconds))

    def predict(self, behind: int) -> float:
        if len(self.points) < 3:
            return 0.0
        n = len(self.points)
        mb = sum(b for b, _ in self.points) / n
        ms = sum(s for _, s in self.points) / n
        c = slope([(b, s, 1) for b, s in self.points])
        return max(ms + c * (behind - mb), 0.0)


@dataclass(frozen=True)
class Want:
    """What one run's next step could draft: up to ``k_max`` tokens from ``source``, accepted at
    ``rates`` per position, a drafting step costing ``overhead`` beyond k t_d; ``fixed``: k_max
    whatever it costs (-k N)."""

    k_max: int
    source: str = MODEL
    rates: list[float] | None = None  # None: nothing known (the prior)
    overhead: float = 0.0
    fixed: bool = False


class KPolicy(Protocol):
    def want(self, akey: str, k_max: int, source: str = MODEL, confidence: list[float] | None = None) -> Want:
        """What the next step could draft (at most ``k_max``) from ``source``, with the drafter's
        own estimate of each token if it has one (Drafter.confidence). Changes nothing."""

    def settle(self, want: Want, k: int) -> int:
        """The k the next step takes, given the ``k`` the whole step's choice gives it (allocate):
        where the policy explores, another."""

    def observe(self, step: Step) -> None:
        """One finished step (see CostStore.observe)."""

    def started(self, behind: int = 0) -> None:
        """A new prompt was prefilled; the draft has ``behind`` of its tokens still to read (0 when
        it prefilled too; the prompt, when it reads it at its first proposal)."""


def choose(policy: KPolicy, costs: CostModel, akey: str, k_max: int, source: str = MODEL, confidence=None) -> int:
    """One run's k, stepping alone."""
    want = policy.want(akey, k_max, source, confidence)
    return policy.settle(want, allocate(costs, [want])[0])


def allocate(costs: CostModel, wants: list[Want], max_width: int | None = None) -> list[int]:
    """Every run's k for one step, for the most expected tokens per second of the whole step:
    sum E_i[tokens | k_i] over sum (k_i t_d(source_i) + overhead_i) + t_v(sum (k_i + 1)), the
    verifier's measured cost of the step's whole width. A fixed k is taken as it is, a source
    never timed drafts 4 (as ``best_k`` does), the others by coordinate ascent from k = 0 (each
    run's best k given the others', until none changes). One run alone: ``best_k``, the choice
    of a run stepping alone exactly. ``max_width``: the most tokens the step may verify in all
    (fixed k are cut to fit, in order). docs/adaptive-k.md says why."""
    if len(wants) == 1:
        w = wants[0]
        return [w.k_max if w.fixed else best_k(costs, w.rates or [], w.k_max, w.source, w.overhead)]
    known = [not w.fixed and costs.knows(w.source) for w in wants]
    ks = [w.k_max if w.fixed else (0 if ok else min(w.k_max, 4)) for w, ok in zip(wants, known)]
    if max_width is not None:  # (one token of each run always fits: the caller bounds the runs)
        room = max_width - len(wants)
        for i, k in enumerate(ks):
            ks[i] = min(k, max(room, 0))
            room -= ks[i]
    free = [i for i, ok in enumerate(known) if ok]
    if not free:
        return ks
    expected = [expected_by_k(w.rates or [], w.k_max) for w in wants]
    td = [costs.t_d(w.source) for w in wants]
    tv: dict[int, float] = {}
    for _ in range(4):
        changed = False
        for i in free:
            others = [j for j in range(len(wants)) if j != i]
            base_e = sum(expected[j][ks[j]] for j in others)
            base_c = sum(ks[j] * td[j] + (wants[j].overhead if ks[j] else 0.0) for j in others)
            base_w = sum(ks[j] + 1 for j in others)
            best, best_rate = 0, -1.0
            top = wants[i].k_max if max_width is None else min(wants[i].k_max, max_width - base_w - 1)
            for k in range(max(top, 0) + 1):
                width = base_w + k + 1
                if width not in tv:
                    tv[width] = costs.t_v(width)
                cost = base_c + k * td[i] + (wants[i].overhead if k else 0.0) + tv[width]
                rate = (base_e + expected[i][k]) / cost if cost > 0 else 0.0
                if rate > best_rate:
                    best, best_rate = k, rate
            changed |= best != ks[i]
            ks[i] = best
        if not changed:
            break
    return ks


class FixedK:
    """``-k N``: N drafts every step (fewer near max_tokens or the context limit). With no store
    (a warm-up run), nothing is learned."""

    def __init__(self, store: CostStore | None = None):
        self.store = store

    def want(self, akey: str, k_max: int, source: str = MODEL, confidence: list[float] | None = None) -> Want:
        return Want(
            k_max, source, self.store.rates(akey, k_max, source) if self.store is not None else None, fixed=True
        )

    def settle(self, want: Want, k: int) -> int:
        return want.k_max

    def choose(self, akey: str, k_max: int, source: str = MODEL, confidence: list[float] | None = None) -> int:
        return k_max

    def observe(self, step: Step) -> None:
        if self.store is not None:
            self.store.observe(step)

    def started(self, behind: int = 0) -> None:
        pass


@dataclass
class Learned:
    """What ``-k auto`` learns about the pair on this machine besides the store's timings and
    acceptance, shared by every request's policy (the engine holds one): what a drafting step costs
    beyond k t_d after the draft fell behind (``overheads``, per drafter: a property of the draft
    and the machine) and how far apart wider widths are timed again (``up_backoff``: whether a wider
    verify pays is the machine's cost curve, not the text's)."""

    overheads: dict[str, Overhead] = field(default_factory=dict)  # source -> a drafting step's cost beyond k t_d
    up_backoff: int = 1  # the spacing's multiplier for re-timing widths: doubled while wider steps do not win


class AdaptiveK(FixedK):
    """``-k auto`` for one request: asked before each step what it could draft and at what rates
    (``want``), told the step's k (``settle``, which explores around it); the store learns what it
    cost. Its own state is the request's: its step counters, the spacing of its k = 1 probes (whether
    drafting pays depends on the text, so a new request probes at the base spacing, not at the last
    request's back-off), whether its text is being copied, how far its draft is behind. What holds
    for the machine is shared: the store (timings, acceptance, calibration, saved across starts) and
    ``learned`` (the engine's ``Learned``, kept while it runs)."""

    def __init__(self, store: CostStore | None = None, learned: Learned | None = None):
        super().__init__(store if store is not None else CostStore())
        self.learned = learned if learned is not None else Learned()
        self.plain_steps = 0  # consecutive k = 0 steps (for the occasional k = 1 probe)
        self.draft_steps = 0  # consecutive k > 0 steps (for the occasional plain step)
        self.backoff = 1  # the probe spacing's multiplier: doubled by each probe after which k = 0 still wins
        self.probed = False  # the last step was a probe
        self.run = False  # the last step drafted and every draft was accepted: the text is being copied
        self.behind = (
            0  # tokens the draft has not read: the prompt's it deferred, plus one per plain step since it drafted
        )
        self.since_up = 0  # drafting steps since the last wider step (explore_up)
        self.up_from: int | None = None  # the k the last step widened (None: it did not)

    @property
    def costs(self) -> CostModel:
        return self.store.costs

    @property
    def overheads(self) -> dict[str, Overhead]:
        return self.learned.overheads

    def started(self, behind: int = 0) -> None:
        self.behind = behind  # (the draft cache's lag at the run's start: what it deferred of the prompt)

    def observe(self, step: Step) -> None:
        super().observe(step)
        run, self.run = self.run, step.k > 1 and step.accepted == step.k
        if step.k == 0:
            self.behind += 1
            return
        if step.timed:  # (a step beside other runs shared its drafting time: not this draft's overhead)
            extra = step.draft_seconds - step.k * self.costs.t_d(step.source)
            self.overheads.setdefault(step.source, Overhead()).add(self.behind, extra)
        self.behind = 0
        if step.confidence is not None:
            key = _cal_key(step.akey, step.source, run)
            self.store.calibrations.setdefault(key, Calibration()).add(step.confidence[: step.k], step.accepted)

    def want(self, akey: str, k_max: int, source: str = MODEL, confidence: list[float] | None = None) -> Want:
        if confidence is not None:  # sized by the drafter's estimates, as calibrated (never past its path)
            k_max = min(k_max, len(confidence))
            rates = self.store.calibrations.get(_cal_key(akey, source, self.run), Calibration()).rates(
                confidence[:k_max]
            )
        else:
            rates = self.store.rates(akey, k_max, source)
        overhead = self.overheads[source].predict(self.behind) if source in self.overheads else 0.0
        return Want(k_max, source, rates, overhead)

    def choose(self, akey: str, k_max: int, source: str = MODEL, confidence: list[float] | None = None) -> int:
        return choose(self, self.costs, akey, k_max, source, confidence)

    def settle(self, want: Want, k: int) -> int:
        k_max, source, overhead = want.k_max, want.source, want.overhead
        if k > 0 or k_max == 0:
            self.plain_steps, self.probed = 0, False
            self.backoff = 1 if k > 0 else self.backoff
            self.draft_steps += 1
            refresh = REFRESH_EVERY if self.costs.fresh(1) else REFRESH_FIRST
            if self.draft_steps >= refresh and self.costs.knows(source):
                self.draft_steps = 0
                return 0
            return self.explore_up(want, k) if k > 0 else k
        self.draft_steps, self.up_from = 0, None
        # k = 0 wins: now and then draft one token anyway, so a stays fresh. A probe step costs
        # about t_d + t_v(2) - t_v(1) extra (more for a draft that first catches up on the text
        # verified since it last drafted); spacing probes by that over EXPLORE_BUDGET * t_v(1)
        # keeps their overhead near EXPLORE_BUDGET of plain decoding, and backing off while
        # probes keep confirming plain decoding brings it toward zero (measured: README).
        if self.probed:
            self.probed, self.backoff = False, min(2 * self.backoff, MAX_BACKOFF)
        self.plain_steps += 1
        t1 = self.costs.t_v(1)
        extra = max(self.costs.t_d(source) + self.costs.t_v(2) - t1 + overhead, 0.0)
        every = min(max(8, math.ceil(extra / (EXPLORE_BUDGET * t1))), MAX_SPACING) if t1 > 0 else 8
        if self.plain_steps >= every * self.backoff:
            self.plain_steps, self.probed = 0, True
            return 1
        return 0

    def explore_up(self, want: Want, k: int) -> int:
        """Drafting wins at ``k`` and the drafter offers more: now and then a wider step instead, so
        the widths the policy avoids are timed too (a cache written beside another busy process
        prices wide verifies at 5-7x; without timing them again, k = 1 would win for good). The
        width tried is the next one of the probe's ladder above k + 1 that this run has not timed;
        such steps are spaced by the share of a step's speed the wider one is expected to lose
        over EXPLORE_BUDGET (a wide step the split cap prices near k's costs nearly nothing: it is
        tried at once). Once every width up to the draft is timed, the next width above is timed
        again at least RETIME_EVERY steps apart, spaced twice as far each time it does not win."""
        if self.up_from is not None:  # the last step was wider: did its timing move the choice up?
            learned = self.learned
            learned.up_backoff = 1 if k > self.up_from else min(2 * learned.up_backoff, MAX_BACKOFF)
            self.up_from = None
        if not self.costs.knows(want.source) or want.k_max <= k:
            return k
        ladder = [w for w in probe_widths(want.k_max) if w > k + 1]
        new = next((w for w in ladder if not self.costs.fresh(w)), None)
        width = new if new is not None else ladder[0]
        rates = want.rates or []
        now = tokens_per_second(self.costs, rates, k, want.source, want.overhead)
        wider = tokens_per_second(self.costs, rates, width - 1, want.source, want.overhead)
        loss = max(1 - wider / now, 0.0) if now > 0 else 1.0
        every = max(1, math.ceil(loss / EXPLORE_BUDGET))
        if new is None:
            every = max(every, RETIME_EVERY) * self.learned.up_backoff
        self.since_up += 1
        if self.since_up < every:
            return k
        self.since_up, self.up_from = 0, k
        return width - 1
