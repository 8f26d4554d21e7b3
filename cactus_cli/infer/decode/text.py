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
    """Adds text to step events; ends the run at the first stop string, cut whole: text that
    could be the start of a stop string is held back until the next pieces show whether it is
    (then the text ends before it) or not (then it is shown with them), as OpenAI's API and
    vLLM do, so no part of a stop string is ever shown. The event that completes a stop string
    keeps only the tokens up to it, accepted ones included, and ``on_cut`` hears how many
    emitted tokens were dropped. What is held when the run ends otherwise goes out with its
    last event."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), on_cut: Callable[[int], None] | None = None):
        self.tokenizer = tokenizer
        self.detok = Detokenizer(tokenizer)
        self.on_cut = on_cut
        self.stop = stop
        self.text = ""  # shown so far
        self.held = ""  # decoded, not shown: it may be the start of a stop string

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
            piece, hit = self._show(self.detok.add(token))
            if hit:
                finish, emitted = "stop", ev.emitted[: i + 1]
            pieces.append(Piece(piece, accepted_kind if i < len(ev.accepted) else ev.extra_kind))
            if finish == "stop":
                break
        if finish is not None and finish != "stop" and self.held:  # the run ends: nothing more can complete a stop
            last = pieces[-1] if pieces else Piece("", ev.extra_kind)
            pieces[-1:] = [Piece(last.text + self.held, last.kind)]
            self.text, self.held = self.text + self.held, ""
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
            logprobs=ev.logprobs[:n],
        )

    def _show(self, piece: str) -> tuple[str, bool]:
        """The text ``piece`` lets be shown now, and whether a stop string ended the text. A stop
        string never starts in shown text: whatever could begin one was held back."""
        if not self.stop:
            self.text += piece
            return piece, False
        window = self.held + piece
        hits = [i for i in (window.find(s) for s in self.stop) if i >= 0]
        if hits:
            shown, self.held = window[: min(hits)], ""
            self.text += shown
            return shown, True
        keep = max(
            (n for s in self.stop for n in range(min(len(s) - 1, len(window)), 0, -1) if window.endswith(s[:n])),
            default=0,
        )
        shown, self.held = window[: len(window) - keep], window[len(window) - keep :]
        self.text += shown
        return shown, False
