"""The k policy: the choice of k on synthetic cost curves and acceptance, the cost model's
statistics and cache, the engine's catch-up after k = 0 steps, the probe, and the dtype probe."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cactus_cli.core.paths import cache_path
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.backends.torch.quant import quantize
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.kpolicy import costs as policy
from cactus_cli.infer.kpolicy.costs import CostModel, Step, best_k, probe_widths
from cactus_cli.infer.kpolicy.costs import slope as costs_slope
from cactus_cli.infer.kpolicy.policy import (
    EXPLORE_BUDGET,
    MAX_BACKOFF,
    AdaptiveK,
    FixedK,
    Overhead,
)
from cactus_cli.infer.kpolicy.rates import Acceptance, Calibration, expected_tokens
from cactus_cli.infer.kpolicy.store import CostStore
from cactus_cli.infer.load.devices import fastest_cpu_dtype, resolve_dtype
from cactus_cli.infer.pair.loader import load_pair
from tests.helpers import (
    quantize_tiny,
    write_costs,
)
from tests.test_engine import hf_greedy, prompt_ids

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


def cost_model(verify: dict[int, float], draft: float) -> CostModel:
    cm = CostModel()
    for w, t in verify.items():
        cm.add_verify(w, t)
    cm.add_draft(draft)
    return cm


# ---------------------------------------------------------------------- choosing k


def test_flat_verify_cost_and_high_acceptance_draft_long():
    flat = cost_model({1: 0.100, 9: 0.105}, draft=0.01)  # a GPU: width is nearly free
    assert best_k(flat, 0.9, 8) == 8
    assert best_k(flat, 0.9, 3) == 3  # never above k_max


def test_steep_verify_cost_means_plain_decoding():
    # an AVX2 CPU as measured: 5 tokens cost 4.5x one, a draft token half a verify
    steep = cost_model({1: 0.154, 5: 0.685, 11: 1.203}, draft=0.078)
    assert best_k(steep, 0.9, 8) == 0
    assert best_k(steep, [0.9, 0.95, 0.97, 0.98], 8) == 0  # even runs of easy text do not pay there


def test_no_acceptance_means_no_drafting_even_when_drafts_are_free():
    flat = cost_model({1: 0.1, 9: 0.1}, draft=1e-9)
    assert best_k(flat, 0.0, 8) == 0


def test_moderate_costs_pick_a_moderate_k():
    # the AVX-512 BF16 CPU of the README: 8 tokens ~1.1x one, a draft token ~0.39 of a verify
    cm = cost_model({1: 0.100, 9: 0.110}, draft=0.039)
    assert best_k(cm, 0.9, 8) in (3, 4, 5)
    assert best_k(cm, 0.5, 8) in (0, 1)


def test_a_convex_cost_curve_is_read_per_width_not_through_a_line():
    # flat to 3 tokens, steep after (an AVX2 CPU's int8 kernels): 2 drafts are nearly free
    verify = {1: 0.100, 2: 0.100, 3: 0.100, 5: 0.400, 9: 1.000}
    cm = cost_model(verify, draft=0.01)
    assert [cm.t_v(w) for w in (1, 2, 3)] == pytest.approx([0.1, 0.1, 0.1])  # what was measured
    assert cm.t_v(4) == pytest.approx(0.2)  # between measured widths: linear (0.25), at most its split (3 + 1)
    assert cm.t_v(7) == pytest.approx(0.3)  # three verifies of 3, 3 and 1 (linear: 0.55), until 7 is timed
    assert best_k(cm, 0.8, 8) == 2
    # the straight line through every width (the model before) halves t_v(1) and picks 0
    pts = [(w, t, 1) for w, t in verify.items()]
    slope = costs_slope(pts)
    intercept = sum(verify.values()) / 5 - slope * sum(verify) / 5

    def line(w):
        return max(intercept + slope * w, 1e-9)

    speed = {k: expected_tokens(0.8, k) / (k * 0.01 + line(k + 1)) for k in range(9)}
    assert line(1) < 0.08 and max(speed, key=speed.get) == 0


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0, rel=2e-2)  # clamped just below 1


# ---------------------------------------------------------------------- the cost model


def test_cost_model_fits_a_line_and_ignores_outliers():
    cm = cost_model({1: 1.0, 5: 3.0}, draft=0.5)
    assert cm.t_v(3) == pytest.approx(2.0)  # linear between measured widths
    assert cm.t_v(7) == pytest.approx(4.0)  # and beyond them
    noisy = cost_model({1: 0.258, 2: 0.200, 3: 0.246, 5: 0.235, 9: 0.310}, draft=0.086)  # a real probe
    assert all(noisy.t_v(w) <= noisy.t_v(w + 1) for w in range(1, 9))  # never cheaper to verify more
    assert cost_model({1: 0.3, 5: 0.2}, draft=0.1).t_v(9) == pytest.approx(0.25)  # no negative slope
    for _ in range(6):
        cm.add_verify(1, 1.0)
    cm.add_verify(1, 50.0)  # one stray slow step (a page fault, another process)
    assert cm.t_v(1) == pytest.approx(1.0)  # the median does not move
    assert cm.t_d() == 0.5
    unknown = CostModel()
    assert not unknown.knows("model") and best_k(unknown, 0.9, 8) == 4  # nothing known: a middling k


def test_acceptance_estimate_follows_recent_steps():
    acc = Acceptance()
    for _ in range(100):
        acc.add(0, 1)  # every draft rejected
    assert acc.a < 0.05
    for _ in range(100):
        acc.add(4, 4)  # then every draft accepted
    assert acc.a > 0.9


def test_acceptance_per_position_sees_runs():
    # half the steps reject the first draft, the other half accept all four: the pooled rate is
    # 4/5, but once the first draft is accepted the rest always are
    acc = Acceptance()
    for _ in range(50):
        acc.add(0, 4)
        acc.add(4, 4)
    r = acc.rates(6)
    assert r[0] == pytest.approx(0.5, abs=0.05) and min(r[1:4]) > 0.9
    assert r[4] == pytest.approx(r[3], abs=0.05)  # an untested position leans on the one before it
    assert expected_tokens(r, 4) == pytest.approx(3.0, abs=0.1)  # the truth: 1 + 0.5 * 4
    assert expected_tokens(acc.a, 4) > 3.3  # the i.i.d. model with the pooled rate gets it wrong


def test_plain_decoding_still_probes_k1_now_and_then():
    steep = cost_model({1: 0.1, 2: 0.2, 5: 0.5}, draft=0.05)
    policy = AdaptiveK()
    policy.store.costs = steep
    picks = [policy.choose("greedy", 8) for _ in range(400)]
    assert picks.count(0) > 300  # mostly plain decoding
    assert 1 in picks  # but acceptance keeps being measured
    # the probes are spaced so they cost about EXPLORE_BUDGET of plain decoding
    assert picks.count(1) <= 400 * 0.03 * 0.1 / (0.05 + 0.2 - 0.1) + 1


def test_probes_back_off_while_plain_decoding_keeps_winning_and_not_after_drafting_wins():
    steep = cost_model({1: 0.1, 2: 0.2, 5: 0.5}, draft=0.05)
    policy = AdaptiveK()
    policy.store.costs = steep
    every = math.ceil((0.05 + 0.2 - 0.1) / (EXPLORE_BUDGET * 0.1))  # 50 steps at first
    picks = [policy.choose("greedy", 8) for _ in range(2000)]
    probes = [i for i, k in enumerate(picks) if k == 1]
    gaps = [b - a for a, b in zip([-1] + probes, probes)]
    assert gaps[:5] == [every, 2 * every, 4 * every, 8 * every, 8 * every]  # doubling, capped at MAX_BACKOFF
    assert MAX_BACKOFF == 8
    # drafting wins once (the text became easy): the spacing starts over
    policy.store.costs = cost_model({1: 0.1, 2: 0.1, 5: 0.1}, draft=0.001)
    assert policy.choose("greedy", 8) > 0
    policy.store.costs = steep
    picks = [policy.choose("greedy", 8) for _ in range(every)]
    assert picks[-1] == 1 and picks.count(1) == 1


def test_drafting_still_takes_a_plain_step_now_and_then():
    flat = cost_model({1: 0.1, 9: 0.1}, draft=0.01)
    policy = AdaptiveK()
    policy.store.costs = flat
    for _ in range(100):
        policy.observe(Step("greedy", 8, 8, 0.08, 0.1))  # every draft accepted
    policy.store.costs = flat
    picks = [policy.choose("greedy", 8) for _ in range(400)]
    assert 0 < picks.count(0) <= 400 // 64  # t_v(1) is re-measured, at ~1.5% of the steps
    assert picks.count(8) == 400 - picks.count(0)


def test_leaving_plain_decoding_is_charged_the_drafts_catch_up():
    over = Overhead()
    assert over.predict(40) == 0.0  # nothing charged before a few drafting steps were seen
    for behind in (0, 10, 20, 0, 10, 20, 1):  # 10 ms per token behind, 5 ms on top
        over.add(behind, 0.005 + 0.01 * behind)
    assert over.predict(0) == pytest.approx(0.005) and over.predict(30) == pytest.approx(0.305)
    policy = AdaptiveK()
    policy.store.costs = cost_model({1: 0.1, 2: 0.12, 5: 0.2}, draft=0.02)
    policy.store.acceptance["greedy model"] = Acceptance([3.0] * 4, [6.0] * 4)  # a = (3 + 2 * 0.6) / 8 = 0.525, ...
    policy.overheads["model"] = over
    policy.behind = 0
    assert policy.choose("greedy", 4) > 0  # drafting on: no catch-up, and it pays
    policy.behind = 30
    assert policy.choose("greedy", 4) == 0  # after 30 plain steps: the catch-up eats the gain
    # the policy learns it from the steps themselves: what a drafting step took beyond k t_d
    fresh = AdaptiveK()
    fresh.store.costs = cost_model({1: 0.1, 2: 0.12, 5: 0.2}, draft=0.02)
    for _ in range(3):
        for _ in range(5):
            fresh.observe(Step("greedy", 0, 0, 0.0, 0.1))  # five plain steps ...
        fresh.observe(Step("greedy", 1, 1, 0.02 + 0.05, 0.12, fed=6))  # ... then a draft that caught up on them
    assert fresh.behind == 0 and fresh.overheads["model"].predict(5) == pytest.approx(0.05)


def test_calibration_starts_at_the_drafters_estimate_and_learns_the_rules_acceptance():
    cal = Calibration()
    assert cal.rates([0.95, 0.5, 0.15]) == pytest.approx([0.95, 0.5, 0.15])  # no steps yet: the estimate
    rng = random.Random(0)
    for _ in range(400):  # tokens the tree gives 0.9 are accepted half the time; 0.3: 10%
        first = rng.random() < 0.5
        second = first and rng.random() < 0.1
        cal.add([0.9, 0.3], int(first) + int(second))
    high, low = cal.rates([0.9, 0.3])
    assert high == pytest.approx(0.5, abs=0.1) and low == pytest.approx(0.1, abs=0.1)
    assert cal.rates([0.6])[0] == pytest.approx(0.6)  # an untouched tenth keeps the estimate


def test_drafts_with_an_estimate_are_sized_by_it():
    flat = cost_model({1: 0.1, 2: 0.12, 9: 0.2}, draft=0.0)  # a wider verify costs a little more
    policy = AdaptiveK()
    policy.store.costs = flat
    likely, unlikely = [0.99] * 6, [0.15, 0.2]
    assert policy.choose("greedy", 8, "suffix", likely) == 6  # never past the path
    assert policy.choose("greedy", 8, "suffix", unlikely) == 0  # not worth a wider verify
    assert policy.choose("greedy", 3, "suffix", likely) == 3  # nor past k_max
    for _ in range(300):  # the rule accepts nothing the tree is sure of: the estimate is overruled
        policy.observe(Step("greedy", 6, 0, 0.0, 0.18, source="suffix", confidence=likely))
    assert policy.choose("greedy", 8, "suffix", likely) == 0
    assert policy.store.calibrations["greedy suffix fresh"].rates([0.5]) == pytest.approx([0.5])  # others untouched


def test_inside_a_run_of_accepted_drafts_the_same_estimate_drafts_longer():
    """After a fully accepted draft the text is being copied: the calibration learned there
    (estimates of 0.94 all kept) sizes the next draft, not the one learned after rejections
    (where a match of the same length was prose matched by chance: its first token rejected)."""
    policy = AdaptiveK()
    policy.store.costs = cost_model({1: 0.08, 2: 0.12, 16: 0.31, 32: 0.45, 64: 0.7}, draft=0.0)
    sure = [0.94] * 63
    for _ in range(200):
        for _ in range(4):  # after a rejection: rejected again, three times in four
            policy.observe(Step("greedy", 16, 0, 0.0, 0.31, source="suffix", confidence=sure))
        policy.observe(Step("greedy", 2, 2, 0.0, 0.12, source="suffix", confidence=sure))  # a short one kept ...
        policy.observe(Step("greedy", 63, 63, 0.0, 0.7, source="suffix", confidence=sure))  # ... then the copy
    assert policy.run  # (the last step kept all 63)
    assert policy.choose("greedy", 63, "suffix", sure) >= 47  # in a run: as long as it pays
    policy.observe(Step("greedy", 5, 2, 0.0, 0.2, source="suffix", confidence=sure))  # a rejection ends the run
    assert not policy.run and policy.choose("greedy", 63, "suffix", sure) <= 2


def test_calibrations_are_kept_in_the_cost_store(tmp_path):
    path = tmp_path / "costs.json"
    store = CostStore(path, {"pair": "x"})
    policy = AdaptiveK(store)
    for _ in range(3):
        policy.observe(Step("greedy", 8, 8, 0.0, 0.2, source="suffix", confidence=[0.5] * 8))
    store.save()
    again = CostStore(path)
    assert again.calibrations.keys() == store.calibrations.keys()
    assert again.calibrations["greedy suffix run"].rates([0.55]) == pytest.approx(
        store.calibrations["greedy suffix run"].rates([0.55])
    )
    assert again.calibrations["greedy suffix run"].rates([0.55])[0] > 0.6  # (all kept: it learned)


def test_a_probe_times_long_widths_up_to_the_longest_draft():
    assert probe_widths(8) == list(range(1, 10))
    assert probe_widths(16) == list(range(1, 18))
    assert probe_widths(64) == list(range(1, 18)) + [24, 32, 48, 65]  # measured, not extrapolated
    assert probe_widths(40) == list(range(1, 18)) + [24, 32, 41]


def test_cache_round_trip(tmp_path):
    path = tmp_path / "costs.json"
    policy = CostStore(path, {"pair": "x"})
    policy.observe(Step("greedy", 3, 2, 0.3, 0.2))
    policy.observe(Step("greedy", 0, 0, 0.0, 0.1))
    policy.save()
    again = CostStore(path)
    assert again.costs.knows("model") and again.costs.source == "cache"
    assert again.costs.t_v(4) == pytest.approx(0.2) and again.costs.t_d() == pytest.approx(0.1)
    assert again.acceptance["greedy model"].a == pytest.approx(policy.acceptance["greedy model"].a)
    assert again.acceptance["greedy model"].rates(3) == pytest.approx(policy.acceptance["greedy model"].rates(3))
    path.write_text("{not json")
    assert not CostStore(path).costs.knows("model")  # a broken cache is ignored, not fatal


# ---------------------------------------------------------------------- stale or contended costs (issue 68)


def cached_model(verify: dict[int, float], draft: float | None = None) -> CostModel:
    """A cost model as read from a cache file (three timings a width)."""
    doc = {"verify": {str(w): [t] * 3 for w, t in verify.items()}}
    if draft is not None:
        doc["draft"] = {"model": [draft] * 3}
    return CostModel.from_json(doc, "cache")[0]


def numpy_interp(width: int, curve: dict[int, float]) -> float:
    """The curve's cost of ``width`` tokens, linear between its widths."""
    ws = sorted(curve)
    lo = max(w for w in ws if w <= width)
    hi = min((w for w in ws if w >= width), default=lo)
    return curve[lo] if hi == lo else curve[lo] + (curve[hi] - curve[lo]) * (width - lo) / (hi - lo)


