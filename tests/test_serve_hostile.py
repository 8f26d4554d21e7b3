"""What the sixth round's hostile probe of `cactus serve` found (issue 71, item 4), each pinned
here: a body over the limit sent chunked with a small Content-Length, a body that stalls after its
headers, lone surrogates and deep nesting outside message text (500s with tracebacks before),
`models remeasure` undone by a running server, batched timings saved and then dropped on load,
``max_completion_tokens`` refused by another field's name, and a final assistant message
(prefill) closed instead of continued."""

from __future__ import annotations

import json

import pytest

from cactus_cli.core.paths import cache_path
from cactus_cli.infer.kpolicy.costs import Step
from cactus_cli.infer.kpolicy.store import CostStore
from tests.helpers import invoke

# --- the cost store ------------------------------------------------------------------------------


def test_batched_verify_widths_are_saved_and_loaded_back(tmp_path):
    """`serve --parallel 4` with long drafts times verifies of 69-132 tokens (the step's runs
    together); they were saved, then dropped at the next start as invalid ("dropped 28 invalid
    entries"). Saved widths load back; one wider than any batch is never saved."""
    path = tmp_path / "costs.json"
    store = CostStore(path, {"pair": "x"})
    for width in (1, 5, 69, 100, 132):
        store.observe_verify(width, 0.01 * width)
    store.observe_verify(10**6, 1.0)  # (no batch is this wide)
    store.save()
    again = CostStore(path)
    assert again.notes == [], again.notes
    assert sorted(again.costs.verify) == [1, 5, 69, 100, 132]
    assert again.costs.t_v(132) == pytest.approx(1.32)


def test_a_running_server_does_not_write_back_what_models_remeasure_forgot(isolated_home):
    """With a server on the same CACTUS_HOME, `models remeasure` deleted the cost file and the
    server wrote it back with the old timings at its next finished request. Now the server drops
    what it held: the next save holds only what it timed since (unprobed, so the next start probes)."""
    key = {"pair": "remeasured"}
    path = cache_path(key)
    old = CostStore(path, key)
    old.observe_verify(1, 0.5)
    old.observe_verify(4, 0.9)
    old.probed({"quiet": True})  # (a probe's timings, saved)
    server = CostStore.read(key)  # the running server's store
    assert server.costs.t_v(4) == pytest.approx(0.9) and not server.provisional
    r = invoke("models", "remeasure")
    assert r.exit_code == 0 and "forgot 1 measurement" in r.output, r.output
    server.observe(Step("greedy", 1, 1, 0.01, 0.2))  # (a request finishes: the store is saved)
    server.save()
    assert not path.exists()  # (not written back)
    assert server.costs.verify == {} and server.acceptance == {}  # (the old timings are gone here too)
    server.observe(Step("greedy", 1, 1, 0.01, 0.3))
    server.save()
    doc = json.loads(path.read_text())
    assert doc["costs"]["verify"] == {"2": [0.3]} and doc["conditions"] is None
    assert CostStore.read(key).provisional  # (so the next start probes again, as remeasure says)


def test_a_store_another_process_rewrote_is_read_again_not_overwritten(tmp_path):
    """Another process's save (a fresh probe) is taken, not overwritten with this one's timings."""
    path = tmp_path / "costs.json"
    mine = CostStore(path)
    mine.observe_verify(1, 0.5)
    mine.save()
    theirs = CostStore(path)
    theirs.observe_verify(1, 0.1)
    theirs.probed({"quiet": True})
    mine.observe_verify(1, 0.6)
    mine.save()
    assert json.loads(path.read_text())["costs"]["verify"] == {"1": [0.1]}  # (theirs, kept)
    assert mine.costs.t_v(1) == pytest.approx(0.1) and mine.conditions == {"quiet": True}
