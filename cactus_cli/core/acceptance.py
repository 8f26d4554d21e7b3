"""Acceptance rules for speculative decoding: pure functions over probability tensors.

Names, used the same way everywhere in this project:

    p      draft probabilities          [B, k, V]
    q      verifier probabilities       [B, k+1, V]   (row k is the bonus position)
    n      the drafted token at a position, drawn from p
    k      drafted tokens per step
    delta  the divergence budget of the Cactus rules

Most rules are *generalized speculative sampling* (ALGORITHM.md section 1): they pick a
target ``h`` per position, accept ``n`` with probability ``min(1, h_n / p_n)`` and on
rejection draw the replacement from ``normalize(max(0, h - p))``. ``tas`` (typical
acceptance) is the one rule outside that frame. After ``k`` acceptances one bonus token
is drawn from ``q[:, k]`` whatever the rule.

All distributions are taken after the sampling transforms (temperature, top-k, top-p),
applied identically to both models. Every random draw comes from the ``generator``
argument: ``torch.rand`` for the acceptance tests, then one uniform per sequence for the
extra token (inverse CDF), in that order for every rule, so equal generator states give equal results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cactus_cli.core import defaults
from cactus_cli.core.sampling import sample

__all__ = [
    "RULES",
    "DIVERGENCES",
    "Verdict",
    "verify",
    "greedy_verify",
    "target_distribution",
    "resolve_params",
    "cactus_target_prob",
]

DIVERGENCES = ("kl", "chi2", "hellinger", "tv")
_BISECTION_STEPS = 60  # float64 bisection on [q_n, 1]: width 2^-60, below float64 resolution


@dataclass(frozen=True)
class Verdict:
    """What one verification step decided, for each of the B sequences."""

    num_accepted: torch.Tensor  # [B] int64, accepted prefix length, 0..k
    tokens: torch.Tensor  # [B, k+1] int64: accepted drafts, one extra token, then -1
    acceptance_probs: torch.Tensor  # [B, k] probability each drafted token had of acceptance


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Param:
    name: str
    default: Any
    valid: Callable[[Any], bool]
    valid_range: str
    kind: type = float


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _nonneg(v: Any) -> bool:
    return _is_number(v) and math.isfinite(v) and v >= 0


def _unit(v: Any) -> bool:
    return _is_number(v) and 0 <= v <= 1


def _pos_unit(v: Any) -> bool:
    return _is_number(v) and 0 < v <= 1


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


_DELTA = Param("delta", defaults.DELTA, _nonneg, "a finite number >= 0")


@dataclass(frozen=True)
class Rule:
    name: str
    summary: str
    params: tuple[Param, ...] = ()

    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


RULES: dict[str, Rule] = {
    r.name: r
    for r in (
        Rule("sps", "standard speculative sampling: h = q, lossless"),
        Rule("cactus", "Cactus, the paper's closed form h_n = q_n + sqrt(2 delta q_n (1 - q_n))", (_DELTA,)),
        Rule(
            "cactus-exact",
            "Cactus with the exact per-token budget D(h || q) = delta (kl, chi2, hellinger, tv)",
            (_DELTA, Param("divergence", "kl", lambda v: v in DIVERGENCES, "one of " + ", ".join(DIVERGENCES), str)),
        ),
        Rule(
            "tas",
            "typical acceptance (Medusa): accept if q_n > min(epsilon, alpha exp(-H(q))), else verifier argmax",
            (
                Param("epsilon", 0.09, _pos_unit, "a number in (0, 1]"),
                Param("alpha", None, _nonneg, "a finite number >= 0 (default sqrt(epsilon))"),
            ),
        ),
        Rule("topk", "accept if the draft token is among the verifier's top-k tokens", (
            Param("topk", 5, _pos_int, "an integer >= 1", int),
        )),
        Rule("interp", "h = alpha p + (1 - alpha) q", (Param("alpha", 0.5, _unit, "a number in [0, 1]"),)),
    )
}


def resolve_params(rule: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Validate ``params`` for ``rule`` and fill in defaults. Raises ValueError naming what to fix."""
    spec = RULES.get(rule)
    if spec is None:
        raise ValueError(f"unknown acceptance rule {rule!r}; choose one of: {', '.join(RULES)}")
    params = dict(params or {})
    unknown = sorted(set(params) - set(spec.param_names()))
    if unknown:
        takes = ", ".join(spec.param_names()) or "no parameters"
        raise ValueError(f"rule {rule!r} has no parameter {unknown[0]!r} (it takes: {takes})")
    out: dict[str, Any] = {}
    for prm in spec.params:
        value = params.get(prm.name, prm.default)
        if value is None and prm.default is None:
            out[prm.name] = None
            continue
        if prm.kind is float and _is_number(value):
            value = float(value)
        if not prm.valid(value):
            raise ValueError(f"rule {rule!r}: parameter {prm.name!r} must be {prm.valid_range}, got {value!r}")
        out[prm.name] = value
    if rule == "tas" and out["alpha"] is None:
        out["alpha"] = math.sqrt(out["epsilon"])
    return out


