"""Acceptance rules for speculative decoding: pure functions over probability tensors.

Names, used the same way everywhere in this project:

    p      draft probabilities          [B, k, V]
    q      verifier probabilities       [B, k+1, V]   (row k is the bonus position)
    n      the drafted token at a position, drawn from p
    k      drafted tokens per step
    delta  the divergence budget of the Cactus rules

Each rule is one object (``Rule``) that carries its behaviour: its parameters, the probability
it accepts a drafted token with, the distribution it draws a replacement from after a
rejection, its target distribution where it has one, and the exact distribution one
verification position emits (for the divergence meter and the exactness tests). ``RULES`` is
the one registry: ``verify``, the meter and the settings call the rule and never test its name,
so a new rule is one subclass and one registry line (tests/test_acceptance.py adds a toy rule).

Most rules are *generalized speculative sampling* (``TargetRule``, docs/algorithm.md section 1):
they pick a target ``h`` per position, accept ``n`` with probability ``min(1, h_n / p_n)`` and
on rejection draw the replacement from ``normalize(max(0, h - p))``; SpS and the Cactus rules
are those whose ``h`` is ``g`` at the drafted token and the verifier's ``q`` scaled by
``(1 - g) / (1 - q_n)`` elsewhere (``ScaledRule``: they define ``g`` alone). ``tas`` (typical
acceptance) and ``topk`` sit outside that frame. After ``k`` acceptances one bonus token is
drawn from ``q[:, k]`` whatever the rule.

Applying a rule to drafts (``verify``, ``verify_rows``) is core/verify.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cactus_cli.core import defaults

__all__ = ["RULES", "DIVERGENCES", "LOSSLESS", "Param", "Rule", "resolve_params", "cactus_target_prob"]

DIVERGENCES = ("kl", "chi2", "hellinger", "tv")
_BISECTION_STEPS = 60  # float64 bisection on [q_n, 1]: width 2^-60, below float64 resolution


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


MAX_DELTA = 1e6  # nats: any budget this large already accepts every draft, and larger ones overflow float32
_DELTA = Param("delta", defaults.DELTA, lambda v: _nonneg(v) and v <= MAX_DELTA, f"a number in 0..{MAX_DELTA:g}")


class Rule:
    """An acceptance rule: name, summary, parameters, and its behaviour on probability rows
    (float32 or float64; ``prm`` is its resolved parameters, ``n`` the drafted tokens)."""

    name: str = ""
    summary: str = ""
    params: tuple[Param, ...] = ()
    lossless: bool = False  # emits exactly the verifier's distribution (reports mark it: the reference)
    pointwise: bool = False  # its acceptance depends on p_n and q_n alone: ``accept_at`` gives it

    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def finish_params(self, prm: dict[str, Any]) -> dict[str, Any]:
        """Defaults that depend on other parameters (tas: alpha from epsilon)."""
        return prm

    def accept(self, prm: dict, p: torch.Tensor, q: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """[B, k]: the probability each drafted token is accepted (p, q [B, k, V]: both models'
        rows at the drafted positions; n [B, k])."""
        raise NotImplementedError

    def accept_at(self, prm: dict, p_n: torch.Tensor, q_n: torch.Tensor) -> torch.Tensor:
        """[N]: the probability each drafted token is accepted, from its draft and verifier
        probabilities alone (p_n, q_n [N]), for a ``pointwise`` rule (sps, cactus, cactus-exact):
        ``verify_rows`` then decides every row's drafts in one call. interp, tas and topk take whole
        rows (``accept``) and are called row by row."""
        raise NotImplementedError(f"rule {self.name!r} needs whole rows to accept a draft: call accept")

    def residual(self, prm: dict, p: torch.Tensor, q: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """[B, V]: the unnormalized distribution a replacement is drawn from at the rejected
        position (p, q [B, V] there; n [B] the rejected token)."""
        raise NotImplementedError

    def budget_bound(self, prm: dict) -> float | None:
        """The largest KL(h^(n) || q) any draft's target can have, or None where the rule gives none
        (the meter's per-draft budget is checked against it: benchmarks/eval_tables.py)."""
        return None

    def target(self, prm: dict, p: torch.Tensor, q: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """[B, k, V]: the target h each drafted token is verified against."""
        raise ValueError(f"rule {self.name!r} has no target distribution h (it is not of the form min(1, h_n / p_n))")

    def emitted(self, prm: dict, P: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
        """[N, V]: the exact distribution of the token a position emits when the drafted token is
        drawn from P and the rule accepts it or replaces it (float64 rows)."""
        raise NotImplementedError(f"rule {self.name!r} does not give its emitted distribution")


def _at(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """x [..., V] at the tokens n [...]."""
    return x.gather(-1, n.unsqueeze(-1)).squeeze(-1)


class TargetRule(Rule):
    """Generalized speculative sampling against a target ``h``: accept with min(1, h_n / p_n),
    replace from normalize(max(0, h - p)). A subclass gives ``target`` (and ``emitted``)."""

    def accept(self, prm, p, q, n):
        return _ratio(_at(self.target(prm, p, q, n), n), _at(p, n))

    def residual(self, prm, p, q, n):
        return (self.target(prm, p.unsqueeze(1), q.unsqueeze(1), n.unsqueeze(1))[:, 0] - p).clamp(min=0.0)


class FixedTargetRule(TargetRule):
    """A target that does not depend on the drafted token: the position then emits exactly h.
    A subclass gives ``h`` alone (tests/test_toy_rule.py defines one in ten lines)."""

    def h(self, prm: dict, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """[..., V] the target from both models' rows [..., V]."""
        raise NotImplementedError

    def target(self, prm, p, q, n):
        return self.h(prm, p, q)

    def emitted(self, prm, P, Q):
        return self.h(prm, P, Q)


class ScaledRule(TargetRule):
    """h = g_n at the drafted token n, s q elsewhere with s = (1 - g_n) / (1 - q_n): SpS (g = q_n)
    and the Cactus rules (g boosted within the budget). A subclass gives ``g`` alone."""

    pointwise = True

    def g(self, prm: dict, q_n: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def accept_at(self, prm, p_n, q_n):
        return _ratio(self.g(prm, q_n), p_n)

    def accept(self, prm, p, q, n):  # (accept_at's code: verify and verify_rows agree bit for bit)
        return self.accept_at(prm, _at(p, n), _at(q, n))

    def residual(self, prm, p, q, n):
        p_n, q_n = _at(p, n), _at(q, n)
        g = self.g(prm, q_n)
        r = q * _scale(q_n, g).unsqueeze(-1)
        r.sub_(p).clamp_(min=0.0)
        return r.scatter_(-1, n.unsqueeze(-1), (g - p_n).clamp(min=0.0).unsqueeze(-1))

    def target(self, prm, p, q, n):
        q_n = _at(q, n)
        g = self.g(prm, q_n)
        return (q * _scale(q_n, g).unsqueeze(-1)).scatter(-1, n.unsqueeze(-1), g.unsqueeze(-1))

    def emitted(self, prm, P, Q):
        """O(V log V), not O(V^2): rejected token n sends weight w_n = (p_n - g_n)_+ / Z_n to every
        x != n with s_n > p_x / q_x, amount s_n q_x - p_x; sorting tokens by s_n and by p_x / q_x,
        prefix sums give every x at once (docs/algorithm.md section 2)."""
        g = self.g(prm, Q)  # [N, V]: g_n for every candidate drafted token n
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


class SpS(ScaledRule):
    name, summary = "sps", "standard speculative sampling: h = q, lossless"
    lossless = True

    def budget_bound(self, prm):
        return 0.0

    def g(self, prm, q_n):
        return q_n


class Cactus(ScaledRule):
    name = "cactus"
    summary = "Cactus, the paper's closed form h_n = q_n + sqrt(2 delta q_n (1 - q_n))"
    params = (_DELTA,)

    def budget_bound(self, prm):  # not delta: KL(h || q) peaks where h reaches 1, at q_n = 1 / (1 + 2 delta)
        return math.log1p(2 * prm["delta"])

    def g(self, prm, q_n):
        return cactus_target_prob(q_n, prm["delta"])


class CactusExact(ScaledRule):
    name = "cactus-exact"
    summary = "Cactus with the exact per-token budget D(h || q) = delta (kl, chi2, hellinger, tv)"
    params = (_DELTA, Param("divergence", "kl", lambda v: v in DIVERGENCES, "one of " + ", ".join(DIVERGENCES), str))

    def budget_bound(self, prm):
        return prm["delta"] if prm["divergence"] == "kl" else None  # (other divergences bound their own D)

    def g(self, prm, q_n):
        return cactus_target_prob(q_n, prm["delta"], prm["divergence"])


class Interp(FixedTargetRule):
    name, summary = "interp", "h = alpha p + (1 - alpha) q"
    params = (Param("alpha", 0.5, _unit, "a number in [0, 1]"),)

    def h(self, prm, p, q):
        return prm["alpha"] * p + (1 - prm["alpha"]) * q

    def residual(self, prm, p, q, n):  # (h - p)+ written so that alpha = 1 leaves exact zeros
        return ((1 - prm["alpha"]) * (q - p)).clamp(min=0.0)


class TypicalAcceptance(Rule):
    name = "tas"
    summary = "typical acceptance (Medusa): accept if q_n > min(epsilon, alpha exp(-H(q))), else verifier argmax"
    params = (
        Param("epsilon", 0.09, _pos_unit, "a number in (0, 1]"),
        Param("alpha", None, _nonneg, "a finite number >= 0 (default sqrt(epsilon))"),
    )

    def finish_params(self, prm):
        return {**prm, "alpha": math.sqrt(prm["epsilon"])} if prm["alpha"] is None else prm

    @staticmethod
    def _threshold(prm: dict, q: torch.Tensor) -> torch.Tensor:
        entropy = -torch.xlogy(q, q).sum(-1)
        return torch.minimum(torch.full_like(entropy, prm["epsilon"]), prm["alpha"] * torch.exp(-entropy))

    def accept(self, prm, p, q, n):
        return (_at(q, n) > self._threshold(prm, q)).to(q.dtype)

    def residual(self, prm, p, q, n):
        return _one_hot(q.argmax(-1), q)

    def emitted(self, prm, P, Q):
        ok = Q > self._threshold(prm, Q).unsqueeze(-1)
        return P * ok + _one_hot(Q.argmax(-1), Q) * (P * ~ok).sum(-1, keepdim=True)


class TopK(Rule):
    name, summary = "topk", "accept if the draft token is among the verifier's top-k tokens"
    params = (Param("topk", 5, _pos_int, "an integer >= 1", int),)

    @staticmethod
    def _inside(prm: dict, q: torch.Tensor) -> torch.Tensor:
        """Tokens among the verifier's top-k (ties at the k-th count; zero probability never)."""
        thr = q.topk(min(prm["topk"], q.shape[-1]), dim=-1).values[..., -1]
        return (q >= thr.unsqueeze(-1)) & (q > 0)

    def accept(self, prm, p, q, n):
        return _at(self._inside(prm, q), n).to(q.dtype)

    def residual(self, prm, p, q, n):
        return (self._inside(prm, q).to(q.dtype) - p).clamp(min=0.0)

    def emitted(self, prm, P, Q):
        inside = self._inside(prm, Q)
        resid = (inside.double() - P).clamp(min=0.0)
        z = resid.sum(-1, keepdim=True)
        return P * inside + (P * ~inside).sum(-1, keepdim=True) * resid / torch.where(z > 0, z, torch.ones_like(z))


RULES: dict[str, Rule] = {r.name: r for r in (SpS(), Cactus(), CactusExact(), TypicalAcceptance(), TopK(), Interp())}
LOSSLESS = "sps"  # the rule every lossless comparison and warm-up runs


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
    return spec.finish_params(out)


# --------------------------------------------------------------------------- the Cactus target


def cactus_target_prob(q_n: torch.Tensor, delta: float, divergence: str | None = None) -> torch.Tensor:
    """The largest h_n = g in [q_n, 1] the budget allows.

    ``divergence=None`` is the paper's second-order closed form; otherwise the exact root of
    the Bernoulli divergence D(g || q_n) = delta (the proportional scaling of the other tokens
    makes D(h || q) equal that Bernoulli divergence, docs/algorithm.md section 2).
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


# --------------------------------------------------------------------------- shared helpers


def _ratio(h_n: torch.Tensor, p_n: torch.Tensor) -> torch.Tensor:
    """min(1, h_n / p_n); a token the draft gave p_n = 0 is accepted only where h_n > 0."""
    safe_p = torch.where(p_n > 0, p_n, torch.ones_like(p_n))
    return torch.where(p_n > 0, (h_n / safe_p).clamp(max=1.0), (h_n > 0).to(h_n.dtype))


def _scale(q_n: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """s = (1 - g) / (1 - q_n), the factor every other token's q is scaled by (0 when q_n = 1)."""
    rest = 1.0 - q_n
    return torch.where(rest > 0, (1.0 - g) / torch.where(rest > 0, rest, torch.ones_like(rest)), torch.zeros_like(rest))


def _one_hot(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, V] one-hot rows shaped and typed like ``like``."""
    return torch.zeros_like(like).scatter(-1, index.unsqueeze(-1), 1.0)
