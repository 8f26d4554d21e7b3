"""Adding a model-free drafter is one module and one registry line: a drafter defined only in this
file, with a parameter of its own, runs through the command line (its parameter by --draft-param,
listed by --help), a profile and Session, shows in the live view's legend, and its timings are kept
in the cost store, with nothing else in the code base knowing its name or its parameter's."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cactus_cli.api import Session
from cactus_cli.cli.main import app
from cactus_cli.core.acceptance import Param
from cactus_cli.infer import draft
from cactus_cli.infer.draft import DrafterBase, Kind, Peek, one_hot_proposal
from cactus_cli.infer.kpolicy.store import CostStore
from cactus_cli.infer.pair.keys import cost_key

runner = CliRunner()


class Echo(DrafterBase):
    """Drafts the last token again, ``times`` times: right wherever the text repeats a token."""

    def __init__(self, vocab_size, device, times):
        self.vocab_size, self.device, self.times = vocab_size, device, times

    def peek(self, seq):
        return Peek("echo", [0.9] * self.times) if seq else None

    def propose(self, seq, k, sp, generator):
        return one_hot_proposal([seq[-1]] * min(k, self.times), self.vocab_size, self.device, sp, "echo")


@pytest.fixture
def echo(monkeypatch):
    times = Param("times", 2, lambda v: isinstance(v, int) and 1 <= v <= 8, "an integer in 1..8", int)
    kind = Kind(
        name="echo", summary="echoing", label="echoed", make=lambda o, v, d, s: Echo(v, d, o["times"]), params=(times,)
    )
    monkeypatch.setitem(draft.KINDS, "echo", kind)  # the one registry line


def test_a_drafter_defined_here_runs_through_the_cli_a_profile_and_session(echo, tiny, tmp_path):
    base = ["generate", "the cat the cat the cat", "--verifier", tiny["verifier"], "--device", "cpu"]
    base += ["--dtype", "float32", "-k", "3", "-n", "12", "--seed", "0", "--json"]
    r = runner.invoke(app, [*base, "--draft", "echo", "--draft-param", "times=3"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["stats"]["draft_sources"]["echo"]["drafted"] > 0  # its drafts ran, counted under its name
    assert doc["settings"]["draft_params"] == {"times": 3}
    r = runner.invoke(app, [*base, "--draft", "echo", "--draft-param", "times=9"])
    assert r.exit_code == 2 and "times must be an integer in 1..8, got 9" in r.output, r.output
    help_text = " ".join(runner.invoke(app, ["generate", "--help"]).output.replace("│", " ").split())
    assert "echo drafts by echoing" in help_text.replace("`", "") and "times for echo, an integer in 1..8" in help_text
    wrong = tmp_path / "wrong.yaml"  # a parameter of the echo drafter under another draft: named as its
    wrong.write_text(f"verifier: {tiny['verifier']}\ndraft: suffix\ntimes: 2\n")
    r = runner.invoke(app, ["generate", "hi", "--profile", str(wrong)])
    assert r.exit_code == 2 and "times applies only to echoing (draft echo or echo+MODEL)" in r.output, r.output
    profile = tmp_path / "echo.yaml"
    profile.write_text(f"verifier: {tiny['verifier']}\ndraft: echo+{tiny['draft_close']}\ndraft_params: {{times: 2}}\n")
    session = Session.load(str(profile), device="cpu", dtype="float32", num_draft_tokens=3, max_tokens=12, seed=0)
    assert session.text("the cat the cat") and session.stats.drafted_by_source.get("echo", 0) > 0
    store = CostStore.read(cost_key(session.engine.pair), tuple(draft.KINDS))  # saved by the run, read back
    assert store.costs.draft.get("echo"), "the echo drafter's timings were not kept"
    from cactus_cli.cli import ui

    assert "echoed (echo)" in ui.legend().plain
