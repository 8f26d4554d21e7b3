"""What a step costs on this machine and how often drafts are accepted: the facts a k policy
(policy.py) chooses from.

Speculation pays only when ``E[tokens | k, a] / (k t_d + t_v(k + 1))`` beats plain decoding's
``1 / t_v(1)``. Both costs are properties of the machine, not of the pair: a verify over 5 tokens
costs about what 1 token costs on a GPU or an AVX-512 BF16 CPU, and 4.5x more on an AVX2 CPU.

- ``CostModel``: the draft's seconds per drafted token ``t_d`` and the verifier's seconds per
  forward of width ``w``, ``t_v(w)``: medians over the last few timings per width (robust to a
  stray slow step), made non-decreasing in width. Seeded by a short probe (``probe``) when
  nothing is known. Timings read from the cache are marked as such: this run's first timing of
  a width replaces them, and a width this run has not timed is priced at no more than splitting
  its verify into verifies this run did time (``cap``), so a cache written while another process
  loaded the machine cannot price wide verifies out of reach for good.
- how often drafts are accepted: rates.py (``Acceptance`` per position, ``Calibration`` per
  drafter estimate); ``Step``: one finished step, as the policy and the store learn from it.
- the costs and the acceptance estimates, loaded from and saved to ``$CACTUS_HOME/costs`` per
  (pair, device, dtype, threads, torch), so the next run starts informed: store.py.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from cactus_cli.core.events import MODEL
from cactus_cli.infer.kpolicy.rates import expected_by_k, expected_tokens

WINDOW = 15  # timings kept per width (median of these)


@dataclass
class CostModel:
    draft: dict[str, deque] = field(default_factory=dict)  # source -> seconds per drafted token
    verify: dict[int, deque] = field(default_factory=dict)  # width -> seconds per forward
    source: str = "none"  # "none", "probe", "cache", plus "+online" once the run has added timings
    cached: set[int] = field(default_factory=set)  # widths whose timings all come from the cache
    cached_draft: set[str] = field(default_factory=set)  # draft sources likewise
    kinds: tuple[str, ...] = ()  # the model-free drafters' names (draft.KINDS), handed in by whoever reads a cache
    _curve: tuple[list[int], list[float], float, list[float]] | None = field(
        default=None, repr=False
    )  # the fit, until a timing arrives

    def add_draft(self, seconds_per_token: float, source: str = MODEL) -> None:
        if seconds_per_token > 0 and math.isfinite(seconds_per_token):
            if source in self.cached_draft:  # this run's first timing replaces the cached ones
                self.cached_draft.discard(source)
                self.draft.pop(source, None)
            self.draft.setdefault(source, deque(maxlen=WINDOW)).append(seconds_per_token)

    def add_verify(self, width: int, seconds: float) -> None:
        if seconds > 0 and math.isfinite(seconds):
            if width in self.cached:  # this run's first timing of the width replaces the cached ones
                self.cached.discard(width)
                self.verify.pop(width, None)
            self.verify.setdefault(width, deque(maxlen=WINDOW)).append(seconds)
            self._curve = None

    def fresh(self, width: int) -> bool:
        """Whether this run has timed a verify of ``width`` tokens (the probe included)."""
        return width in self.verify and width not in self.cached

    def forget(self) -> None:
        """Drop every timing (a probe measures them all again)."""
        self.verify.clear()
        self.draft.clear()
        self.cached.clear()
        self.cached_draft.clear()
        self._curve = None

    def knows(self, source: str) -> bool:
        """Enough to choose k for drafts from ``source`` (a lookup needs only the verifier's costs)."""
        return bool(self.verify) and (source != MODEL or bool(self.draft.get(MODEL)))

    def t_d(self, source: str = MODEL) -> float:
        """Seconds per drafted token; a lookup never timed yet counts as free (it costs microseconds)."""
        values = self.draft.get(source)
        return statistics.median(values) if values else 0.0

    def t_v(self, width: int) -> float:
        """Seconds of a verifier forward over ``width`` tokens: the measured cost of each width,
        made non-decreasing in width (isotonic, weighted by how many timings each has: noise
        such as t_v(2) < t_v(1) is pooled away, not believed) except where a wider step is
        credibly cheaper (more than DROP cheaper, each side timed at least DROP_TIMINGS times:
        where the kernels change, e.g. llama.cpp's 16-token verify measured 10% under its
        12-token one, and Q4_0's 4-token one 17% under its 3-token one), linear between measured widths,
        and past the widest one extended with the slope of a line fitted to them all. Measured
        values are used as they are because cost is not linear in width everywhere: on an AVX2
        CPU a 9-token verify costs far more than 9/5 of a 5-token one, and a line through all
        widths there halves t_v(1), which makes every draft look like a loss."""
        curve = self._fit()
        if curve is None:
            return 0.0
        widths, costs, slope, cap = curve
        if width <= widths[0]:
            fit = costs[0]
        elif width >= widths[-1]:
            fit = costs[-1] + slope * (width - widths[-1])
        else:
            i = bisect.bisect_right(widths, width)  # widths[i - 1] < width < widths[i] (or equal to the former)
            w0, w1, c0, c1 = widths[i - 1], widths[i], costs[i - 1], costs[i]
            fit = c0 + (c1 - c0) * (width - w0) / (w1 - w0)
        if self.fresh(width) or width >= len(cap):
            return fit
        return min(fit, cap[width])

    def _fit(self) -> tuple[list[int], list[float], float, list[float]] | None:
        """Fitted once per new timing: each step asks t_v for every candidate k."""
        if self._curve is None and self.verify:
            self._curve = self._fit_curve()
        return self._curve

    def cap(self, medians: dict[int, float] | None = None) -> list[float]:
        """``[w]``: the least a verify of ``w`` tokens can cost when split into verifies of widths
        this run timed (the sum of their medians; inf where no split reaches it). No width this
        run has not timed is priced above it: a cache written beside another busy process (wide
        verifies at 5-7x) or a slope extrapolated from a few widths cannot make a wide verify
        look dearer than two narrower ones, so the policy tries it and times it. ``medians``: each
        width's median timing, where the caller has them already."""
        if medians is None:
            medians = {w: statistics.median(v) for w, v in self.verify.items() if v}
        base = {w: t for w, t in medians.items() if w not in self.cached}
        cap = [math.inf] * (CAP_WIDTH + 1)
        parts = sorted(base.items())
        for w in range(1, CAP_WIDTH + 1):  # (fewest-cost sum of timed widths: an unbounded knapsack)
            best = base.get(w, math.inf)
            for a, t in parts:
                if a >= w:
                    break
                rest = cap[w - a]
                if t + rest < best:
                    best = t + rest
            cap[w] = best
        return cap

    def _fit_curve(self) -> tuple[list[int], list[float], float, list[float]] | None:
        medians = {w: statistics.median(v) for w, v in self.verify.items() if v}
        if not medians:
            return None
        cap = self.cap(medians)
        # a cached width is believed at most at its split and at what this run timed for a wider
        # one, and counts as one timing: a contended cache must not pool this run's own timings up
        ceiling, pts = math.inf, []
        for w in sorted(medians, reverse=True):
            if w in self.cached:
                pts.append((w, min(medians[w], ceiling, cap[w] if w < len(cap) else math.inf), 1))
            else:
                pts.append((w, medians[w], len(self.verify[w])))
                ceiling = min(ceiling, medians[w])
        pts.reverse()
        # pool adjacent violators: blocks of (weighted mean, weight, widths)
        blocks: list[list[float]] = []
        for w, t, c in pts:
            blocks.append([t, c, 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0] and not _credible_drop(blocks[-2], blocks[-1]):
                t2, c2, n2 = blocks.pop()
                t1, c1, n1 = blocks[-1]
                blocks[-1] = [(t1 * c1 + t2 * c2) / (c1 + c2), c1 + c2, n1 + n2]
        costs = [max(t, 1e-9) for t, _, n in blocks for _ in range(int(n))]
        return [w for w, _, _ in pts], costs, slope(pts), cap

    def describe(self, widths: int) -> dict[str, Any]:
        return {
            "source": self.source,
            "draft_seconds_per_token": self.t_d() if self.draft.get(MODEL) else None,
            **{f"{name}_seconds_per_token": self.t_d(name) if self.draft.get(name) else None for name in self.kinds},
            "verify_seconds_by_width": {str(w): self.t_v(w) for w in range(1, widths + 1)} if self.verify else {},
            "measured_widths": sorted(self.verify),
            "cached_widths": sorted(self.cached),  # (not timed by this run yet: its first timing replaces them)
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "draft": {src: list(v) for src, v in self.draft.items()},
            "verify": {str(w): list(v) for w, v in self.verify.items() if w <= MAX_STEP_WIDTH},  # (what loads)
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any], source: str, kinds: tuple[str, ...] = ()) -> tuple[CostModel, int]:
        """The model a cache file holds, and how many entries were dropped as invalid (a width
        outside 1..MAX_STEP_WIDTH, a time that is not a positive number of seconds below an hour,
        a draft source that is neither the draft model nor one of ``kinds``)."""
        cm, dropped = cls(source=source, kinds=kinds), 0
        for src, values in doc.get("draft", {}).items():
            for s in values:
                if (src == MODEL or src in kinds) and _valid_seconds(s):
                    cm.add_draft(float(s), src)
                else:
                    dropped += 1
        for w, values in doc.get("verify", {}).items():
            width = int(w) if str(w).isdigit() else -1
            # only the newest few per width; they are marked cached (below), and this run's first
            # timing of the width replaces them; a width this run never times is priced at most
            # at its split (cap), so the policy tries it; store.py's Watch holds this run's
            # timings against them and, beaten persistently, has the next start probe again
            for s in values[-CACHED_PER_WIDTH:] if isinstance(values, list) else [None]:
                if 1 <= width <= MAX_STEP_WIDTH and _valid_seconds(s):
                    cm.add_verify(width, float(s))
                else:
                    dropped += 1
        cm.cached, cm.cached_draft = set(cm.verify), set(cm.draft)
        return cm, dropped


DROP = 0.07  # a wider verify this much cheaper than a narrower one is believed (a kernel change) ...
DROP_TIMINGS = 3  # ... when both are timed at least this often (the probe times each width this often)


def _credible_drop(before: list[float], after: list[float]) -> bool:
    """Blocks (cost, timings, widths): ``after`` is cheaper than ``before`` by more than noise."""
    return min(before[1], after[1]) >= DROP_TIMINGS and after[0] < (1 - DROP) * before[0]


def slope(pts: list[tuple[int, float, int]]) -> float:
    """The weighted least-squares slope (>= 0) of (x, y, weight) points: the verify cost past the
    widest measured width; a drafting step's extra cost per token behind (policy.Overhead)."""
    n = sum(c for _, _, c in pts)
    mw = sum(c * w for w, _, c in pts) / n
    mt = sum(c * t for _, t, c in pts) / n
    var = sum(c * (w - mw) ** 2 for w, _, c in pts)
    return max(sum(c * (w - mw) * (t - mt) for w, t, c in pts) / var, 0.0) if var > 0 else 0.0


MAX_WIDTH = 65  # k_max (64) + 1
MAX_STEP_WIDTH = 16 * MAX_WIDTH  # a batched step's verify: up to 16 requests (serve --parallel) of MAX_WIDTH
CAP_WIDTH = 2 * MAX_WIDTH  # the widest step cap() prices (a step of several requests: up to 128 tokens)
CACHED_PER_WIDTH = 5  # of a width's WINDOW timings, the newest this many are taken from the cache
MAX_SECONDS = 3600.0  # no forward takes an hour: a larger timing is corrupt


def _valid_seconds(s: Any) -> bool:
    return isinstance(s, (int, float)) and not isinstance(s, bool) and 0 < s < MAX_SECONDS


def tokens_per_second(
    costs: CostModel, a: float | list[float], k: int, source: str = MODEL, overhead: float = 0.0
) -> float:
    """Expected tokens per second of a step with k drafts; ``overhead``: seconds a drafting
    step costs beyond k t_d (the draft catching up after plain steps: policy.Overhead)."""
    step = k * costs.t_d(source) + costs.t_v(k + 1) + (overhead if k > 0 else 0.0)
    return expected_tokens(a, k) / step if step > 0 else 0.0


def best_k(costs: CostModel, a: float | list[float], k_max: int, source: str = MODEL, overhead: float = 0.0) -> int:
    """The k in 0..k_max with the most expected tokens per second (ties: the smaller k)."""
    if not costs.knows(source):
        return min(k_max, 4)
    td = costs.t_d(source)
    expected = expected_by_k(a, k_max)
    best, best_rate = 0, -1.0
    for k in range(k_max + 1):  # (tokens_per_second's arithmetic, with E[tokens] built once for every k)
        step = k * td + costs.t_v(k + 1) + (overhead if k > 0 else 0.0)
        rate = expected[k] / step if step > 0 else 0.0
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass(frozen=True)
class Step:
    """One finished verification step, as the k policy and the cost store learn from it."""

    akey: str  # the acceptance key: rule, its parameters, sampling (policy.acceptance_key)
    k: int  # drafts verified (0: a plain step)
    accepted: int  # of them, kept
    draft_seconds: float
    verify_seconds: float
    fed: int = 1  # tokens the draft model's first forward read (more after plain steps: a catch-up)
    source: str = MODEL  # where the drafts came from
    confidence: list[float] | None = None  # the drafter's own estimate of each draft (the suffix trees)
    timed: bool = True  # its timings are its own (False: it stepped beside other runs, which shared them)


def probe_widths(k_max: int) -> list[int]:
    """The verify widths a probe times for drafts of up to ``k_max`` tokens: every width to 17
    (costs step where kernels change: llama.cpp's 8-16 cost what 8 does) and a few past it, to
    ``k_max + 1``, so a long draft's cost is measured, not extrapolated (llama.cpp on a CPU: 64
    drafts cost 9x one token, not the 17x a line through the first 17 widths says)."""
    wide = [w for w in (24, 32, 48) if w < k_max + 1]
    return sorted(set(range(1, min(k_max + 1, 17) + 1)) | set(wide) | {k_max + 1})


def probe(
    costs: CostModel,
    verify_forward: Callable[[int], None],
    draft_forward: Callable[[], None] | None,
    widths: list[int],
    sync: Callable[[], None],
    repeats: int = DROP_TIMINGS,
) -> None:
    """Seed the cost model: time verifier forwards at ``widths`` and one-token draft forwards,
    after one untimed warm-up of each. The callables run a forward and restore the caches.
    Every earlier timing is dropped first: a probe measures the machine again."""
    costs.forget()
    verify_forward(1)
    if draft_forward is not None:
        draft_forward()
    sync()
    for _ in range(repeats):
        for w in widths:
            t0 = time.perf_counter()
            verify_forward(w)
            sync()
            costs.add_verify(w, time.perf_counter() - t0)
        if draft_forward is not None:
            t0 = time.perf_counter()
            draft_forward()
            sync()
            costs.add_draft(time.perf_counter() - t0)
    costs.source = "probe"
