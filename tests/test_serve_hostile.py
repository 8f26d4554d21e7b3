"""What the sixth round's hostile probe of `cactus serve` found (issue 71, item 4), each pinned
here: a body over the limit sent chunked with a small Content-Length, a body that stalls after its
headers, lone surrogates and deep nesting outside message text (500s with tracebacks before),
`models remeasure` undone by a running server, batched timings saved and then dropped on load,
``max_completion_tokens`` refused by another field's name, and a final assistant message
(prefill) closed instead of continued."""

from __future__ import annotations

import pytest

from cactus_cli.infer.kpolicy.store import CostStore

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
