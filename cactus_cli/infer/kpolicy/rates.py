"""How often drafts are accepted: the estimates a k policy (policy.py) multiplies the step costs
(costs.py) by.

- ``Acceptance``: decayed estimates of the acceptance at each draft position, conditional on the
  drafts before it being accepted, one set per (rule, parameters, sampling) and source, since
  each changes them. Per position because acceptance comes in runs: once three drafts are
  accepted the text is easy and the fourth is likelier than the average token (an i.i.d. ``a``
  undervalues long drafts).
- ``Calibration``: for a drafter that estimates its own tokens (the suffix trees), how often a
  token it gave probability ``c`` is accepted, per tenth of ``c``.
- ``expected_tokens``: what a step with k drafts emits on average under either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.97  # per step: the acceptance estimates follow the last ~30 steps
PRIOR_A = 0.6  # an unseen configuration starts at a = 0.6 ...
SHRINK = 2.0  # ... and each position leans on the one before it with the weight of 2 tested drafts
A_MAX = 0.995  # E[tokens] would diverge at a = 1


def _rates(a: float | list[float], k: int) -> list[float]:
    return [a] * k if isinstance(a, (int, float)) else list(a[:k]) + [a[-1] if a else PRIOR_A] * (k - len(a))


def expected_tokens(a: float | list[float], k: int) -> float:
    """Tokens a step emits on average with k drafts: the correction or bonus token plus each draft
    that is reached and accepted, 1 + a_1 + a_1 a_2 + ... + a_1...a_k, with ``a`` one rate for
    every position (the i.i.d. model) or the conditional rate per position."""
    total, reach = 1.0, 1.0
    for r in _rates(a, k):
        reach *= min(max(r, 0.0), A_MAX)
        total += reach
    return total


def expected_by_k(a: float | list[float], k_max: int) -> list[float]:
    """``expected_tokens(a, k)`` for every k in 0..k_max, in one pass (the same sums)."""
    out, total, reach = [1.0], 1.0, 1.0
    for r in _rates(a, k_max):
        reach *= min(max(r, 0.0), A_MAX)
        total += reach
        out.append(total)
    return out


@dataclass
class Acceptance:
    accepted: list[float] = field(default_factory=list)  # [i]: decayed count of drafts accepted at position i
    tested: list[float] = field(default_factory=list)  # [i]: decayed count of drafts the rule tested at i

    def rates(self, k: int) -> list[float]:
        """Conditional acceptance per position 0..k-1, each shrunk toward the position before it."""
        out, prev = [], PRIOR_A
        for i in range(k):
            acc = self.accepted[i] if i < len(self.accepted) else 0.0
            tested = self.tested[i] if i < len(self.tested) else 0.0
            prev = (acc + SHRINK * prev) / (tested + SHRINK)
            out.append(prev)
        return out

    @property
    def a(self) -> float:
        """The pooled per-token rate (accepted over tested), for reports."""
        tested = sum(self.tested)
        return (sum(self.accepted) + SHRINK * PRIOR_A) / (tested + SHRINK)

    def add(self, accepted: int, k: int) -> None:
        """One step: k drafts, the first ``accepted`` kept (the rule tested one more if any was left)."""
        width = max(len(self.tested), k)
        self.accepted = [x * DECAY for x in self.accepted] + [0.0] * (width - len(self.accepted))
        self.tested = [x * DECAY for x in self.tested] + [0.0] * (width - len(self.tested))
        for i in range(accepted):
            self.accepted[i] += 1.0
            self.tested[i] += 1.0
        if accepted < k:
            self.tested[accepted] += 1.0


BINS = 10  # Calibration: acceptance learned per tenth of the drafter's estimate ...
CAL_DECAY = 0.995  # ... over the last ~200 drafting steps (ten bins need more than ~30)


@dataclass
class Calibration:
    """How often the rule accepts a draft token that its drafter gave probability ``c``: decayed
    counts per tenth of ``c``, each shrunk toward ``c`` itself (the drafter's estimate is the
    prior until steps say otherwise)."""

    accepted: list[float] = field(default_factory=lambda: [0.0] * BINS)
    tested: list[float] = field(default_factory=lambda: [0.0] * BINS)

    @staticmethod
    def _bin(c: float) -> int:
        return min(max(int(c * BINS), 0), BINS - 1)

    def rates(self, confidence: list[float]) -> list[float]:
        """The acceptance expected for each token, given the ones before it were accepted."""
        return [
            (self.accepted[b] + SHRINK * c) / (self.tested[b] + SHRINK)
            for c, b in ((c, self._bin(c)) for c in confidence)
        ]

    def add(self, confidence: list[float], accepted: int) -> None:
        """One step that drafted ``confidence``'s tokens, the first ``accepted`` kept."""
        self.accepted = [x * CAL_DECAY for x in self.accepted]
        self.tested = [x * CAL_DECAY for x in self.tested]
        for i, c in enumerate(confidence[: accepted + 1]):
            self.tested[self._bin(c)] += 1.0
            self.accepted[self._bin(c)] += 1.0 if i < accepted else 0.0
