"""Adding a rule is one definition and one registry line: a rule defined only in this file runs
through ``verify``, an SpS-style exactness check of its own emitted distribution, the divergence
meter, and the engine end to end, with nothing else in the code base knowing its name."""

from __future__ import annotations

import pytest
import torch

from cactus_cli.core.acceptance import RULES, FixedTargetRule, Param
from cactus_cli.core.exact import divergences, emitted_distribution, meter
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.core.verify import target_distribution, verify
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.pair.loader import load_pair
from tests.stats_helpers import assert_matches


class Geometric(FixedTargetRule):
    """h = normalize(p^w q^(1-w)): between the draft and the verifier, and the same whatever token
    was drafted, so generalized speculative sampling emits h itself."""

    name, summary = "geo", "h = normalize(p^w q^(1 - w)), a geometric mean of draft and verifier"
    params = (Param("w", 0.5, lambda v: isinstance(v, float) and 0 <= v <= 1, "a number in [0, 1]"),)

    def h(self, prm, p, q):
        h = p ** prm["w"] * q ** (1 - prm["w"])
        return h / h.sum(-1, keepdim=True).clamp(min=1e-30)


@pytest.fixture
def geo(monkeypatch):
    monkeypatch.setitem(RULES, "geo", Geometric())  # the one registry line


def test_a_rule_defined_here_runs_through_verify_exactness_and_the_meter(geo):
    p1 = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1, 0.0]], dtype=torch.float64)
    q1 = torch.tensor([[0.05, 0.15, 0.3, 0.1, 0.2, 0.2], [1 / 6] * 6], dtype=torch.float64)
    h = emitted_distribution("geo", p1[0], q1[0], w=0.5)
    assert torch.allclose(h, (p1[0] * q1[0]).sqrt() / (p1[0] * q1[0]).sqrt().sum())
    assert torch.allclose(target_distribution("geo", p1[None], q1[None], torch.tensor([[1]]), w=0.5)[0, 0], h)
    # 60000 steps of one case: the first emitted token's histogram against the rule's own exact
    # distribution (false-failure odds 1e-6), which is far from q (the test tells it from SpS)
    N = 60000
    g = torch.Generator().manual_seed(3)
    p = p1.expand(N, 1, 6).contiguous()
    q = q1.expand(N, 2, 6).contiguous()
    draft = torch.multinomial(p.reshape(-1, 6), 1, replacement=True, generator=g).view(N, 1)
    v = verify("geo", p, q, draft, generator=g, w=0.5)
    assert_matches(v.tokens[:, 0], h, false_failure_odds=1e-6)
    assert (h - q1[0]).abs().sum() > 0.1
    kl, tv = divergences(h, q1[0])
    logits = torch.log(q1.float().clamp(min=1e-9))
    measured = meter("geo", {"w": 0.5}, p1.unsqueeze(0).float(), q1.unsqueeze(0).float(), logits, [2], 0, 1)
    assert abs(measured[0][0] - kl.item()) < 1e-5 and abs(measured[1][0] - tv.item()) < 1e-5


def test_a_rule_defined_here_runs_in_the_engine(geo, tiny):
    pair = load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32")
    params = GenerationParams(
        sampling=SamplingParams(1.0, 0, 1.0),
        rule="geo",
        rule_kwargs={"w": 0.5},
        num_draft_tokens=3,
        max_tokens=24,
        ignore_eos=True,
        measure=True,
    )
    events = list(SpeculativeEngine(pair).generate(pair.tokenizer("the cat sat")["input_ids"], params))
    assert sum(len(ev.emitted) for ev in events) == 24
    assert sum(len(ev.accepted) for ev in events) > 0
    assert all(kl >= 0 for ev in events for kl in ev.realized_kl) and any(
        kl > 0 for ev in events for kl in ev.realized_kl
    )


def test_a_rule_defined_here_runs_through_a_profile_the_cli_and_session(geo, tiny, tmp_path):
    """Its parameter is a profile key, a --param, a chat /set and a Session keyword like any other:
    nothing outside the registry names it."""
    import json

    from typer.testing import CliRunner

    from cactus_cli.api import Session
    from cactus_cli.cli.main import app

    profile = tmp_path / "geo.yaml"
    profile.write_text(f"verifier: {tiny['verifier']}\ndraft: {tiny['draft_close']}\nrule: geo\nw: 0.25\n")
    base = ["generate", "the cat sat", "--profile", str(profile), "--device", "cpu", "--dtype", "float32"]
    base += ["-k", "3", "-n", "6", "--seed", "1", "--json"]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["settings"]["rule_params"] == {"w": 0.25}  # from the profile
    r = CliRunner().invoke(app, [*base, "--param", "w=0.75"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["settings"]["rule_params"] == {"w": 0.75}  # the flag over the profile
    r = CliRunner().invoke(app, [*base, "--param", "w=2"])
    assert r.exit_code == 2 and "w must be a number in [0, 1], got 2" in r.output, r.output
    r = CliRunner().invoke(app, [*base, "--delta", "0.5"])
    assert r.exit_code == 2 and "--delta has no effect with rule 'geo'" in r.output, r.output
    assert "geo" in CliRunner().invoke(app, ["generate", "--help"]).output  # --help lists the registry
    session = Session.load(str(profile), device="cpu", dtype="float32", num_draft_tokens=3, max_tokens=6)
    assert session.settings.rule_kwargs() == {"w": 0.25}
    assert session.with_settings(rule_params={"w": 0.5}).rule_kwargs() == {"w": 0.5}
    assert len(session.text("the cat sat")) > 0
