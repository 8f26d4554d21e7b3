"""Applying an acceptance rule (core/acceptance.py) to drafts: ``verify`` for a batch of one rule,
``verify_rows`` for ragged rows of several rules in one call, ``greedy_verify`` at temperature 0, and
``target_distribution`` for the tests.

All distributions are taken after the sampling transforms (temperature, top-k, top-p),
applied identically to both models. Every random draw comes from the ``generator``
argument: ``torch.rand`` for the acceptance tests, then one uniform per sequence for the
extra token (inverse CDF), in that order for every rule, so equal generator states give equal results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from cactus_cli.core.acceptance import RULES, Rule, resolve_params
from cactus_cli.core.sampling import sample

__all__ = ["Verdict", "verify", "verify_rows", "Row", "greedy_verify", "target_distribution"]


@dataclass(frozen=True)
class Verdict:
    """What one verification step decided, for each of the B sequences."""

    num_accepted: torch.Tensor  # [B] int64, accepted prefix length, 0..k
    tokens: torch.Tensor  # [B, k+1] int64: accepted drafts, one extra token, then -1
    acceptance_probs: torch.Tensor  # [B, k] probability each drafted token had of acceptance


def _work_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _check_shapes(p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int, int]:
    if p.dim() != 3 or q.dim() != 3 or draft_tokens.dim() != 2:
        raise ValueError(
            f"expected p [B, k, V], q [B, k+1, V], draft_tokens [B, k]; got {tuple(p.shape)}, "
            f"{tuple(q.shape)}, {tuple(draft_tokens.shape)}"
        )
    B, k, V = p.shape
    if tuple(q.shape) != (B, k + 1, V) or tuple(draft_tokens.shape) != (B, k):
        raise ValueError(
            f"shape mismatch: p {tuple(p.shape)} needs q {(B, k + 1, V)} and draft_tokens {(B, k)}; "
            f"got q {tuple(q.shape)}, draft_tokens {tuple(draft_tokens.shape)}"
        )
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    return B, k, V


def verify(
    rule: str,
    p: torch.Tensor,
    q: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    **params: Any,
) -> Verdict:
    """Verify ``k`` drafted tokens per sequence against the verifier and emit 1..k+1 tokens each.

    p: [B, k, V] draft probabilities; q: [B, k+1, V] verifier probabilities (row k = bonus);
    draft_tokens: [B, k] drawn from p. Works in float32 (float64 if an input is float64), so
    float16/bfloat16 inputs are fine. The rule (``RULES[rule]``) decides acceptance and residual.
    """
    prm = resolve_params(rule, params)
    B, k, V = _check_shapes(p, q, draft_tokens)
    work = _work_dtype(p, q)
    n = draft_tokens.to(torch.int64)  # [B, k]
    rows = torch.arange(B, device=q.device)

    spec = RULES[rule]
    pw, qw = p.to(work), q[:, :k].to(work)  # [B, k, V] (no copy for float32 inputs)
    acc_prob = spec.accept(prm, pw, qw, n)  # [B, k]
    u = torch.rand((B, k), generator=generator, device=q.device, dtype=work)
    accepted = u < acc_prob  # u in [0, 1): probability 1 always accepts, 0 never
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]

    bonus = q[:, k].to(work)  # [B, V]
    if k == 0:
        dist, fallback = bonus, bonus
    else:
        j = num_accepted.clamp(max=k - 1)  # first rejected position (ignored where all accepted)
        q_j = qw[rows, j]
        resid = spec.residual(prm, pw[rows, j], q_j, n[rows, j])
        all_in = (num_accepted == k).unsqueeze(-1)
        dist = torch.where(all_in, bonus, resid)
        fallback = torch.where(all_in, bonus, q_j)
    extra = sample(dist, generator, fallback=fallback)  # [B]

    pos = torch.arange(k + 1, device=q.device)  # [k+1]
    m = num_accepted.unsqueeze(-1)
    padded = torch.cat([n, n.new_zeros(B, 1)], dim=-1)
    tokens = torch.where(pos < m, padded, torch.where(pos == m, extra.unsqueeze(-1), torch.full_like(padded, -1)))
    return Verdict(num_accepted=num_accepted, tokens=tokens, acceptance_probs=acc_prob)


@dataclass(frozen=True)
class Row:
    """One sequence's drafts for ``verify_rows``: its own rule, parameters, k and generator."""

    rule: str
    params: dict[str, Any]
    p: torch.Tensor  # [k, V] draft probabilities
    q: torch.Tensor  # [k+1, V] verifier probabilities (row k: the bonus)
    n: torch.Tensor  # [k] drafted tokens
    generator: torch.Generator | None = None


def verify_rows(rows: list[Row]) -> list[Verdict]:
    """``verify`` for ragged rows in one call: each row its own rule, parameters, k and generator
    (a step of several sequences; vLLM's rejection sampler takes ragged drafts the same way). Rows
    of one rule, parameters and working dtype are decided together (``_decide_group``); each row's
    random draws come from its own generator in ``verify``'s order, so a row's verdict equals
    ``verify`` of that row alone, bit for bit. No host sync, and no copy of the rows' [k, V]
    distributions."""
    out: list[Verdict | None] = [None] * len(rows)
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        _check_shapes(row.p.unsqueeze(0), row.q.unsqueeze(0), row.n.unsqueeze(0))
        items = tuple(sorted(resolve_params(row.rule, row.params).items()))
        groups.setdefault((row.rule, items, _work_dtype(row.p, row.q)), []).append(i)
    for (rule, items, work), idx in groups.items():
        for i, verdict in zip(idx, _decide_group(RULES[rule], dict(items), [rows[i] for i in idx], work)):
            out[i] = verdict
    return out


