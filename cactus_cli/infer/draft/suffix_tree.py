"""The suffix tree SuffixDecoding drafts from (Oliaro et al., NeurIPS 2025), over a set of
token documents: for any context, the node of its longest matching suffix, and that node's
children with counts, the empirical distribution of the token that follows.

The tree is kept implicitly: the documents, plus an index from every one- and two-token context
to where it occurred. A draft reads the most recent occurrences of the context's last two tokens
(MAX_SCAN), extends each match backwards (up to MAX_MATCH tokens), and counts the continuations
of those that match the last m tokens: exactly the counts on the explicit tree's node, for the
occurrences read. It costs two index entries per token instead of one node per (token, depth):
measured on 65k tokens of Python source with the Qwen tokenizer, an explicit tree of depth 16
held 13.6 nodes per token (114 MiB at 32k tokens, 149 us to add a token); this holds both in a
fraction of that (README, "Drafts from memory").

``History`` holds earlier documents (prompts and outputs) under a token budget, evicting the
least recently used document, and saves itself to a file when asked (``--remember``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import stat
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from cactus_cli.core.fileio import atomic_write, write_target

MAX_MATCH = 16  # longest context matched (the tree's depth above the drafted path)
EVIDENCE = 1.0  # the weight of "something not seen yet" after one matched token (follow)
MAX_SCAN = 256  # occurrences of the last two tokens read per draft, most recent first
HISTORY_TOKENS = 65536  # the history's token budget (README: resident size at this budget)
FORMAT, SCHEMA = "cactus-suffix-history", 1
_SPAN = 1 << 24  # index keys: a token t for a one-token context, _SPAN * (a + 1) + b for (a, b)


class SuffixTree:
    """Documents and, for every one- and two-token context, where it occurred (most recent
    last). The tree's node for a matched suffix is the set of its occurrences; its children's
    counts are counted from them when a draft is asked for."""

    def __init__(self) -> None:
        self.docs: dict[int, Sequence[int]] = {}
        self.index: dict[int, list[int]] = {}  # key -> positions (doc << 32 | offset of the following token)
        self.indexed: dict[int, int] = {}  # doc -> tokens indexed
        self.stale = 0  # index entries of removed documents (dropped when they outnumber the live ones)

    @property
    def entries(self) -> int:
        return sum(self.indexed.values()) * 2

    def add(self, doc: int, tokens: Sequence[int]) -> None:
        """Index ``tokens`` as document ``doc``; a document that grew (the request so far, a
        chat) is indexed from where it was left."""
        self.docs[doc] = tokens
        index = self.index
        for o in range(max(self.indexed.get(doc, 0), 1), len(tokens)):
            pos = doc << 32 | o
            index.setdefault(tokens[o - 1], []).append(pos)
            if o >= 2:
                index.setdefault(_SPAN * (tokens[o - 2] + 1) + tokens[o - 1], []).append(pos)
        self.indexed[doc] = max(len(tokens), self.indexed.get(doc, 0))

    def remove(self, doc: int) -> None:
        self.docs.pop(doc, None)
        self.stale += 2 * self.indexed.pop(doc, 0)
        if self.stale > self.entries:
            self.index, self.indexed, self.stale = {}, {}, 0
            for d, tokens in self.docs.items():
                self.add(d, tokens)

    def occurrences(self, context: Sequence[int]) -> list[tuple[int, int, Sequence[int], int]]:
        """(match length, document id, its tokens, offset of the following token) for the most recent
        occurrences of the context's last two tokens (its last one when they never occurred
        together), each extended backwards up to MAX_MATCH tokens."""
        if not context:
            return []
        positions = self.index.get(_SPAN * (context[-2] + 1) + context[-1]) if len(context) >= 2 else None
        base = 2
        if not positions:
            positions, base = self.index.get(context[-1]), 1
            if not positions:
                return []
        out, n = [], len(context)
        for pos in reversed(positions[-MAX_SCAN:]):
            tokens = self.docs.get(pos >> 32)
            if tokens is None:
                continue
            o = pos & 0xFFFFFFFF
            m = base
            while m < MAX_MATCH and m < n and m < o and tokens[o - 1 - m] == context[n - 1 - m]:
                m += 1
            out.append((m, pos >> 32, tokens, o))
        return out

    def best(self, context: Sequence[int], k: int, min_prob: float) -> Match | None:
        """The node to draft from after ``context``: for each match length m, the occurrences
        matching the last m tokens are a node of the suffix tree; from it, follow the most
        frequent next token while the path's estimated probability stays >= ``min_prob`` (at
        most k tokens). The node whose path has the largest expected accepted length (the sum of
        its path probabilities) wins; ties: the longer match. None when no path has a token."""
        occ = self.occurrences(context)
        best: Match | None = None
        for m in sorted({x[0] for x in occ}):
            node = [(tokens, o) for length, _, tokens, o in occ if length >= m]
            steps: list[float] = []
            tokens, _, score = follow(node, k, min_prob, matched=m, steps=steps)
            if tokens and (best is None or score >= best.score):
                best = Match(score, m, node, next(d for length, d, _, _ in occ if length >= m), tokens, steps)
        return best


@dataclass
class Match:
    score: float  # expected accepted tokens of the most frequent path (sum of its path probabilities)
    length: int  # tokens of context matched
    node: list[tuple[Sequence[int], int]]  # the occurrences: (document, offset of the following token)
    doc: int  # the document of the most recent one
    tokens: list[int]  # the most frequent path
    steps: list[float]  # each of its tokens' estimated probability given the ones before (follow)


def follow(
    node: list[tuple[Sequence[int], int]],
    k: int,
    min_prob: float,
    rng: random.Random | None = None,
    matched: int = 1,
    steps: list[float] | None = None,
) -> tuple[list[int], list[dict[int, float]], float]:
    """Up to k tokens from ``node`` (the occurrences of the last ``matched`` tokens): the most
    frequent next token each time, or with ``rng`` one drawn by frequency, while the path's
    estimated probability stays >= ``min_prob``. Returns the tokens, the distribution each was
    drawn from, and the score (the sum of the path probabilities); ``steps``, if given, receives
    each token's estimate given the ones before it (what -k auto sizes a draft by: policy.py).

    A step's estimate is count / (total + EVIDENCE / context), the context being the tokens
    matched so far: one earlier occurrence after a single matched token is a coin flip (1/2),
    after 16 it is near certain (16/17). (Raw frequencies made a lone occurrence certain: on
    open-ended writing the drafts ran long and 3% of them were accepted.)

    Drawn, a token that would take the path below ``min_prob`` ends the draft, so a drafted
    token is distributed as the counts restricted to the tokens that keep the path above it;
    that restricted distribution is what is returned (SpS needs the true draft distribution)."""
    tokens: list[int] = []
    dists: list[dict[int, float]] = []
    score, prob = 0.0, 1.0
    for t in range(k):
        counts: dict[int, int] = {}
        for seq, o in node:
            if o + t < len(seq):
                x = seq[o + t]
                counts[x] = counts.get(x, 0) + 1
        if not counts:
            break
        total = sum(counts.values()) + EVIDENCE / (matched + t)
        if rng is None:
            token = max(counts, key=counts.__getitem__)  # (ties: the most recent occurrence's, counted first)
        else:
            token = rng.choices(list(counts), weights=list(counts.values()))[0]
        if prob * counts[token] / total < min_prob:
            break
        kept = {x: c for x, c in counts.items() if prob * c / total >= min_prob}
        kept_total = sum(kept.values())  # (the draft distribution: the counts themselves)
        dists.append({x: c / kept_total for x, c in kept.items()})
        prob *= counts[token] / total
        if steps is not None:
            steps.append(counts[token] / total)
        tokens.append(token)
        score += prob
        node = [(seq, o) for seq, o in node if o + t < len(seq) and seq[o + t] == token]
    return tokens, dists, score


class History:
    """Earlier documents (a request's prompt and output, or a chat so far) in one suffix tree,
    at most ``budget`` tokens, the least recently used evicted first (a draft uses the document
    of the most recent occurrence it followed). With ``path`` it is saved after every change
    (``--remember``): under a lock, merged with what other runs saved there since (read, add,
    write atomically), so runs sharing a file lose nothing; a file it cannot use is moved aside
    (``FILE.bad-<time>``), never overwritten. A file is at most MAX_FILE_BYTES and MAX_DOCS
    documents; loading reads it once and indexes only the most recent documents within the
    budget."""

    def __init__(
        self, budget: int = HISTORY_TOKENS, path: Path | None = None, key: str = "", vocab_size: int | None = None
    ):
        self.budget, self.path, self.key, self.vocab_size = budget, path, key, vocab_size
        self.tree = SuffixTree()
        self.order: OrderedDict[int, None] = OrderedDict()  # document ids, least recently used first
        self.tokens = 0
        self.next_id = 1  # (0 is the request's own document in a drafter's request tree)
        self.last: int | None = None  # the document added last (a chat's next turn extends it)
        self.on_error: Callable[[str], None] | None = None  # told once when saving fails (the run goes on)
        self.on_note: Callable[[str], None] | None = None  # told when an unusable file is moved aside
        self.saved: dict[int, list[int]] = {}  # our documents as the file last held them (to merge)

    def add(self, seq: Sequence[int]) -> None:
        """Remember a finished sequence; one that continues the last one added (the next chat
        turn, which repeats the conversation so far) extends it instead of counting it twice."""
        self._add(seq)
        self.save()

    def _add(self, seq: Sequence[int]) -> None:
        tokens = array("i", seq[-self.budget :])
        last = self.tree.docs.get(self.last) if self.last is not None else None
        if last is not None and len(tokens) >= len(last) and tokens[: len(last)] == last:
            if len(tokens) == len(last):
                return
            self.tokens += len(tokens) - len(last)
        else:
            self.last, self.next_id = self.next_id, self.next_id + 1
            self.tokens += len(tokens)
        self.tree.add(self.last, tokens)
        self.order[self.last] = None
        self.order.move_to_end(self.last)
        while self.tokens > self.budget and len(self.order) > 1:
            doc, _ = self.order.popitem(last=False)
            self.tokens -= len(self.tree.docs[doc])
            self.tree.remove(doc)
            if doc == self.last:
                self.last = None

    def touch(self, doc: int) -> None:
        """A draft came from ``doc``: it is the most recently used."""
        if doc in self.order:
            self.order.move_to_end(doc)

    def save(self) -> None:
        if self.path is None:
            return
        try:
            with _locked(write_target(self.path).parent):  # the folder atomic_write replaces the file in
                ours = {d: self.tree.docs[d].tolist() for d in self.order}
                docs = self._others() + list(ours.values())  # theirs first (older), ours most recent
                docs = _within(docs, self.budget)
                data = {"format": FORMAT, "schema": SCHEMA, "key": self.key, "docs": docs}
                atomic_write(self.path, json.dumps(data, separators=(",", ":")), mode=0o600)  # (what the user typed)
                self.saved = ours
        except OSError as err:
            if self.on_error is not None:
                self.on_error(
                    f"--remember {self.path}: cannot save the history ({err.strerror or err}); "
                    "it is kept in memory for this run"
                )
                self.on_error = None

    def _others(self) -> list[list[int]]:
        """The documents in the file now that are not this run's (other runs saved them, or this
        run has evicted them); a file that cannot be used is moved aside first."""
        data, problem = _read(self.path, self.key, self.vocab_size)
        if problem is not None:
            if self.path.is_file():
                aside = self.path.with_name(f"{self.path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}")
                os.replace(self.path, aside)
                if self.on_note is not None:
                    self.on_note(f"--remember {self.path}: {problem}; moved it aside to {aside.name} (nothing deleted)")
            return []
        docs = data["docs"]
        for tokens in self.saved.values():  # this run's earlier versions: replaced by what it holds now
            with contextlib.suppress(ValueError):
                docs.remove(tokens)
        return docs

    @classmethod
    def load(cls, path: Path, key: str, vocab_size: int, budget: int = HISTORY_TOKENS) -> tuple[History, str | None]:
        """The history saved at ``path`` (kept there as it grows), or an empty one when there is
        no file yet; a file that is unreadable, too large, of another format or written for
        another tokenizer gives an empty history and a one-line warning (the file is moved aside
        at the first save, never overwritten)."""
        history = cls(budget, path=path, key=key, vocab_size=vocab_size)
        if not path.exists():
            return history, None
        data, problem = _read(path, key, vocab_size)
        if problem is not None:
            return history, (
                f"--remember {path}: {problem}; starting with an empty history (the file is moved aside "
                f"to {path.name}.bad-<time> at the first save, not deleted)"
            )
        for tokens in _within(data["docs"], budget):  # one pass: only what the budget keeps is indexed
            history._add(tokens)
            history.saved[history.last] = list(tokens)
            history.last = None  # (each saved document stands alone)
        return history, None


MAX_FILE_BYTES = 16 << 20  # a --remember file is at most this (the token budget saves ~0.5 MB)
MAX_DOCS = 4096  # and at most this many documents


def _within(docs: list[list[int]], budget: int) -> list[list[int]]:
    """The most recent documents (the list's end) that fit ``budget`` tokens and MAX_DOCS."""
    kept, total = [], 0
    for tokens in reversed(docs[-MAX_DOCS:]):
        total += min(len(tokens), budget)
        if total > budget and kept:
            break
        kept.append(tokens[-budget:])
    return kept[::-1]


def _read(path: Path, key: str, vocab_size: int | None) -> tuple[Any, str | None]:
    """A history file's data, or why it cannot be used."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a device or FIFO (--remember /dev/null): written to, never read
            return {"docs": []}, None
        size = st.st_size
        if size > MAX_FILE_BYTES:
            return None, f"it is {size / 2**20:.0f} MB, over the {MAX_FILE_BYTES >> 20} MB a history file may be"
        data: Any = json.loads(path.read_text(encoding="utf-8"))
        return data, _problem(data, key, vocab_size)
    except FileNotFoundError:
        return {"docs": []}, None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        return None, f"it cannot be read ({type(err).__name__})"


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` (flock on the directory itself: no lock file is left
    behind), held while a history file in it is read, merged and replaced."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


def _problem(data: Any, key: str, vocab_size: int | None) -> str | None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return "not a cactus suffix history"
    if data.get("schema") != SCHEMA:
        return f"written by another version (schema {data.get('schema')!r}, expected {SCHEMA})"
    if data.get("key") != key:
        return f"written for another tokenizer ({data.get('key')!r}, this run uses {key!r})"
    docs = data.get("docs")
    if not isinstance(docs, list) or not all(isinstance(d, list) for d in docs):
        return "its documents are malformed"
    if len(docs) > MAX_DOCS:
        return f"it holds {len(docs)} documents, over the {MAX_DOCS} a history file may hold"
    if vocab_size is not None and not all(type(t) is int and 0 <= t < vocab_size for d in docs for t in d):
        return f"it holds token ids outside this vocabulary (0..{vocab_size - 1})"
    return None
