"""The acceptance rules against exact mathematics: certain outcomes, exact distributions
(with stated false-failure odds), budgets, and degenerate inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cactus_cli.core.acceptance import DIVERGENCES, RULES, cactus_target_prob, resolve_params
from cactus_cli.core.verify import greedy_verify, target_distribution, verify
from tests.stats_helpers import assert_matches, l1_bound

ALL_RULES = [
    ("sps", {}),
    ("cactus", {"delta": 0.7}),
    ("cactus-exact", {"delta": 0.7}),
    ("cactus-exact", {"delta": 0.3, "divergence": "chi2"}),
    ("cactus-exact", {"delta": 0.2, "divergence": "hellinger"}),
    ("cactus-exact", {"delta": 0.2, "divergence": "tv"}),
    ("tas", {}),
    ("topk", {"topk": 2}),
    ("interp", {"alpha": 0.4}),
]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def one_hot(idx: list[int], V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(idx), V).double()


def random_dists(B: int, k: int, V: int, seed: int, scale: float = 2.0):
    g = gen(seed)
    p = torch.softmax(scale * torch.randn(B, k, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(scale * torch.randn(B, k + 1, V, generator=g, dtype=torch.float64), -1)
    draft = torch.multinomial(p.reshape(-1, V), 1, generator=g).view(B, k)
    return p, q, draft


# --------------------------------------------------------------------------- certain outcomes


@pytest.mark.parametrize("rule,params", ALL_RULES)
def test_accept_all_when_draft_is_verifier_argmax_and_certain(rule, params):
    # p = q one-hot on the drafted tokens: every rule accepts all k; the bonus row is one-hot on 7
    V = 10  # k = 3 drafts
    draft = torch.tensor([[1, 4, 2]])
    p = one_hot([1, 4, 2], V).unsqueeze(0)
    q = torch.cat([p, one_hot([7], V).unsqueeze(0)], dim=1)
    v = verify(rule, p, q, draft, generator=gen(), **params)
    assert v.num_accepted.tolist() == [3]
    assert v.tokens.tolist() == [[1, 4, 2, 7]]


@pytest.mark.parametrize("rule,params", [r for r in ALL_RULES if r[1].get("divergence") not in ("hellinger", "tv")])
@pytest.mark.parametrize("j", [0, 1, 2])
def test_reject_at_position_j_when_verifier_gives_zero(rule, params, j):
    # the verifier is certain of token 5 at position j and gives the draft token 0 probability:
    # accepted prefix is exactly j and the correction is 5 (KL/chi2 budgets cannot move mass to a
    # q_n = 0 token; hellinger/tv can, so they are excluded here)
    V = 8  # k = 3 drafts
    draft_ids = [1, 2, 3]
    p = one_hot(draft_ids, V).unsqueeze(0)
    q_rows = [one_hot([t], V)[0] for t in draft_ids] + [one_hot([6], V)[0]]
    q_rows[j] = one_hot([5], V)[0]
    q = torch.stack(q_rows).unsqueeze(0)
    v = verify(rule, p, q, torch.tensor([draft_ids]), generator=gen(), **params)
    assert v.num_accepted.tolist() == [j]
    assert v.tokens[0, :j].tolist() == draft_ids[:j]
    assert v.tokens[0, j].item() == 5
    assert (v.tokens[0, j + 1 :] == -1).all()


def test_greedy_verify_accepts_matching_prefix_then_verifier_argmax():
    draft = torch.tensor([[3, 1, 4], [3, 1, 4], [9, 9, 9]])
    argmax = torch.tensor([[3, 1, 4, 7], [3, 2, 4, 7], [0, 9, 9, 9]])
    v = greedy_verify(draft, argmax)
    assert v.num_accepted.tolist() == [3, 1, 0]
    assert v.tokens.tolist() == [[3, 1, 4, 7], [3, 2, -1, -1], [0, -1, -1, -1]]


# --------------------------------------------------------------------------- exact distributions


def _first_token_samples(rule, params, p1, q1, N, seed, k=1):
    """N independent verification steps of one shared [k, V] case; returns emitted tokens [N, k+1]."""
    V = p1.shape[-1]
    g = gen(seed)
    p = p1.expand(N, k, V).contiguous()
    q = q1.expand(N, k + 1, V).contiguous()
    draft = torch.multinomial(p.reshape(-1, V), 1, replacement=True, generator=g).view(N, k)
    return verify(rule, p, q, draft, generator=g, **params)


def test_sps_emits_exactly_the_verifier_distribution():
    # N = 60000 draws over V = 6: the L1 bound at false-failure odds 1e-6 is ~0.026
    p1 = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1, 0.0]], dtype=torch.float64)
    q1 = torch.tensor([[0.05, 0.15, 0.3, 0.0, 0.25, 0.25], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]], dtype=torch.float64)
    v = _first_token_samples("sps", {}, p1, q1, 60000, seed=1)
    assert_matches(v.tokens[:, 0], q1[0], false_failure_odds=1e-6)


def test_interp_emits_exactly_its_fixed_target_h():
    # h = alpha p + (1 - alpha) q does not depend on the drafted token, so the emitted token ~ h
    alpha = 0.35
    p1 = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.1, 0.0]], dtype=torch.float64)
    q1 = torch.tensor([[0.0, 0.1, 0.4, 0.2, 0.1, 0.2], [1 / 6] * 6], dtype=torch.float64)
    v = _first_token_samples("interp", {"alpha": alpha}, p1, q1, 60000, seed=2)
    h = alpha * p1[0] + (1 - alpha) * q1[0]
    assert_matches(v.tokens[:, 0], h, false_failure_odds=1e-6)
    # and not q: the test can fail (the distance from q is far above the bound)
    emp = torch.bincount(v.tokens[:, 0], minlength=6).double() / 60000
    assert (emp - q1[0]).abs().sum() > 3 * l1_bound(60000, 6, 1e-6)


def test_bonus_token_is_drawn_from_the_last_verifier_row():
    # p = q on the drafted positions: always accepted; the (k+1)-th token must follow q[:, k]
    k, V, N = 2, 5, 60000
    row = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0], dtype=torch.float64)
    bonus = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    p1 = row.expand(k, V)
    q1 = torch.cat([p1, bonus.unsqueeze(0)])
    v = _first_token_samples("sps", {}, p1, q1, N, seed=3, k=k)
    assert (v.num_accepted == k).all()
    assert_matches(v.tokens[:, k], bonus, false_failure_odds=1e-6)


def test_second_position_follows_q_given_first_accepted():
    # with k = 2 under SpS, the second emitted token given a first accepted token is ~ q[:, 1]
    p1 = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    q1 = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.4, 0.3, 0.2, 0.1], [0.25] * 4], dtype=torch.float64)
    v = _first_token_samples("sps", {}, p1, q1, 60000, seed=4, k=2)
    assert_matches(v.tokens[:, 1], q1[1], false_failure_odds=1e-6)


# --------------------------------------------------------------------------- Cactus specifics


def test_cactus_delta_zero_is_sps_token_for_token():
    p, q, draft = random_dists(64, 5, 50, seed=5)
    a = verify("sps", p, q, draft, generator=gen(9))
    b = verify("cactus", p, q, draft, generator=gen(9), delta=0.0)
    c = verify("cactus-exact", p, q, draft, generator=gen(9), delta=0.0)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tokens, c.tokens)
    # and a positive delta does change the outcome on the same draws (the test can fail)
    d = verify("cactus", p, q, draft, generator=gen(9), delta=1.0)
    assert d.num_accepted.sum() > a.num_accepted.sum()


def test_official_readme_worked_example():
    # q_n = 0.35 boosted to ~0.66 for KL = 0.20 nats (paper closed form, delta = 0.2)
    g = cactus_target_prob(torch.tensor([0.35], dtype=torch.float64), 0.2)
    assert abs(g.item() - 0.6517) < 1e-3


def _bern_div(div: str, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if div == "kl":
        return torch.xlogy(g, g / x) + torch.xlogy(1 - g, (1 - g) / (1 - x))
    if div == "chi2":
        return (g - x) ** 2 / (x * (1 - x))
    if div == "hellinger":
        return 1 - torch.sqrt(g * x) - torch.sqrt((1 - g) * (1 - x))
    return g - x  # tv


def _full_div(div: str, h: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """D(h || q) over the full vocabulary (last dim)."""
    if div == "kl":
        return torch.xlogy(h, h / q).sum(-1)
    if div == "chi2":
        return ((h - q) ** 2 / q).sum(-1)
    if div == "hellinger":
        return 1 - torch.sqrt(h * q).sum(-1)
    return 0.5 * (h - q).abs().sum(-1)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_cactus_exact_never_exceeds_the_budget_and_uses_all_of_it(divergence):
    # dense grid: 400 values of q_n from 1e-6 to 1 - 1e-6, 25 budgets from 1e-4 to 3
    x = torch.cat(
        [torch.logspace(-6, -0.31, 200, dtype=torch.float64), 1 - torch.logspace(-6, -0.31, 200, dtype=torch.float64)]
    )
    deltas = torch.logspace(-4, math.log10(3.0), 25, dtype=torch.float64)
    for delta in deltas.tolist():
        # one [V = 3] verifier row per x: q = (x, (1-x)/2, (1-x)/2), drafted token 0
        q = torch.stack([x, (1 - x) / 2, (1 - x) / 2], -1).unsqueeze(1)  # [N, 1, 3]
        q = torch.cat([q, q], dim=1)  # bonus row unused
        p = torch.full_like(q[:, :1], 1 / 3)
        draft = torch.zeros(len(x), 1, dtype=torch.int64)
        h = target_distribution("cactus-exact", p, q, draft, delta=delta, divergence=divergence)[:, 0]
        assert torch.allclose(h.sum(-1), torch.ones(len(x), dtype=torch.float64))
        D = _full_div(divergence, h, q[:, 0])
        assert (D <= delta * (1 + 1e-9) + 1e-12).all(), f"{divergence} budget exceeded at delta={delta}"
        # tight: where the boost did not reach 1, the budget is used to the last bit
        g = h[:, 0]
        interior = g < 1 - 1e-9
        assert torch.allclose(D[interior], torch.full_like(D[interior], delta), rtol=1e-7, atol=1e-12)
        assert torch.allclose(D, _bern_div(divergence, g, x), rtol=1e-7, atol=1e-12)


def test_cactus_exact_matches_the_paper_closed_form_to_first_order():
    x = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
    for delta in (1e-6, 1e-5):
        boost_exact = cactus_target_prob(x, delta, "kl") - x
        boost_paper = cactus_target_prob(x, delta) - x
        # the next term is O(delta): relative difference shrinks like sqrt(delta)
        assert ((boost_exact / boost_paper - 1).abs() < 20 * math.sqrt(delta)).all()
    # far from small delta they differ: the paper's form overshoots the KL budget at large g
    x = torch.tensor([0.4], dtype=torch.float64)
    g = cactus_target_prob(x, 0.5)
    assert _bern_div("kl", g, x).item() > 0.5


def test_cactus_raises_acceptance_over_sps():
    p, q, draft = random_dists(256, 4, 30, seed=6)
    sps = verify("sps", p, q, draft, generator=gen(1)).acceptance_probs
    cac = verify("cactus", p, q, draft, generator=gen(1), delta=0.5).acceptance_probs
    assert (cac >= sps - 1e-12).all() and (cac > sps + 1e-3).any()


def test_target_distribution_is_a_distribution_and_only_for_rules_that_have_one():
    p, q, draft = random_dists(8, 3, 20, seed=7)
    for rule, params in [("sps", {}), ("cactus", {"delta": 2.0}), ("cactus-exact", {}), ("interp", {"alpha": 0.3})]:
        h = target_distribution(rule, p, q, draft, **params)
        assert h.shape == p.shape and (h >= 0).all()
        assert torch.allclose(h.sum(-1), torch.ones(8, 3, dtype=torch.float64))
    assert torch.equal(target_distribution("sps", p, q, draft), q[:, :3])
    for rule in ("tas", "topk"):
        with pytest.raises(ValueError, match=rule):
            target_distribution(rule, p, q, draft)


# --------------------------------------------------------------------------- baselines


def test_tas_rejection_emits_verifier_argmax():
    # flat verifier (high entropy) and a draft token with q_n = 0.01 < threshold
    V = 10
    q_row = torch.full((V,), 0.01, dtype=torch.float64)
    q_row[3] = 0.91
    q = torch.stack([q_row, q_row]).unsqueeze(0)
    p = one_hot([0], V).unsqueeze(0)
    v = verify("tas", p, q, torch.tensor([[0]]), generator=gen())
    assert v.tokens.tolist() == [[3, -1]]


def test_topk_accepts_inside_the_verifier_topk_only():
    V = 6
    q_row = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1, 0.0], dtype=torch.float64)
    q = torch.stack([q_row, q_row]).unsqueeze(0)
    for n, expect in [(0, 1), (2, 1), (3, 0), (5, 0)]:
        p = torch.full((1, 1, V), 1 / V, dtype=torch.float64)
        v = verify("topk", p, q, torch.tensor([[n]]), generator=gen(), topk=3)
        assert v.num_accepted.item() == expect
        if not expect:  # the correction comes from the top-3 set
            assert v.tokens[0, 0].item() in (0, 1, 2)


# --------------------------------------------------------------------------- contract


def test_same_generator_state_same_verdict():
    p, q, draft = random_dists(16, 4, 40, seed=8)
    for rule, params in ALL_RULES:
        a = verify(rule, p, q, draft, generator=gen(3), **params)
        b = verify(rule, p, q, draft, generator=gen(3), **params)
        assert torch.equal(a.tokens, b.tokens), rule


@pytest.mark.parametrize(
    "rule,params,needle",
    [
        ("nope", {}, "unknown acceptance rule 'nope'"),
        ("cactus", {"delta": -0.1}, "'cactus': parameter 'delta' must be a number in 0.."),
        ("cactus-exact", {"delta": float("nan")}, "'delta' must be"),
        ("cactus-exact", {"divergence": "js"}, "'divergence' must be one of kl, chi2, hellinger, tv"),
        ("interp", {"alpha": 1.5}, "'interp': parameter 'alpha' must be a number in [0, 1]"),
        ("topk", {"topk": 0}, "'topk': parameter 'topk' must be an integer >= 1"),
        ("tas", {"epsilon": 0.0}, "'epsilon' must be"),
        ("sps", {"delta": 1.0}, "rule 'sps' has no parameter 'delta'"),
    ],
)
def test_bad_rule_or_parameter_is_a_clear_value_error(rule, params, needle):
    p, q, draft = random_dists(1, 2, 5, seed=0)
    with pytest.raises(ValueError) as err:
        verify(rule, p, q, draft, **params)
    assert needle in str(err.value)


def test_registry_and_defaults():
    assert set(RULES) == {"sps", "cactus", "cactus-exact", "tas", "topk", "interp"}
    assert resolve_params("tas") == {"epsilon": 0.09, "alpha": 0.3}
    assert resolve_params("cactus-exact") == {"delta": 1.0, "divergence": "kl"}
    assert resolve_params("topk") == {"topk": 5}


def test_shape_errors_are_value_errors():
    p, q, draft = random_dists(2, 3, 5, seed=0)
    with pytest.raises(ValueError, match="shape mismatch"):
        verify("sps", p, q[:, :3], draft)


# --------------------------------------------------------------------------- degenerate inputs


@st.composite
def degenerate_case(draw):
    B = draw(st.integers(1, 4))
    k = draw(st.integers(0, 4))
    V = draw(st.integers(1, 12))
    kind = st.sampled_from(["onehot", "zeros", "dense", "uniform"])

    def dist(rows):
        out = []
        for _ in range(rows):
            what = draw(kind)
            if what == "onehot":
                r = torch.zeros(V)
                r[draw(st.integers(0, V - 1))] = 1.0
            elif what == "uniform":
                r = torch.full((V,), 1.0 / V)
            else:
                w = torch.tensor(draw(st.lists(st.floats(0, 1), min_size=V, max_size=V)))
                if what == "zeros":  # top-k/top-p style filtering: keep a few, zero the rest
                    keep = draw(st.integers(1, V))
                    w[torch.argsort(w, descending=True)[keep:]] = 0.0
                if w.sum() <= 0:
                    w[draw(st.integers(0, V - 1))] = 1.0
                r = w / w.sum()
            out.append(r)
        return torch.stack(out) if out else torch.zeros(0, V)

    p = torch.stack([dist(k) for _ in range(B)])  # [B, k, V]
    q = torch.stack([dist(k + 1) for _ in range(B)])  # [B, k+1, V]
    # drafted tokens usually from p, sometimes arbitrary (p_n = 0 must be safe too)
    draft = torch.tensor([[draw(st.integers(0, V - 1)) for _ in range(k)] for _ in range(B)], dtype=torch.int64).view(
        B, k
    )
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
    return p.to(dtype), q.to(dtype), draft, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=150, deadline=None)
@given(degenerate_case(), st.sampled_from(ALL_RULES))
def test_degenerate_inputs_never_break_the_contract(case, rule_params):
    p, q, draft, seed = case
    rule, params = rule_params
    B, k, V = p.shape
    v = verify(rule, p, q, draft, generator=gen(seed), **params)
    m = v.num_accepted
    assert m.dtype == torch.int64 and ((m >= 0) & (m <= k)).all()
    assert not torch.isnan(v.acceptance_probs).any()
    assert ((v.acceptance_probs >= 0) & (v.acceptance_probs <= 1)).all()
    for b in range(B):
        mb = int(m[b])
        assert v.tokens[b, :mb].tolist() == draft[b, :mb].tolist()
        extra = int(v.tokens[b, mb])
        assert 0 <= extra < V
        assert (v.tokens[b, mb + 1 :] == -1).all()
        # the extra token is one the verifier row it came from allows, for the rules whose
        # replacement lies inside the verifier's support (KL/chi2 budgets, SpS, tas, topk)
        if rule in ("sps", "cactus", "tas", "topk") or params.get("divergence") in ("kl", "chi2"):
            row = q[b, mb].double()
            assert row[extra] > 0 or row.sum() == 0
        if rule == "sps" or (rule == "cactus-exact" and params.get("divergence") == "kl"):
            # never accept a drafted token the verifier rules out
            accepted = v.tokens[b, :mb]
            assert all(q[b, i, int(t)] > 0 for i, t in enumerate(accepted))


# --------------------------------------------------------------------------- the realized distribution


def brute_force_emitted(rule: str, p: torch.Tensor, q: torch.Tensor, **params) -> torch.Tensor:
    """O(V^2): for every drafted token n, run the rule's acceptance and residual literally."""
    prm = resolve_params(rule, params)
    spec = RULES[rule]
    V = p.shape[-1]
    out = torch.zeros(V, dtype=torch.float64)
    for n in range(V):
        if p[n] == 0:
            continue
        a = spec.accept(prm, p.view(1, 1, V), q.view(1, 1, V), torch.tensor([[n]]))[0, 0]
        r = spec.residual(prm, p.view(1, V).clone(), q.view(1, V).clone(), torch.tensor([n]))[0]
        r = r / r.sum() if r.sum() > 0 else r
        out[n] += p[n] * a
        out += p[n] * (1 - a) * r
    return out