def test_this_runs_first_timing_of_a_width_replaces_the_cached_ones():
    cm = cached_model({1: 0.1, 2: 0.5, 4: 0.9}, draft=0.05)
    assert cm.cached == {1, 2, 4} and not cm.fresh(2)
    cm.add_verify(2, 0.12)  # one timing of this run outweighs every cached one of the width
    assert cm.fresh(2) and cm.t_v(2) == pytest.approx(0.12) and list(cm.verify[2]) == [0.12]
    cm.add_draft(0.01)
    assert cm.t_d() == pytest.approx(0.01)
    assert cm.describe(4)["cached_widths"] == [1, 4]


def test_a_width_this_run_has_not_timed_costs_no_more_than_its_split():
    # a cache written beside a busy process: widths 3 and up at 5x (the AVX2 EPYC's curve)
    true = {1: 0.0436, 2: 0.0791, 4: 0.110, 8: 0.204, 16: 0.286}
    cm = cached_model({w: t * (5 if w >= 3 else 1) for w, t in true.items()})
    assert cm.t_v(16) == pytest.approx(5 * 0.286)  # nothing timed yet: the cache as it is
    assert best_k(cm, [0.97] * 16, 15, source="suffix") == 1  # (why the default drafted one token at a time)
    cm.add_verify(1, 0.0436)
    cm.add_verify(2, 0.0791)
    assert cm.t_v(3) <= 0.0436 + 0.0791  # at most split into 1 + 2
    assert cm.t_v(16) == pytest.approx(8 * 0.0791)  # eight verifies of 2
    cm.add_verify(16, 0.286)  # timed: as measured, not pooled up with the cached 8 (at 5x)
    assert cm.t_v(16) == pytest.approx(0.286) and cm.t_v(8) <= 4 * 0.0791
    assert cm.t_v(32) <= 2 * 0.286  # the cached 32 (at 5x) at most two verifies of 16


