"""The Python API (cactus_cli.api.Session): load a pair from a profile and keyword arguments,
generate step events, read the stats; the same engine the commands drive."""

from __future__ import annotations

import pytest

from cactus_cli.api import Session, StepEvent
from cactus_cli.core.errors import ConfigError


def load(tiny, **kw):
    return Session.load(
        None,
        verifier=tiny["verifier"],
        draft=tiny["draft_close"],
        device="cpu",
        dtype="float32",
        quantize="none",
        compile="off",
        **kw,
    )


def test_generate_yields_the_engines_step_events_and_counts_them(tiny):
    session = load(tiny, max_tokens=16, temperature=0, num_draft_tokens=3)
    events = list(session.generate("the cat sat on the mat"))
    assert all(isinstance(ev, StepEvent) for ev in events)
    assert session.stats.num_output_tokens == sum(len(ev.emitted) for ev in events) <= 16
    assert session.stats.num_steps == len(events) and session.stats.tokens_per_second > 0
    text = "".join(ev.text for ev in events)
    assert session.text("the cat sat on the mat") == text  # greedy: the same text again
    shorter = list(session.generate("the cat sat on the mat", max_tokens=4))  # overrides, the models as loaded
    assert sum(len(ev.emitted) for ev in shorter) <= 4 and session.settings.max_tokens == 16


def test_bad_settings_are_the_same_one_line_errors_as_flags(tiny):
    with pytest.raises(ConfigError, match="max-tokens must be an integer >= 1"):
        load(tiny, max_tokens=0)
    session = load(tiny, max_tokens=8)
    with pytest.raises(ConfigError, match="unknown key 'max_token'"):
        list(session.generate("the cat", max_token=3))
