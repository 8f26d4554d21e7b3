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


def exact_two_tokens(pair, ids: list[int], sp) -> dict[tuple[int, int], float]:
    """The verifier's exact joint distribution of the first two tokens after ``ids`` under the
    sampling ``sp``: (t1, t2) -> probability (every SpS exactness test compares against it)."""
    from cactus_cli.core.sampling import probs_from_logits

    model = pair.verifier.model
    with torch.no_grad():
        q1 = probs_from_logits(model(torch.tensor([ids])).logits[0, -1, : pair.vocab_size], sp).double()
        exact = {}
        for t1 in q1.nonzero().flatten().tolist():
            q2 = probs_from_logits(model(torch.tensor([ids + [t1]])).logits[0, -1, : pair.vocab_size], sp).double()
            for t2 in q2.nonzero().flatten().tolist():
                exact[(t1, t2)] = (q1[t1] * q2[t2]).item()
    return exact
