"""A slot: one sequence's caches, as llama-server's ``server_slot`` holds them, and what lasts
between the requests that use it: its sequence in each model's KV cache (``verifier``, and the
draft model's through its own ``drafter``, whose history spans requests) and what those caches
hold (``tokens``). Everything of one request is its ``Request`` (request.py)."""

from __future__ import annotations

from cactus_cli.infer.draft import Drafter
from cactus_cli.infer.runner import Runner


class Slot:
    """One sequence of the engine: its runners, its drafter, what its caches hold, and the run
    that holds them now (``owner``)."""

    def __init__(self, index: int, verifier: Runner, drafter: Drafter | None):
        self.index = index
        self.verifier = verifier
        self.drafter = drafter
        self.tokens: list[int] = []  # what the caches hold: the verifier's holds tokens[: cache_len]
        self.owner: object | None = None  # the generation whose caches these are, while it runs
        self.used = 0.0  # when a run last started here (a new request takes the least recently used free slot)

    @property
    def draft_runner(self) -> Runner | None:
        return self.drafter.runner if self.drafter is not None else None

    def reset(self) -> None:
        """Forget this sequence in both caches (the next run prefills from scratch)."""
        self.verifier.reset()
        if self.draft_runner is not None:
            self.draft_runner.reset()
        self.tokens = []

    def cache_lengths(self) -> dict[str, int]:
        """The verifier cache always holds the sequence minus its last token; the draft's holds a
        prefix of it, the rest (``draft_pending``) fed by its next forward."""
        out = {"sequence": len(self.tokens), "verifier": self.verifier.cache_len}
        if self.draft_runner is not None:
            out["draft"] = self.draft_runner.cache_len
            out["draft_pending"] = len(self.tokens) - self.draft_runner.cache_len
        return out
