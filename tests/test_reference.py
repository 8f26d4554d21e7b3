"""The engine's output for fixed seeds, against runs stored before the engine stepped slots
(tests/data/engine_reference.json, written by commit 'tests: stored greedy and seeded runs'):
batch 1 must stay the same code path token for token, greedy and sampled, for every kind of
drafter and rule, across a second generation that reuses the caches, and with -k auto on frozen
costs. ``CACTUS_WRITE_REFERENCE=1 pytest tests/test_reference.py`` writes the file anew (only
when the output is meant to change, saying why in the commit)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import deque
from pathlib import Path

import pytest

from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.draft import Free
from cactus_cli.infer.kpolicy import policy
from cactus_cli.infer.kpolicy.costs import CostModel
from cactus_cli.infer.kpolicy.store import CostStore
from cactus_cli.infer.pair.loader import load_pair

REFERENCE = Path(__file__).parent / "data" / "engine_reference.json"
GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
PROMPTS = ("the cat sat on the mat and then", "a red bird sang on the tree and the sun was big")


def _ids(pair, text):
    return pair.tokenizer(text)["input_ids"]


def _tokens(engine, ids, params, reuse=False):
    return [t for ev in engine.generate(ids, params, reuse_cache=reuse) for t in ev.emitted]


def reference_runs(tiny, monkeypatch) -> dict[str, list[list[int]]]:
    def pair(draft):
        return load_pair(tiny["verifier"], tiny[draft] if draft else None, None, "cpu", dtype="float32")

    close, disagree, alone = pair("draft_close"), pair("draft"), pair(None)
    out: dict[str, list[list[int]]] = {}

    def runs(name, p, params, free=None, reuse_second=True):
        engine = SpeculativeEngine(p, free)
        first = _tokens(engine, _ids(p, PROMPTS[0]), params)
        # a second generation on the same engine (suffix history, policy state and caches carry over)
        second = _tokens(
            engine,
            _ids(p, PROMPTS[0] + " " + PROMPTS[1]),
            dataclasses.replace(params, seed=params.seed + 1),
            reuse_second,
        )
        out[name] = [first, second]

    base = GenerationParams(sampling=GREEDY, num_draft_tokens=3, max_tokens=24, ignore_eos=True)
    runs("greedy k3 disagree", disagree, base)
    runs("greedy k3 close", close, base)
    runs("greedy alone", alone, dataclasses.replace(base, num_draft_tokens=0))
    runs("greedy ngram k5", alone, dataclasses.replace(base, num_draft_tokens=5), Free("ngram"))
    sampled = dataclasses.replace(base, sampling=SamplingParams(0.8, 0, 1.0), seed=7)
    runs("sps T0.8 k3 close", close, sampled)
    runs("sps T0.8 k3 disagree", disagree, sampled)
    runs(
        "cactus d1 T0.7 k4",
        close,
        dataclasses.replace(
            base,
            sampling=SamplingParams(0.7, 20, 0.95),
            rule="cactus",
            rule_kwargs={"delta": 1.0},
            num_draft_tokens=4,
            seed=3,
        ),
    )
    runs(
        "tas T1 k2",
        disagree,
        dataclasses.replace(
            base,
            sampling=SamplingParams(1.0, 0, 1.0),
            rule="tas",
            rule_kwargs={"epsilon": 0.09},
            num_draft_tokens=2,
            seed=11,
        ),
    )
    runs(
        "suffix+model T0.6 k4",
        close,
        dataclasses.replace(base, sampling=SamplingParams(0.6, 20, 0.95), num_draft_tokens=4, seed=5),
        Free("suffix"),
    )
    runs(
        "plain T0.9",
        alone,
        dataclasses.replace(base, sampling=SamplingParams(0.9, 20, 0.95), num_draft_tokens=0, seed=2),
    )

    # -k auto on frozen costs (no timing this run takes changes a choice)
    monkeypatch.setattr(CostModel, "add_verify", lambda self, width, seconds: None)
    monkeypatch.setattr(CostModel, "add_draft", lambda self, seconds, source="model": None)
    monkeypatch.setattr(policy.Overhead, "add", lambda self, behind, seconds: None)

    def frozen(engine):
        store = CostStore()
        for w in range(1, 18):
            store.costs.verify[w] = deque([0.010 + 0.004 * w])
        store.costs.draft["model"] = deque([0.006])
        engine.costs = store  # (each run's -k auto reads it)
        return engine

    auto = dataclasses.replace(
        base, sampling=SamplingParams(0.6, 20, 0.95), num_draft_tokens=8, adaptive_k=True, seed=9
    )
    for name, p, free in (("auto model", close, None), ("auto suffix+model", close, Free("suffix"))):
        engine = frozen(SpeculativeEngine(p, free))
        first = _tokens(engine, _ids(p, PROMPTS[0]), auto)
        second = _tokens(engine, _ids(p, PROMPTS[0] + " " + PROMPTS[1]), dataclasses.replace(auto, seed=10), True)
        out[name] = [first, second]
    return out


def test_batch_one_gives_the_stored_runs_token_for_token(tiny, monkeypatch):
    got = reference_runs(tiny, monkeypatch)
    if os.environ.get("CACTUS_WRITE_REFERENCE"):
        REFERENCE.parent.mkdir(exist_ok=True)
        lines = ",\n".join(f" {json.dumps(name)}: {json.dumps(runs)}" for name, runs in got.items())
        REFERENCE.write_text("{\n" + lines + "\n}\n")
        pytest.skip("wrote the reference runs")
    stored = json.loads(REFERENCE.read_text())
    assert set(got) == set(stored)
    for name in stored:
        assert got[name] == stored[name], name
