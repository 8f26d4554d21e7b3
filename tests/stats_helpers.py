"""Distribution-free bounds for statistical tests, so every test states its false-failure odds."""

from __future__ import annotations

import math

import torch


def l1_bound(num_samples: int, num_categories: int, false_failure_odds: float) -> float:
    """lambda such that P(||p_hat - p||_1 >= lambda) <= false_failure_odds for the empirical
    distribution of ``num_samples`` i.i.d. draws over ``num_categories`` values
    (Bretagnolle-Huber-Carol: P(L1 >= lambda) <= 2^V exp(-N lambda^2 / 2))."""
    return math.sqrt(2.0 * (num_categories * math.log(2.0) + math.log(1.0 / false_failure_odds)) / num_samples)


def empirical(samples: torch.Tensor, num_categories: int) -> torch.Tensor:
    return torch.bincount(samples.flatten(), minlength=num_categories).double() / samples.numel()


def assert_matches(samples: torch.Tensor, exact: torch.Tensor, false_failure_odds: float = 1e-6) -> None:
    """Fail if the samples' histogram is further (L1) from ``exact`` than chance allows at the
    given odds of a false failure."""
    exact = exact.double().flatten()
    exact = exact / exact.sum()
    V = exact.numel()
    l1 = (empirical(samples, V) - exact).abs().sum().item()
    bound = l1_bound(samples.numel(), V, false_failure_odds)
    assert l1 < bound, f"L1 distance {l1:.4f} >= {bound:.4f} (false-failure odds {false_failure_odds:g})"
