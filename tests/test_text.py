"""The text stream around the engine: a stop string is cut whole, however the tokens split it
(no part of it is ever shown, streamed or not), and text held back as a possible stop start is
shown when the run ends another way."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cactus_cli.core.events import StepEvent
from cactus_cli.infer.decode.text import TextStream


class PieceTokenizer:
    """Token i decodes to PIECES[i]; a sequence decodes to the concatenation."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def event(tokens: list[int], finish: str | None = None) -> StepEvent:
    return StepEvent(
        num_drafted=len(tokens) - 1,
        draft_source="model" if len(tokens) > 1 else None,
        accepted=tuple(tokens[:-1]),
        rejected=(),
        extra=tokens[-1],
        extra_kind="bonus",
        emitted=tuple(tokens),
        pieces=(),
        rejected_text=(),
        draft_seconds=0.0,
        verify_seconds=0.0,
        prefill_seconds=0.0,
        prefill_tokens=0,
        reused_tokens=0,
        elapsed=0.0,
        draft_forward_passes=0,
        verifier_forward_passes=1,
        prompt_tokens=1,
        finish_reason=finish,
    )


def stream(pieces: list[str], steps: list[int], stop: tuple[str, ...]) -> tuple[list[str], str | None]:
    """The texts each event shows and the finish reason, for tokens 0..len(pieces)-1 in steps of
    the given sizes (the last step ends the run with "length" unless a stop came first)."""
    ts = TextStream(PieceTokenizer(pieces), stop)
    shown, finish, i = [], None, 0
    for size in steps:
        tokens = list(range(i, min(i + size, len(pieces))))
        if not tokens:
            break
        i += len(tokens)
        ev = ts.add_text(event(tokens, "length" if i == len(pieces) else None))
        shown.append(ev.text)
        if ev.finish_reason:
            finish = ev.finish_reason
            break
    return shown, finish


def expected(pieces: list[str], stop: tuple[str, ...]) -> tuple[str, str]:
    """The first piece boundary where some stop string has appeared; the text before it."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return text[: min(hits)], "stop"
    return text, "length"


def test_a_stop_string_split_over_tokens_is_cut_whole():
    # "...star tree slow": the stop "tree slow" comes as " tree", " slow"; " tree" must never show
    pieces = ["the", " sun", " star", " tree", " slow", " sea"]
    shown, finish = stream(pieces, [1, 1, 1, 1, 1, 1], ("tree slow",))
    assert finish == "stop"
    assert "".join(shown) == "the sun star "
    assert shown[3] == " "  # "tree" was held back, then dropped with the stop
    # a fence "```" arriving as "``" then "`"
    shown, finish = stream(["return x\n", "``", "`", "more"], [2, 1, 1], ("```",))
    assert finish == "stop" and "".join(shown) == "return x\n"


def test_text_held_back_is_shown_when_it_turns_out_not_to_be_a_stop():
    shown, finish = stream(["a", " tree", " fun", " ok"], [1, 1, 1, 1], ("tree slow",))
    assert finish == "length"
    assert shown == ["a", " ", "tree fun", " ok"]
    # held at the very end of the run: shown with the last event
    shown, finish = stream(["a", " tree"], [1, 1], ("tree slow",))
    assert finish == "length" and "".join(shown) == "a tree"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(alphabet="ab<>/ ", min_size=0, max_size=4), min_size=1, max_size=20),
    st.lists(st.integers(1, 5), min_size=20, max_size=20),
    st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=5), min_size=1, max_size=4),
)
def test_the_streamed_text_never_holds_any_part_of_the_stop_string_that_ended_it(pieces, steps, stop):
    stop = tuple(stop)
    shown, finish = stream(pieces, steps, stop)
    text, reason = expected(pieces, stop)
    assert "".join(shown) == text
    assert finish == reason
