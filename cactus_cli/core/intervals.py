"""Intervals for accuracies: a proportion's Wilson interval, and a paired difference's bootstrap
interval over the problems two configurations share (eval's and calibrate's reports)."""

from __future__ import annotations

import math
import random


def paired_difference(
    a: dict[str, float], b: dict[str, float], resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float, int]:
    """Mean over the problems both have of a - b (pass rates per problem), and its 95% interval
    by the percentile bootstrap over problems (seeded: the same data gives the same interval),
    and the number of problems. Pairing removes the problem-to-problem spread that makes each
    accuracy's own interval wide."""
    keys = sorted(set(a) & set(b))
    if not keys:
        return math.nan, math.nan, math.nan, 0
    d = [a[k] - b[k] for k in keys]
    n = len(d)
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return sum(d) / n, means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1], n


def wilson(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for a proportion (sound at 0/n and n/n, unlike p +- z*se)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)
