"""From tokens to text, outside the engine: an incremental detokenizer and the stream that wraps
the engine's step events with the text they add (one piece per emitted token), the rejected
drafts as text (for the live view) and stop strings. The engine speaks tokens only, and stops
being timed while the stream works: tokens/s counts no decoding, for speculation and the
verifier alone alike (README, "Bench")."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from cactus_cli.core.events import Piece, StepEvent
from cactus_cli.infer.draft import KINDS


class Detokenizer:
    """Incremental decoding that never emits half a multi-byte character (vLLM's scheme:
    decode a short window and emit what grew past the previous window's text)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""


class TextStream:
    """Adds text to step events; ends the run at the first stop string (the text is cut where
    it starts; text already shown stays shown). The event that hits it keeps only the tokens up
    to it, accepted ones included, and ``on_cut`` hears how many emitted tokens were dropped."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), on_cut: Callable[[int], None] | None = None):
        self.tokenizer = tokenizer
        self.detok = Detokenizer(tokenizer)
        self.on_cut = on_cut
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.text = ""

    def wrap(self, events: Iterator[StepEvent]) -> Iterator[StepEvent]:
        try:
            for ev in events:
                ev = self.add_text(ev)
                yield ev
                if ev.finish_reason:
                    return
        finally:
            events.close()  # (a stop string, or the consumer left): the engine's caches stay consistent

    def add_text(self, ev: StepEvent) -> StepEvent:
        kind = KINDS.get(ev.draft_source or "")
        accepted_kind = kind.label if kind is not None else "accepted"
        pieces: list[Piece] = []
        finish = ev.finish_reason
        emitted = ev.emitted
        for i, token in enumerate(ev.emitted):
            if finish == "eos" and i == len(ev.emitted) - 1:
                break  # the EOS token ends the text and adds none
            piece = self.detok.add(token)
            hit = self._stop_at(piece)
            if hit is not None:
                piece, finish, emitted = piece[:hit], "stop", ev.emitted[: i + 1]
            self.text += piece
            pieces.append(Piece(piece, accepted_kind if i < len(ev.accepted) else ev.extra_kind))
            if finish == "stop":
                break
        n = len(emitted)
        if n < len(ev.emitted) and self.on_cut is not None:
            self.on_cut(len(ev.emitted) - n)
        return dataclasses.replace(
            ev,
            emitted=emitted,
            accepted=ev.accepted[:n],
            pieces=tuple(pieces),
            finish_reason=finish,
            rejected_text=tuple(self.tokenizer.decode([t]) for t in ev.rejected),
            realized_kl=ev.realized_kl[:n],
            realized_tv=ev.realized_tv[:n],
            verifier_loglik=ev.verifier_loglik[:n],
        )

    def _stop_at(self, piece: str) -> int | None:
        """Where in ``piece`` the text must end, if a stop string appears in the text so far."""
        if not self.stop or not piece:
            return None
        tail = self.text[-self.max_stop :]
        window = tail + piece
        hits = [window.find(s) for s in self.stop if s in window]
        return max(min(hits) - len(tail), 0) if hits else None


def trim_stop(text: str, stop: tuple[str, ...]) -> str:
    """A stopped run's text without the start of its stop string: the stream cuts where a stop
    string begins, but the part of it that came in earlier pieces was already emitted (a fence
    "```" arriving as "``" then "`" leaves "``")."""
    for s in stop:
        for n in range(len(s) - 1, 0, -1):
            if text.endswith(s[:n]):
                return text[:-n]
    return text
