"""The exact distribution a verification position emits under each rule, and its divergence
from the verifier: what the divergence meter reports per token (bench --meter, calibrate) and
what the statistical tests compare sampled frequencies against (docs/algorithm.md section 2)."""

from __future__ import annotations

from typing import Any

import torch

from cactus_cli.core.acceptance import RULES, TargetRule, resolve_params


def emitted_distribution(rule: str, p: torch.Tensor, q: torch.Tensor, **params: Any) -> torch.Tensor:
    """The exact distribution of the token one verification position emits, when the drafted token
    is drawn from ``p`` and the rule then accepts it or replaces it: ``p``, ``q`` are [V] or [..., V]
    (q is the verifier row of that position). Computed in float64 by the rule itself
    (``Rule.emitted``):

        h_alg(x) = sum_n p_n [a_n 1{x = n} + (1 - a_n) r^(n)(x)]"""
    prm = resolve_params(rule, params)
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    shape = p.shape
    P = p.double().reshape(-1, shape[-1])  # [N, V]
    Q = q.double().reshape(-1, shape[-1])
    return RULES[rule].emitted(prm, P, Q).reshape(shape)


def divergences(h: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(h || q), TV(h, q)) over the last dim, float64; KL is inf where h has mass q lacks."""
    h, q = h.double(), q.double()
    kl = torch.where(h > 0, h * (torch.log(h) - torch.log(q)), torch.zeros_like(h)).sum(-1)
    return kl.clamp(min=0.0), 0.5 * (h - q).abs().sum(-1)  # KL >= 0; rounding can dip below


def meter(
    rule: str,
    rule_kwargs: dict[str, Any],
    p: torch.Tensor | None,
    q: torch.Tensor | None,
    logits: torch.Tensor,
    new: list[int],
    m: int,
    k: int,
    drafts: list[int] | None = None,
) -> tuple[tuple[float, ...], ...]:
    """The divergence meter for one step (``p`` [1, k, V], ``q`` [1, k+1, V], None when greedy;
    ``new``: the step's tokens, the first ``m`` accepted drafts; ``drafts``: the k drafted). Per
    emitted position decided by the rule: KL(h_alg || q) and TV(h_alg, q) of the exact emitted
    distribution (the bonus position is q itself; greedy is exact), and the verifier's
    log-likelihood (temperature 1, unfiltered) of every token emitted; per drafted position decided,
    KL(h^(n) || q) of the target the draft was verified against (rules with a target)."""
    rows = min(m + 1, k)
    budget: tuple[float, ...] = ()
    if p is None or rows == 0:
        kl = tv = (0.0,) * rows
    else:
        # h_alg lives on supp(p) | supp(q): after top-k / top-p that is a few dozen tokens, so
        # compute it there (exactly) instead of over the whole vocabulary
        pr, qr = p[0, :rows], q[0, :rows]  # [rows, V]
        support = ((pr > 0) | (qr > 0)).any(0).nonzero().squeeze(-1)  # [U]
        pr, qr = pr[:, support], qr[:, support]
        h = emitted_distribution(rule, pr, qr, **rule_kwargs)
        kl_t, tv_t = divergences(h, qr)
        kl, tv = tuple(kl_t.tolist()), tuple(tv_t.tolist())
        if drafts is not None and isinstance(RULES[rule], TargetRule):
            budget = draft_budget(rule, rule_kwargs, pr, qr, support, drafts[:rows])
    logp = torch.log_softmax(logits[: m + 1].float(), -1)  # [m+1, V]
    ll = logp.gather(-1, torch.tensor(new, device=logp.device).view(-1, 1)).squeeze(-1)
    return kl, tv, tuple(ll.tolist()), budget


def draft_budget(
    rule: str, rule_kwargs: dict[str, Any], p: torch.Tensor, q: torch.Tensor, support: torch.Tensor, drafts: list[int]
) -> tuple[float, ...]:
    """KL(h^(n) || q) per row for the drafted token n of that row (``p``, ``q`` [rows, U] on the
    token ids ``support``, sorted): the divergence of the target the draft was verified against."""
    ids = torch.tensor(drafts, device=support.device)
    n = torch.searchsorted(support, ids).clamp(max=support.numel() - 1)
    if not bool((support[n] == ids).all()):  # (a draft has p > 0, so it is in the support; else: nothing to say)
        return ()
    h = RULES[rule].target(resolve_params(rule, rule_kwargs), p.double()[None], q.double()[None], n[None])[0]
    return tuple(divergences(h, q)[0].tolist())
