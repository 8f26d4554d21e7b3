"""Reading a thing once per load: inside ``with one_load():`` (app/runtime.py wraps planning and
loading in it), ``once(key, make)`` makes each ``key`` once and hands the same value back after; outside
it, ``make`` runs every time. Planning and loading both look at the tokenizers (to compare
vocabularies, to size the vocabulary, to encode) and at the cost store (a compile choice, the
engine's costs); with this each tokenizer and each cost file is read once, and nothing outlives the
load (a file changed between two loads is read again)."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Hashable, Iterator, TypeVar

T = TypeVar("T")
_MEMO: ContextVar[dict[Hashable, Any] | None] = ContextVar("cactus_load_memo", default=None)


@contextmanager
def one_load() -> Iterator[None]:
    """A scope in which ``once`` remembers (nested scopes share the outer one)."""
    if _MEMO.get() is not None:
        yield
        return
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def once(key: Hashable, make: Callable[[], T]) -> T:
    """``make()``, remembered under ``key`` inside ``one_load`` (an exception is not remembered)."""
    memo = _MEMO.get()
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]