# --------------------------------------------------------------------------- the Cactus target


def cactus_target_prob(q_n: torch.Tensor, delta: float, divergence: str | None = None) -> torch.Tensor:
    """The largest h_n = g in [q_n, 1] the budget allows.

    ``divergence=None`` is the paper's second-order closed form; otherwise the exact root of
    the Bernoulli divergence D(g || q_n) = delta (the proportional scaling of the other tokens
    makes D(h || q) equal that Bernoulli divergence, ALGORITHM.md section 2).
    """
    x = q_n.clamp(0.0, 1.0)
    if divergence is None:
        return (x + torch.sqrt(2.0 * delta * x * (1.0 - x))).clamp(max=1.0)
    if divergence == "chi2":  # (g - x)^2 / (x (1 - x)) <= delta
        return (x + torch.sqrt(delta * x * (1.0 - x))).clamp(max=1.0)
    if divergence == "tv":  # TV = g - x
        return (x + delta).clamp(max=1.0)
    if divergence == "hellinger":  # H^2 = 1 - sqrt(g x) - sqrt((1-g)(1-x)) = 1 - cos(phi - theta)
        phi = torch.arccos(torch.sqrt(x))
        theta = (phi - math.acos(max(1.0 - delta, -1.0))).clamp(min=0.0)
        return torch.maximum(torch.cos(theta).square(), x).clamp(max=1.0)
    if divergence == "kl":
        return _kl_root(x, delta)
    raise ValueError(f"unknown divergence {divergence!r}; choose one of: {', '.join(DIVERGENCES)}")


def _kl_root(x: torch.Tensor, delta: float) -> torch.Tensor:
    """Largest g in [x, 1] with KL_bern(g || x) <= delta, by float64 bisection (KL is monotone
    there). Bisection keeps the feasible end, so the budget holds exactly; the result is rounded
    down, never up, when cast back to float32."""
    xd = x.double()
    inner = (xd > 0) & (xd < 1)
    xs = torch.where(inner, xd, torch.full_like(xd, 0.5))  # keep logs finite off the interior
    log_x, log_1mx = torch.log(xs), torch.log1p(-xs)
    lo, hi = xs.clone(), torch.ones_like(xs)
    # float32 needs 2^-32 of the unit interval, float64 2^-60
    for _ in range(_BISECTION_STEPS if x.dtype == torch.float64 else 32):
        mid = 0.5 * (lo + hi)
        kl = mid * (torch.log(mid) - log_x) + (1 - mid) * (torch.log1p(-mid) - log_1mx)
        ok = kl <= delta
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    g = torch.where(-log_x <= delta, torch.ones_like(xs), lo)  # KL(1 || x) = -log x fits: boost to 1
    g = torch.where(inner, g, xd)  # x = 0: any mass on n is infinite KL; x = 1: already 1
    out = g.to(x.dtype)
    return torch.where(out.double() > g, torch.nextafter(out, torch.zeros_like(out)), out)


# --------------------------------------------------------------------------- rules as (accept, residual)


def _work_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _h_n(rule: str, prm: dict, p_n: torch.Tensor, q_n: torch.Tensor) -> torch.Tensor:
    """h at the drafted token, for the rules with a target distribution."""
    if rule == "sps":
        return q_n
    if rule == "cactus":
        return cactus_target_prob(q_n, prm["delta"])
    if rule == "cactus-exact":
        return cactus_target_prob(q_n, prm["delta"], prm["divergence"])
    if rule == "interp":
        return prm["alpha"] * p_n + (1 - prm["alpha"]) * q_n
    raise ValueError(f"rule {rule!r} has no target distribution h (it is not of the form min(1, h_n / p_n))")