def test_auto_k_times_the_widths_a_contended_cache_overprices():
    true = {1: 0.0436, 2: 0.0791, 4: 0.110, 8: 0.204, 16: 0.286}
    policy = AdaptiveK(CostStore())
    policy.store.costs = cached_model({w: t * (5 if w >= 3 else 1) for w, t in true.items()})
    sure = [0.97] * 15
    for _ in range(40):  # a copied stretch: the suffix tree offers 15 tokens, the rule keeps them all
        k = policy.choose("greedy", 15, "suffix", sure)
        seconds = numpy_interp(k + 1, true)
        policy.observe(Step("greedy", k, k, 0.0, seconds, source="suffix", confidence=sure[:k]))
    assert policy.choose("greedy", 15, "suffix", sure) >= 12  # k 1 before: the wide widths were never timed
    assert all(policy.costs.fresh(w) for w in range(3, 17))


def test_wider_steps_are_spaced_by_what_they_lose():
    """Every width timed: a wider step is tried RETIME_EVERY steps apart at the least, twice as
    far each time it does not win; it never replaces the plain refresh or a k = 0 choice."""
    from cactus_cli.infer.kpolicy.policy import RETIME_EVERY

    steep = cost_model({w: 0.1 + 0.02 * (w - 1) for w in range(1, 10)}, draft=0.0)  # k = 2 wins on these estimates
    policy = AdaptiveK()
    policy.store.costs = steep
    picks = [policy.choose("greedy", 8, "suffix", [0.9, 0.5, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]) for _ in range(400)]
    common = max(set(picks), key=picks.count)
    wider = [i for i, k in enumerate(picks) if k > common]
    assert common > 0 and wider and len(wider) <= 400 / RETIME_EVERY
    gaps = [b - a for a, b in zip(wider, wider[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # backing off


def test_a_probe_beside_a_busy_process_is_taken_again_at_the_next_start(tmp_path):
    from cactus_cli.infer.kpolicy import store as store_mod

    path = tmp_path / "costs.json"
    busy = CostStore(path, {"pair": "x"})
    busy.costs = cached_model({1: 0.1, 2: 0.2})
    busy.probed({"taken": "2026-12-07T04:00:00+00:00", "quiet": False, "load": 2.1, "cpu_share": {"probe": 0.48}})
    store_mod._PROBED.discard(str(path))  # (a new process)
    again = CostStore(path)
    assert again.provisional and again.needs_probe("suffix")
    store_mod._PROBED.add(str(path))  # probed again in this process: not a third time
    assert not again.needs_probe("suffix")
    quiet = CostStore(tmp_path / "quiet.json")
    quiet.costs = cached_model({1: 0.1, 2: 0.2})
    quiet.probed({"taken": "2026-12-07T04:00:00+00:00", "quiet": True, "load": 0.1, "cpu_share": {"probe": 0.97}})
    store_mod._PROBED.clear()
    assert not CostStore(tmp_path / "quiet.json").needs_probe("suffix")
    write_costs(tmp_path / "old.json", {"verify": {"1": [0.1]}}, {})  # before conditions were recorded
    assert CostStore(tmp_path / "old.json").needs_probe("suffix")


def test_a_cache_that_live_verifies_beat_is_marked_provisional(tmp_path, capsys):
    from cactus_cli.core.conditions import WATCH_STEPS

    path = tmp_path / "costs.json"
    write_costs(path, {"verify": {"1": [0.2] * 3, "2": [0.3] * 3}}, {})
    store = CostStore(path)
    assert store.watch is not None
    for _ in range(WATCH_STEPS):
        store.observe_verify(1, 0.1)  # twice as fast as the cache said
    assert store.conditions["quiet"] is False and store.conditions["drift"] == pytest.approx(0.5)
    assert "faster than the measurement" in capsys.readouterr().err
    assert CostStore(path).provisional  # saved: the next start probes again


# ---------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def close_pair(tiny):
    return load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32")


def test_catch_up_after_plain_steps_keeps_caches_exact(close_pair, monkeypatch):
    """k = 0 steps leave the draft behind; the next drafting step feeds everything it missed in
    its first forward, and greedy output still equals the verifier's own."""
    pair = close_pair
    engine = SpeculativeEngine(pair)
    script = iter([2, 0, 0, 0, 3, 0, 1, 4, 0, 0, 2] * 10)
    monkeypatch.setattr(AdaptiveK, "settle", lambda self, want, k: min(next(script), want.k_max))
    ids = prompt_ids(pair)
    n = 40
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=4, adaptive_k=True, max_tokens=n, ignore_eos=True)
    tokens, pendings, emitted = [], [], 0
    for i, ev in enumerate(engine.generate(ids, params)):
        tokens += ev.emitted
        emitted += len(ev.emitted)
        lengths = engine.cache_lengths()
        assert lengths["sequence"] == len(ids) + emitted
        assert lengths["verifier"] == lengths["sequence"] - 1
        assert lengths["draft"] + lengths["draft_pending"] == lengths["sequence"]
        if ev.num_drafted and i > 0:  # (the first step's count includes the prefill)
            assert ev.draft_forward_passes == ev.num_drafted  # the catch-up rides in the first forward
        pendings.append(lengths["draft_pending"])
    assert max(pendings) >= 4  # three plain steps in a row left the draft 3+ tokens behind
    assert tokens == hf_greedy(pair, ids, n)


def test_a_new_prompt_starts_the_catch_up_count_over(close_pair, monkeypatch):
    # The prefill brings the draft level with the prompt, so the steps a previous prompt spent
    # plain are no catch-up for this one (each run has its own policy; the slot's draft cache spans runs).
    engine = SpeculativeEngine(close_pair)
    seen = []

    def plain(self, want, k):
        seen.append(self.behind)
        return 0

    monkeypatch.setattr(AdaptiveK, "settle", plain)
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=4, adaptive_k=True, max_tokens=5, ignore_eos=True)
    for _ in range(2):
        list(engine.generate(prompt_ids(close_pair), params))
    n = len(seen) // 2
    assert n >= 3 and seen == list(range(n)) * 2  # (without the reset the second run counts on from n)


def test_adaptive_k_learns_and_reports(close_pair):
    engine = SpeculativeEngine(close_pair)
    assert engine.probe_costs(4)
    assert engine.costs.costs.knows("model") and engine.costs.costs.source == "probe"
    assert set(engine.costs.costs.verify) == {
        1,
        2,
        3,
        4,
        5,
    }  # every width to k_max + 1 (costs step where kernels change)
    params = GenerationParams(
        sampling=SamplingParams(0.8, 0, 1.0),
        rule="cactus",
        rule_kwargs={"delta": 1.0},
        num_draft_tokens=4,
        adaptive_k=True,
        max_tokens=30,
        ignore_eos=True,
        seed=2,
    )
    ks = [ev.num_drafted for ev in engine.generate(prompt_ids(close_pair), params)]
    assert all(0 <= k <= 4 for k in ks)
    summary = engine.cost_summary(params)
    assert summary["adaptive_k"] and summary["source"] == "probe+online"
    assert 0 < summary["acceptance_estimate"] < 1 and summary["best_k"] in range(5)
    # a second engine on the same pair starts from the cache the first one saved, with the
    # probe's conditions (a quiet probe is not taken again)
    again = SpeculativeEngine(close_pair).costs
    assert again.costs.source == "cache" and set(again.conditions) >= {"taken", "quiet", "cpu_share"}
    assert "probe" in again.conditions["cpu_share"]
    assert not again.needs_probe("model")  # (quiet, or if not, probed in this process already)


# ---------------------------------------------------------------------- dtype


def test_dtype_auto_is_measured_and_cached(isolated_home):
    dtype, why = fastest_cpu_dtype(64, 256)
    assert dtype in (torch.float32, torch.bfloat16) and "measured" in why and "cached" not in why
    assert "quiet" in why or "provisional" in why  # (when it was taken and under what load, said)
    files = list((isolated_home / "costs").glob("dtype-*.json"))
    assert len(files) == 1 and set(json.loads(files[0].read_text())["seconds"]) == {"float32", "bfloat16"}
    again, why2 = resolve_dtype("auto", torch.device("cpu"), (64, 256))
    assert again == dtype and "(cached: measured " in why2
    assert resolve_dtype("float32", torch.device("cpu"), (64, 256)) == (torch.float32, "as asked")


def test_a_dtype_timed_beside_a_busy_process_is_provisional_and_taken_again(isolated_home, monkeypatch):
    """The torch choices (dtype, int8 or w8a8) record their conditions as llama.cpp's do: timed
    while the threads got half the CPU, the answer is provisional and the next start times again;
    quiet, it is kept and said as cached."""
    from cactus_cli.core import conditions

    share = {"now": 0.5}
    timed = []
    monkeypatch.setattr(conditions, "cpu_share", lambda wall, cpu, threads: timed.append(wall) or share["now"])
    first = fastest_cpu_dtype(64, 256)[1]
    assert "provisional: measured" in first and "beside another busy process" in first and timed
    share["now"], before = 0.97, len(timed)
    second = fastest_cpu_dtype(64, 256)[1]
    assert "cached" not in second and "quiet" in second and len(timed) > before  # (taken again by itself)
    before = len(timed)
    third = fastest_cpu_dtype(64, 256)[1]
    assert "(cached: measured " in third and ", quiet)" in third and len(timed) == before


def test_a_full_disk_does_not_stop_the_run(tiny, monkeypatch):
    from cactus_cli.infer.backends.torch.quant import qcache

    real = os.fdopen

    class Full:  # the cache file's writes fail the way a full disk fails them
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    path = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8")
    path.unlink(missing_ok=True)  # (an earlier test may have cached it)
    with monkeypatch.context() as m:
        m.setattr(qcache.os, "fdopen", lambda *a, **k: Full(real(*a, **k)))
        _, text = quantize_tiny(tiny)  # raised SafetensorError before
    assert text.startswith("int8 weights")
    assert not list(path.parent.glob(".*.tmp")) and not path.exists()
    quantize_tiny(tiny)  # (the next start quantizes again and caches)
    assert path.exists()


@pytest.mark.parametrize(
    "costs,acceptance",
    [
        ({"verify": {"1": [0.1]}}, {"greedy": [[-5.0], [-5.0]]}),  # a negative count: ZeroDivisionError before
        ({"verify": {"1": [0.1]}}, {"greedy": [[float("nan")], [1.0]]}),  # NaN: k = 0 forever, written back
        ({"verify": {"-3": [0.1], "0": [0.1], "1000000": [0.1], "1": [0.1]}}, {}),  # impossible widths
        ({"verify": {"1": [1e308, 0.1], "2": [-1, 0.2]}, "draft": {"model": [float("nan"), 0.01]}}, {}),
    ],
)
def test_invalid_cost_entries_are_dropped_said_and_never_written_back(tmp_path, costs, acceptance):
    path = tmp_path / "costs.json"
    write_costs(path, costs, acceptance)
    p = CostStore(path)
    assert len(p.notes) == 1 and "invalid" in p.notes[0]
    assert all(1 <= w <= policy.MAX_WIDTH for w in p.costs.verify)
    assert all(math.isfinite(p.costs.t_v(w)) and 0 < p.costs.t_v(w) < 1 for w in range(1, 10))
    for acc in p.acceptance.values():
        assert all(math.isfinite(r) for r in acc.rates(8))
    assert AdaptiveK(p).choose("greedy", 4) in range(5)
    p.save()
    again = CostStore(path)
    assert again.notes == []  # what was written back is clean


def test_deeply_nested_or_garbage_cost_cache(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text("[" * 100000 + "]" * 100000)  # RecursionError before
    p = CostStore(path)
    assert p.notes and "unreadable" in p.notes[0]


@pytest.mark.parametrize(
    "seconds",
    [{"float32": 0, "bfloat16": 0}, {"float32": -0.2, "bfloat16": 0.1}, {"float32": float("nan"), "bfloat16": 0.1}],
)
def test_a_corrupt_dtype_cache_is_measured_again(monkeypatch, seconds):
    from cactus_cli.infer.load import devices as models

    key = {
        "cpu": models.device_name(torch.device("cpu")),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "shape": [64, 128],
    }
    path = cache_path(key, "dtype-")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "seconds": seconds}))
    dtype, why = models.fastest_cpu_dtype(64, 128)  # ZeroDivisionError / "-0.20x faster" before
    assert "(cached)" not in why and "nan" not in why and "-" not in why.split("x faster")[0]
    assert all(v > 0 for v in json.loads(path.read_text())["seconds"].values())