def _decide_group(spec: Rule, prm: dict[str, Any], rows: list[Row], work: torch.dtype) -> list[Verdict]:
    """One rule's R rows: every drafted position's acceptance (one call for a ``pointwise`` rule),
    each row's uniforms from its own generator, the accepted counts from one [R, kmax] cumprod,
    each row's extra token (``_extra``), every row's tokens at once; each verdict is views into those."""
    ks = [row.n.shape[0] for row in rows]
    dev = rows[0].q.device
    n = torch.cat([row.n for row in rows]).to(torch.int64)  # [sum k]
    if spec.pointwise:  # p_n, q_n [sum k]: one gather per row, then one call for every row
        p_n = torch.cat([row.p.gather(-1, m.unsqueeze(-1)) for row, m in zip(rows, n.split(ks))]).view(-1)
        q_n = torch.cat([row.q[:k].gather(-1, m.unsqueeze(-1)) for row, k, m in zip(rows, ks, n.split(ks))]).view(-1)
        acc = spec.accept_at(prm, p_n.to(work), q_n.to(work))
    else:  # whole rows: row by row
        acc = torch.cat(
            [
                spec.accept(prm, row.p.to(work)[None], row.q[:k].to(work)[None], m[None])[0]
                for row, k, m in zip(rows, ks, n.split(ks))
            ]
        )
    u = torch.cat([torch.rand((1, k), generator=row.generator, device=dev, dtype=work) for row, k in zip(rows, ks)], -1)
    accepted = (u[0] < acc).split(ks)
    num = pad_sequence(accepted, batch_first=True).to(torch.int64).cumprod(-1).sum(-1)  # [R] (rejects past a row's k)
    all_in = pad_sequence(accepted, batch_first=True, padding_value=True).all(-1)  # [R] (k = 0 rows too)
    padded = F.pad(pad_sequence(n.split(ks), batch_first=True), (0, 1))  # [R, kmax+1]
    extra = _extra(spec, prm, rows, padded, num, all_in, work)  # [R]

    pos = torch.arange(padded.shape[1], device=dev)  # [kmax+1]
    m = num.unsqueeze(-1)
    tokens = torch.where(pos < m, padded, torch.where(pos == m, extra.unsqueeze(-1), torch.full_like(padded, -1)))
    return [
        Verdict(num_accepted=num[i : i + 1], tokens=tokens[i : i + 1, : k + 1], acceptance_probs=a.view(1, k))
        for i, (k, a) in enumerate(zip(ks, acc.split(ks)))
    ]


def _extra(
    spec: Rule,
    prm: dict[str, Any],
    rows: list[Row],
    padded: torch.Tensor,
    num: torch.Tensor,
    all_in: torch.Tensor,
    work: torch.dtype,
) -> torch.Tensor:
    """[R]: each row's extra token, from its own generator: from the bonus q[k] where every draft
    was accepted, else from the rule's residual at the first rejected position, one residual call
    over every row's (padded [R, kmax+1]: the drafts). No host sync: a row of k = 0 takes its bonus
    row as p and q there (a residual never used), so every row joins that call."""
    ks = [row.n.shape[0] for row in rows]
    j = num.masked_fill(all_in, 0)  # [R] first rejected position (0 where all accepted: not used there)
    p_j = torch.cat([(row.p if k else row.q).index_select(0, j[i : i + 1]) for i, (row, k) in enumerate(zip(rows, ks))])
    q_j = torch.cat([row.q.index_select(0, j[i : i + 1]) for i, row in enumerate(rows)]).to(work)  # [R, V]
    resid = spec.residual(prm, p_j.to(work), q_j, padded.gather(1, j.unsqueeze(-1)).squeeze(1))
    out = []
    for i, (row, k) in enumerate(zip(rows, ks)):  # each row's own generator; its bonus row read in place
        c, bonus = all_in[i : i + 1, None], row.q[k : k + 1].to(work)  # [1, 1], [1, V]
        dist, fallback = torch.where(c, bonus, resid[i : i + 1]), torch.where(c, bonus, q_j[i : i + 1])
        out.append(sample(dist, row.generator, fallback=fallback))
    return torch.cat(out)


def greedy_verify(draft_tokens: torch.Tensor, verifier_argmax: torch.Tensor) -> Verdict:
    """Temperature 0: accept a drafted token iff it is the verifier's argmax; the extra token is
    the verifier's argmax at the first mismatch (or the bonus position). Every rule reduces to
    this on one-hot distributions. draft_tokens [B, k], verifier_argmax [B, k+1]."""
    B, k = draft_tokens.shape
    n = draft_tokens.to(torch.int64)
    match = n == verifier_argmax[:, :k]
    num_accepted = match.to(torch.int64).cumprod(-1).sum(-1)
    extra = verifier_argmax.gather(-1, num_accepted.unsqueeze(-1))  # [B, 1]
    pos = torch.arange(k + 1, device=n.device)
    m = num_accepted.unsqueeze(-1)
    padded = torch.cat([n, n.new_zeros(B, 1)], dim=-1)
    tokens = torch.where(pos < m, padded, torch.where(pos == m, extra, torch.full_like(padded, -1)))
    return Verdict(num_accepted=num_accepted, tokens=tokens, acceptance_probs=match.to(torch.float32))


def target_distribution(
    rule: str, p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor, **params: Any
) -> torch.Tensor:
    """[B, k, V]: the target h each drafted token is verified against (sps, cactus,
    cactus-exact, interp). ``tas`` and ``topk`` have no such h and raise ValueError."""
    prm = resolve_params(rule, params)
    B, k, V = _check_shapes(p, q, draft_tokens)
    work = _work_dtype(p, q)
    return RULES[rule].target(prm, p.to(work), q[:, :k].to(work), draft_tokens.to(torch.int64))
