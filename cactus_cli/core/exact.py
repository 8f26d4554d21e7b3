"""The exact distribution a verification position emits under each rule, and its divergence
from the verifier: what the divergence meter reports per token (bench --meter, calibrate) and
what the statistical tests compare sampled frequencies against (ALGORITHM.md section 2)."""

from __future__ import annotations

from typing import Any

import torch

from cactus_cli.core.acceptance import (
    _h_n,
    _one_hot,
    _scale,
    _topk_set,
    _topk_threshold,
    resolve_params,
)


def emitted_distribution(rule: str, p: torch.Tensor, q: torch.Tensor, **params: Any) -> torch.Tensor:
    """The exact distribution of the token one verification position emits, when the drafted token
    is drawn from ``p`` and the rule then accepts it or replaces it: ``p``, ``q`` are [V] or [..., V]
    (q is the verifier row of that position). Computed in float64.

        h_alg(x) = sum_n p_n [a_n 1{x = n} + (1 - a_n) r^(n)(x)]

    For sps / cactus / cactus-exact (h depends on n) this is O(V log V), not O(V^2): with
    s_n = (1 - g_n) / (1 - q_n), rejected token n sends weight w_n = (p_n - g_n)_+ / Z_n to every
    x != n with s_n > p_x / q_x, amount s_n q_x - p_x; sorting tokens by s_n and by p_x / q_x,
    prefix sums give every x at once (ALGORITHM.md section 2)."""
    prm = resolve_params(rule, params)
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    shape = p.shape
    P = p.double().reshape(-1, shape[-1])  # [N, V]
    Q = q.double().reshape(-1, shape[-1])
    if rule == "interp":
        out = prm["alpha"] * P + (1 - prm["alpha"]) * Q
    elif rule == "tas":
        entropy = -torch.xlogy(Q, Q).sum(-1, keepdim=True)
        thr = torch.minimum(torch.full_like(entropy, prm["epsilon"]), prm["alpha"] * torch.exp(-entropy))
        ok = Q > thr
        out = P * ok
        out = out + _one_hot(Q.argmax(-1), Q) * (P * ~ok).sum(-1, keepdim=True)
    elif rule == "topk":
        inside = _topk_set(Q, _topk_threshold(Q, prm["topk"]))
        out = P * inside
        resid = (inside.double() - P).clamp(min=0.0)
        z = resid.sum(-1, keepdim=True)
        out = out + (P * ~inside).sum(-1, keepdim=True) * resid / torch.where(z > 0, z, torch.ones_like(z))
    else:
        out = _emitted_h_rule(rule, prm, P, Q)
    return out.reshape(shape)


def _emitted_h_rule(rule: str, prm: dict, P: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N, V] for the rules h^(n) = s_n q off n, g_n at n."""
    g = _h_n(rule, prm, P, Q)  # [N, V]: g_n for every candidate drafted token n
    s = _scale(Q, g)  # [N, V]
    inf = torch.full_like(Q, float("inf"))
    rho = torch.where(Q > 0, P / torch.where(Q > 0, Q, torch.ones_like(Q)), inf)  # p_x / q_x

    # Z_n = sum_{x != n, rho_x < s_n} (s_n q_x - p_x): sort x by rho, prefix sums of q and p
    rho_sorted, order = rho.sort(-1)
    cq = torch.cat([torch.zeros_like(Q[:, :1]), Q.gather(-1, order).cumsum(-1)], -1)  # [N, V+1]
    cp = torch.cat([torch.zeros_like(P[:, :1]), P.gather(-1, order).cumsum(-1)], -1)
    below = torch.searchsorted(rho_sorted, s.contiguous(), right=False)  # count of x with rho_x < s_n
    z = s * cq.gather(-1, below) - cp.gather(-1, below)
    z = z - torch.where(rho < s, s * Q - P, torch.zeros_like(z))  # x = n is not a replacement
    excess = (P - g).clamp(min=0.0)  # p_n (1 - a_n)
    w = torch.where(excess > 0, excess / torch.where(z > 0, z, torch.ones_like(z)), torch.zeros_like(z))

    # sum over n != x with s_n > rho_x of w_n (s_n q_x - p_x): sort n by s, suffix sums of w s and w
    s_sorted, s_order = s.sort(-1)
    ws = (w * s).gather(-1, s_order)
    ww = w.gather(-1, s_order)
    tail_ws = torch.cat([ws.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(ws[:, :1])], -1)  # [N, V+1]
    tail_w = torch.cat([ww.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(ww[:, :1])], -1)
    first = torch.searchsorted(s_sorted, rho.contiguous(), right=True)  # first n with s_n > rho_x
    sum_ws, sum_w = tail_ws.gather(-1, first), tail_w.gather(-1, first)
    self_term = s > rho  # n = x lies in that range: take it out
    sum_ws = sum_ws - torch.where(self_term, w * s, torch.zeros_like(w))
    sum_w = sum_w - torch.where(self_term, w, torch.zeros_like(w))
    recovered = torch.where(Q > 0, Q * sum_ws - P * sum_w, torch.zeros_like(Q)).clamp(min=0.0)
    return torch.minimum(P, g) + recovered


def divergences(h: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(h || q), TV(h, q)) over the last dim, float64; KL is inf where h has mass q lacks."""
    h, q = h.double(), q.double()
    kl = torch.where(h > 0, h * (torch.log(h) - torch.log(q)), torch.zeros_like(h)).sum(-1)
    return kl.clamp(min=0.0), 0.5 * (h - q).abs().sum(-1)  # KL >= 0; rounding can dip below


def meter(rule: str, rule_kwargs: dict[str, Any], p: torch.Tensor | None, q: torch.Tensor | None,
          logits: torch.Tensor, new: list[int], m: int, k: int) -> tuple[tuple[float, ...], ...]:
    """The divergence meter for one step (``p`` [1, k, V], ``q`` [1, k+1, V], None when greedy;
    ``new``: the step's tokens, the first ``m`` accepted drafts). Per emitted position decided by
    the rule: KL(h_alg || q) and TV(h_alg, q) of the exact emitted distribution (the bonus
    position is q itself; greedy is exact), and the verifier's log-likelihood (temperature 1,
    unfiltered) of every token emitted."""
    rows = min(m + 1, k)
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
    logp = torch.log_softmax(logits[: m + 1].float(), -1)  # [m+1, V]
    ll = logp.gather(-1, torch.tensor(new, device=logp.device).view(-1, 1)).squeeze(-1)
    return kl, tv, tuple(ll.tolist())