def test_a_credible_drop_where_kernels_change_is_kept_noise_is_pooled():
    # llama.cpp's Q4_K_M on one core, ms by width (benchmarks/gguf_types.py): 16 rows cost less than 12
    measured = {1: 39, 4: 151, 8: 275, 12: 333, 16: 300, 17: 430}
    cm = CostModel()
    for _ in range(3):
        for w, ms in measured.items():
            cm.add_verify(w, ms / 1000)
    assert cm.t_v(16) == pytest.approx(0.300) and cm.t_v(12) == pytest.approx(0.333)  # both as measured
    assert best_k(cm, 0.95, 16, source="suffix") == 15  # and -k auto may use the cheap width (a free draft)
    once = CostModel()  # the same curve timed once per width: not enough to believe a drop
    for w, ms in measured.items():
        once.add_verify(w, ms / 1000)
    assert once.t_v(12) == once.t_v(16) == pytest.approx(0.3165)
    small = CostModel()  # a 5% dip timed often is noise too
    for _ in range(5):
        small.add_verify(2, 0.100)
        small.add_verify(3, 0.095)
    assert small.t_v(2) == small.t_v(3)


def test_the_engine_save_after_each_run_is_put_off_then_done_by_the_next_reader_or_at_exit(isolated_home):
    """A server's short runs write the store at most once a SAVE_EVERY (each write is an fsync and a
    rename on the engine's thread): the first write is at once, a later one within the interval is
    put off, and done when this process reads the key again or exits, so nothing learned is lost."""
    key = {"pair": "put-off"}
    store = CostStore.read(key)
    store.observe(Step("greedy", 0, 0, 0.0, 0.1))
    store.save(every=60)
    assert CostStore(store.path).costs.t_v(1) == pytest.approx(0.1)  # the first write: at once
    store.observe(Step("greedy", 0, 0, 0.0, 0.5))
    store.save(every=60)
    assert CostStore(store.path).costs.t_v(1) == pytest.approx(0.1)  # put off ...
    del store  # (the engine that held it is gone: bench's next configuration)
    gc.collect()
    assert CostStore.read(key).costs.t_v(1) == pytest.approx(statistics.median([0.1, 0.5]))  # ... done for a reader
    code = (
        "from cactus_cli.infer.kpolicy.costs import Step\n"
        "from cactus_cli.infer.kpolicy.store import CostStore\n"
        "s = CostStore.read({'pair': 'at-exit'})\n"
        "s.observe(Step('greedy', 0, 0, 0.0, 0.1)); s.save(every=60)\n"
        "s.observe(Step('greedy', 0, 0, 0.0, 0.5)); s.save(every=60)\n"
        "print(s.path)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert CostStore(Path(out.stdout.strip())).costs.t_v(1) == pytest.approx(0.3)  # written at exit


def test_each_run_has_its_own_k_policy_over_what_the_machine_learned(close_pair):
    """A request's -k auto state is its own (a new request probes at the base spacing, not at the
    last request's back-off on that slot); the store and the catch-up overheads are shared."""
    engine = SpeculativeEngine(close_pair)
    params = GenerationParams(sampling=GREEDY, num_draft_tokens=4, adaptive_k=True, max_tokens=4)
    first = engine.policy(params)
    first.backoff, first.plain_steps, first.run = 8, 5, True
    first.overheads["model"] = Overhead()
    second = engine.policy(params)
    assert second is not first and (second.backoff, second.plain_steps, second.run) == (1, 0, False)
    assert second.store is engine.costs and second.overheads["model"] is first.overheads["model"]
    assert isinstance(engine.policy(dataclasses.replace(params, adaptive_k=False)), FixedK)