def _scale(q_n: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """s = (1 - g) / (1 - q_n), the factor every other token's q is scaled by (0 when q_n = 1)."""
    rest = 1.0 - q_n
    return torch.where(rest > 0, (1.0 - g) / torch.where(rest > 0, rest, torch.ones_like(rest)), torch.zeros_like(rest))


def _ratio_accept(h_n: torch.Tensor, p_n: torch.Tensor) -> torch.Tensor:
    """min(1, h_n / p_n), with p_n = 0 accepted only when h_n > 0."""
    safe_p = torch.where(p_n > 0, p_n, torch.ones_like(p_n))
    return torch.where(p_n > 0, (h_n / safe_p).clamp(max=1.0), (h_n > 0).to(h_n.dtype))


def _one_hot(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, V] one-hot rows shaped and typed like ``like``."""
    return torch.zeros_like(like).scatter(-1, index.unsqueeze(-1), 1.0)


def _topk_threshold(q: torch.Tensor, topk: int) -> torch.Tensor:
    """[..., V] -> [...]: the k-th largest verifier probability (ties at it count as in)."""
    return q.topk(min(topk, q.shape[-1]), dim=-1).values[..., -1]


def _topk_set(q: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    # tokens the verifier gives zero probability (filtered by top-k/top-p) are never "likely"
    return (q >= thr.unsqueeze(-1)) & (q > 0)


def _accept_probs(rule, prm, p_n, q_n, q_rows, work):
    """[B, k] acceptance probability of each drafted token; q_rows is q[:, :k]."""
    if rule == "tas":
        qf = q_rows.to(work)
        entropy = -torch.xlogy(qf, qf).sum(-1)  # [B, k]
        threshold = torch.minimum(torch.full_like(entropy, prm["epsilon"]), prm["alpha"] * torch.exp(-entropy))
        return (q_n > threshold).to(work)
    if rule == "topk":
        thr = _topk_threshold(q_rows, prm["topk"]).to(work)
        return ((q_n >= thr) & (q_n > 0)).to(work)
    return _ratio_accept(_h_n(rule, prm, p_n, q_n), p_n)


def _residual(rule, prm, p_j, q_j, n_j, p_nj, q_nj):
    """[B, V] unnormalized replacement distribution at the rejected position."""
    if rule == "tas":
        return _one_hot(q_j.argmax(-1), q_j)
    if rule == "topk":
        inside = _topk_set(q_j, _topk_threshold(q_j, prm["topk"]))
        return (inside.to(q_j.dtype) - p_j).clamp(min=0.0)
    if rule == "interp":
        return ((1 - prm["alpha"]) * (q_j - p_j)).clamp(min=0.0)
    # sps / cactus / cactus-exact: h = s q off n, g at n; sps is g = q_n, s = 1 exactly
    g = _h_n(rule, prm, p_nj, q_nj)
    r = q_j * _scale(q_nj, g).unsqueeze(-1)
    r.sub_(p_j).clamp_(min=0.0)
    return r.scatter_(-1, n_j.unsqueeze(-1), (g - p_nj).clamp(min=0.0).unsqueeze(-1))


# --------------------------------------------------------------------------- public functions


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
    draft_tokens: [B, k] drawn from p. Works in float32 (float64 if an input is float64),
    upcasting only the rows it reads, so float16/bfloat16 inputs are fine.
    """
    prm = resolve_params(rule, params)
    B, k, V = _check_shapes(p, q, draft_tokens)
    work = _work_dtype(p, q)
    n = draft_tokens.to(torch.int64)  # [B, k]
    rows = torch.arange(B, device=q.device)

    p_n = p.gather(-1, n.unsqueeze(-1)).squeeze(-1).to(work)  # [B, k]
    q_n = q[:, :k].gather(-1, n.unsqueeze(-1)).squeeze(-1).to(work)  # [B, k]
    acc_prob = _accept_probs(rule, prm, p_n, q_n, q[:, :k], work)  # [B, k]
    u = torch.rand((B, k), generator=generator, device=q.device, dtype=work)
    accepted = u < acc_prob  # u in [0, 1): probability 1 always accepts, 0 never
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]

    bonus = q[:, k].to(work)  # [B, V]
    if k == 0:
        dist, fallback = bonus, bonus
    else:
        j = num_accepted.clamp(max=k - 1)  # first rejected position (ignored where all accepted)
        q_j = q[rows, j].to(work)
        resid = _residual(rule, prm, p[rows, j].to(work), q_j, n[rows, j], p_n[rows, j], q_n[rows, j])
        all_in = (num_accepted == k).unsqueeze(-1)
        dist = torch.where(all_in, bonus, resid)
        fallback = torch.where(all_in, bonus, q_j)
    extra = sample(dist, generator, fallback=fallback)  # [B]

    pos = torch.arange(k + 1, device=q.device)  # [k+1]
    m = num_accepted.unsqueeze(-1)
    padded = torch.cat([n, n.new_zeros(B, 1)], dim=-1)
    tokens = torch.where(pos < m, padded, torch.where(pos == m, extra.unsqueeze(-1), torch.full_like(padded, -1)))
    return Verdict(num_accepted=num_accepted, tokens=tokens, acceptance_probs=acc_prob)


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
    if rule in ("tas", "topk"):
        raise ValueError(f"rule {rule!r} has no target distribution h (it is not of the form min(1, h_n / p_n))")
    work = _work_dtype(p, q)
    pw, qw = p.to(work), q[:, :k].to(work)
    if rule == "interp":
        return prm["alpha"] * pw + (1 - prm["alpha"]) * qw
    n = draft_tokens.to(torch.int64).unsqueeze(-1)
    q_n = qw.gather(-1, n).squeeze(-1)
    g = _h_n(rule, prm, pw.gather(-1, n).squeeze(-1), q_n)
    return (qw * _scale(q_n, g).unsqueeze(-1)).scatter(-1, n, g.unsqueeze(-1))