@pytest.mark.parametrize("rule,params", ALL_RULES)
def test_emitted_distribution_equals_brute_force(rule, params):
    from cactus_cli.core.exact import emitted_distribution

    g = gen(21)
    for case in range(25):
        V = int(torch.randint(2, 16, (1,), generator=g))
        p = torch.softmax(2.5 * torch.randn(V, generator=g, dtype=torch.float64), -1)
        q = torch.softmax(2.5 * torch.randn(V, generator=g, dtype=torch.float64), -1)
        if case % 3 == 0 and V > 3:  # filtered rows, as top-k / top-p leave them
            p[torch.randperm(V, generator=g)[: V // 3]] = 0
            p /= p.sum()
        if case % 4 == 0 and V > 3:
            q[torch.randperm(V, generator=g)[: V // 3]] = 0
            q /= q.sum()
        fast = emitted_distribution(rule, p, q, **params)
        slow = brute_force_emitted(rule, p, q, **params)
        assert (fast - slow).abs().max() < 1e-6, (rule, case)
        assert abs(fast.sum().item() - 1) < 1e-9


def test_emitted_distribution_is_q_for_sps_and_batched():
    from cactus_cli.core.exact import emitted_distribution

    p, q, _ = random_dists(6, 3, 40, seed=22)
    h = emitted_distribution("sps", p, q[:, :3])  # [6, 3, 40] in one call
    assert h.shape == p.shape and torch.allclose(h, q[:, :3], atol=1e-12)


def test_emitted_distribution_matches_monte_carlo_of_verify():
    # 60000 verification steps of one case; the first emitted token's histogram against the
    # exact h_alg (false-failure odds 1e-6), for Cactus where h depends on the drafted token
    from cactus_cli.core.exact import emitted_distribution

    p1 = torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1, 0.0]], dtype=torch.float64)
    q1 = torch.tensor([[0.3, 0.1, 0.05, 0.25, 0.0, 0.3], [1 / 6] * 6], dtype=torch.float64)
    for rule, params in [("cactus", {"delta": 0.5}), ("cactus-exact", {"delta": 0.3}), ("topk", {"topk": 2})]:
        v = _first_token_samples(rule, params, p1, q1, 60000, seed=23)
        exact = emitted_distribution(rule, p1[0], q1[0], **params)
        assert_matches(v.tokens[:, 0], exact, false_failure_odds=1e-6)
        assert (exact - q1[0]).abs().sum() > 0.05  # not q: the test tells rules apart


def test_realized_kl_is_zero_at_delta_zero_and_grows_with_delta():
    from cactus_cli.core.exact import divergences, emitted_distribution

    p, q, _ = random_dists(1, 1, 30, seed=24)
    p, q = p[0, 0], q[0, 0]
    for rule in ("cactus", "cactus-exact"):
        kls = []
        for delta in (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0):
            kl, tv = divergences(emitted_distribution(rule, p, q, delta=delta), q)
            kls.append(kl.item())
        assert kls[0] < 1e-12
        assert all(b >= a - 1e-12 for a, b in zip(kls, kls[1:])), kls
        assert kls[-1] > 1e-3


def test_a_plain_steps_token_is_drawn_exactly_from_the_top_k():
    """A plain step draws among the top-k probabilities only (no full row): the same distribution
    as the full row they come from (false-failure odds 1e-6), and the same draw for the same seed."""
    from cactus_cli.core.sampling import SamplingParams, probs_from_logits, sample_among, top_probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 3
    sp = SamplingParams(temperature=0.7, top_k=8, top_p=0.9)
    small, ids = top_probs(logits, sp)
    draws = torch.cat([sample_among(small, ids, g) for _ in range(20000)])
    assert_matches(draws, probs_from_logits(logits, sp), false_failure_odds=1e-6)
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [sample_among(small, ids, a).item() for _ in range(20)] == [
        sample_among(small, ids, b).item() for _ in range(20)
    ]


def test_the_per_draft_budget_holds_where_the_emitted_mixture_may_exceed_it():
    """The meter's draft budget is KL(h^(n) || q) of the target each draft is verified against: at
    most delta for exact-KL Cactus, at most the closed form's own maximum for the paper's rule
    (max over q of KL_bern(g(q) || q): 0.693 at delta 0.5). The emitted distribution h_alg is a
    mixture over the draws, each with its own h^(n), and is not bounded by delta: a draft split
    over two tokens the verifier gives 0.05 each moves it past delta (docs/algorithm.md)."""
    from cactus_cli.core.exact import divergences, emitted_distribution, meter

    def bern(g: float, q: float) -> float:
        return sum(a * math.log(a / b) for a, b in ((g, q), (1 - g, 1 - q)) if a > 0)

    for delta in (0.25, 0.5, 1.0, 3.0):  # the rule's stated bound is the closed form's maximum over q
        grid = (i / 20000 for i in range(1, 20000))
        closed_max = max(bern(min(1.0, q + math.sqrt(2 * delta * q * (1 - q))), q) for q in grid)
        stated = RULES["cactus"].budget_bound({"delta": delta})
        assert closed_max <= stated + 1e-12 and stated - closed_max < 1e-3, (delta, closed_max, stated)
    assert abs(RULES["cactus"].budget_bound({"delta": 0.5}) - math.log(2)) < 1e-12  # at q = 1/2, g = 1
    assert RULES["cactus-exact"].budget_bound(resolve_params("cactus-exact", {"delta": 0.5})) == 0.5
    assert RULES["cactus-exact"].budget_bound(resolve_params("cactus-exact", {"divergence": "tv"})) is None
    assert RULES["tas"].budget_bound(resolve_params("tas")) is None
    p, q, _ = random_dists(200, 4, 40, seed=31)
    drafts = torch.multinomial(p.reshape(-1, 40), 1, generator=torch.Generator().manual_seed(2)).view(200, 4)
    for rule in ("cactus-exact", "cactus", "sps"):
        bound = RULES[rule].budget_bound(resolve_params(rule, {} if rule == "sps" else {"delta": 0.5}))
        worst = 0.0
        for b in range(200):
            qs = torch.cat([q[b], q[b, -1:]])  # [k+1, V] (the bonus row: not metered)
            out = meter(rule, {} if rule == "sps" else {"delta": 0.5}, p[b][None].float(), qs[None].float(),
                        torch.log(qs.float()), [0] * 4, 3, 4, drafts[b].tolist())  # fmt: skip
            assert len(out[3]) == 4
            worst = max(worst, *out[3])
        assert worst <= bound + 1e-6, (rule, worst, bound)
        assert worst > 0.8 * bound if bound else worst < 1e-9, (rule, worst)  # (reached, not trivially 0)
    split = torch.tensor([0.5, 0.5] + [0.0] * 18, dtype=torch.float64)
    qv = torch.tensor([0.05, 0.05] + [0.9 / 18] * 18, dtype=torch.float64)
    kl, _ = divergences(emitted_distribution("cactus-exact", split, qv, delta=0.5), qv)
    assert kl.item() > 2 * 0.5  # (1.21: more than twice delta)
