"""The cost store: what steps cost (costs.py's ``CostModel``) and how often drafts are accepted
(rates.py), kept per (pair, device, dtype, threads, torch, backend, quantization) in
``$CACTUS_HOME/costs``, so the next run starts informed. The store is handed its key and the
drafters' names as plain data: the key of a loaded pair or of a load plan is made above it
(pair/keys.py), so nothing here knows a backend, a device, a drafter or a loader.

The probe's conditions are stored with it (core/conditions.py): a probe taken beside another
busy process, or before conditions were recorded, is provisional and taken again at the next
start (``needs_probe``); this run's verifies are held against the cached curve (``Watch``), and a
cache they beat persistently is marked provisional the same way."""

from __future__ import annotations

import atexit
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from cactus_cli.core.conditions import Watch
from cactus_cli.core.events import MODEL
from cactus_cli.core.fileio import atomic_write
from cactus_cli.core.once import once
from cactus_cli.core.paths import cache_path
from cactus_cli.infer.kpolicy.costs import MAX_WIDTH, CostModel, Step, best_k, tokens_per_second
from cactus_cli.infer.kpolicy.rates import Acceptance, Calibration

SCHEMA = 3
_PROBED: set[str] = set()  # the stores this process probed (a provisional probe is taken again once per start)
SAVE_EVERY = 1.0  # seconds: the engine saves after every run; a server's many short runs write at most this often
_UNSAVED: set[CostStore] = set()  # stores whose last save was put off (held, so none is lost before exit)


def valid_counts(acc: Any, tested: Any) -> bool:
    """Acceptance counts as saved: finite, non-negative, accepted <= tested at each position."""
    if not (isinstance(acc, list) and isinstance(tested, list) and len(acc) <= MAX_WIDTH and len(tested) <= MAX_WIDTH):
        return False
    nums = [x for x in acc + tested if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    if len(nums) != len(acc) + len(tested) or any(x < 0 for x in nums):
        return False
    return all(a <= t + 1e-9 for a, t in zip(acc, tested))


class CostStore:
    """What steps cost on this machine and how often drafts are accepted, for one (pair, device,
    dtype, threads, torch): loaded from ``path`` when there is a valid cache, taught by finished
    steps (``observe``), saved atomically. Both k policies (policy.py) read it; warm-up runs do
    not teach it (the engine runs them with ``learn=False``)."""

    def __init__(self, path: Path | None = None, key: dict[str, Any] | None = None, kinds: tuple[str, ...] = ()):
        self.path = path
        self.key = key or {}
        self.kinds = kinds  # the model-free drafters whose timings a cache keeps (draft.KINDS' names)
        self.costs = CostModel(kinds=kinds)
        self.acceptance: dict[str, Acceptance] = {}
        self.calibrations: dict[str, Calibration] = {}  # (akey, source, run or fresh) -> acceptance by estimate
        self.dirty = False
        self.saved_at = -math.inf  # (time.monotonic) of the last write
        self.notes: list[str] = []  # what loading the cache had to drop, for the user (one line)
        self.conditions: dict[str, Any] | None = None  # the probe's (Conditions.finish); None: not recorded
        self.watch: Watch | None = None  # this run's verifies against the cached curve
        self.stamp = file_stamp(path)  # the file as this store last read or wrote it (None: no file)
        if path is not None and path.is_file():
            self._load(path)
        self.watch = self._watching()

    def _watching(self) -> Watch | None:
        if not self.costs.cached:
            return None
        curve = {w: statistics.median(self.costs.verify[w]) for w in sorted(self.costs.cached)}
        return Watch("verifies", curve, self.conditions or {}, self._drifted)

    @property
    def provisional(self) -> bool:
        """The stored timings are not to be trusted as they are: the probe ran beside another busy
        process, later runs beat it (Watch), or it was taken before conditions were recorded."""
        return bool(self.costs.verify) and (self.conditions is None or self.conditions.get("quiet") is False)

    def needs_probe(self, source: str = MODEL) -> bool:
        """Whether a -k auto start should probe: nothing known for ``source`` yet, or a provisional
        probe this process has not taken again."""
        return not self.costs.knows(source) or (self.provisional and str(self.path) not in _PROBED)

    def probed(self, conditions: dict[str, Any]) -> None:
        """A probe just measured every width under ``conditions``; saved now."""
        self.conditions = conditions
        self.watch = None  # (nothing cached is left to hold live timings against)
        _PROBED.add(str(self.path))
        self.stamp = file_stamp(self.path)  # (a fresh probe replaces whatever the file holds now)
        self.dirty = True
        self.save()

    def _drifted(self, ratio: float) -> None:
        """The Watch's mark: this run's verifies beat the cached ones persistently (``ratio``: live
        over stored), so the cache was taken beside another busy process; saved as provisional."""
        self.conditions = {**(self.conditions or {}), "quiet": False, "drift": round(ratio, 3)}
        self.dirty = True
        self.save()

    @classmethod
    def read(cls, key: dict[str, Any], kinds: tuple[str, ...] = ()) -> CostStore:
        """The store cached for ``key`` (empty when there is none), with what this process's
        earlier stores of that key put off writing."""
        path = cache_path(key)
        for store in [s for s in list(_UNSAVED) if s.path == path]:  # (a copy: a serve worker may add to it meanwhile)
            store.save()
        return cls(path, key, kinds)

    def _load(self, path: Path) -> None:
        """Read the cache file, keeping only valid entries; invalid ones are dropped, said once,
        and never written back (the next save rewrites the file without them)."""
        dropped = 0
        try:
            doc = json.loads(once(("cost store", str(path)), lambda: path.read_text(encoding="utf-8")))
            if doc.get("schema") != SCHEMA:
                return
            self.costs, dropped = CostModel.from_json(doc.get("costs", {}), "cache", self.kinds)
            conditions = doc.get("conditions")
            self.conditions = conditions if isinstance(conditions, dict) else None
            for name, pair in doc.get("acceptance", {}).items():
                acc, tested = pair if isinstance(pair, list) and len(pair) == 2 else (None, None)
                if isinstance(name, str) and valid_counts(acc, tested):
                    self.acceptance[name] = Acceptance([float(x) for x in acc], [float(x) for x in tested])
                else:
                    dropped += 1
            for name, pair in doc.get("calibration", {}).items():
                acc, tested = pair if isinstance(pair, list) and len(pair) == 2 else (None, None)
                if (
                    isinstance(name, str)
                    and valid_counts(acc, tested)
                    and len(acc) == len(tested) == len(Calibration().tested)
                ):
                    self.calibrations[name] = Calibration([float(x) for x in acc], [float(x) for x in tested])
                else:
                    dropped += 1
        except (OSError, ValueError, TypeError, AttributeError, RecursionError):
            self.costs, self.acceptance = (
                CostModel(kinds=self.kinds),
                {},
            )  # unreadable: a missed head start, measured again
            self.notes.append(f"the step-cost cache {path.name} is unreadable; measuring again and replacing it")
            self.dirty = True
            return
        if dropped:
            self.notes.append(
                f"dropped {dropped} invalid entr{'y' if dropped == 1 else 'ies'} from the step-cost "
                f"cache {path.name} (it is rewritten without them)"
            )
            self.dirty = True

    def rates(self, akey: str, k_max: int, source: str = MODEL) -> list[float]:
        """The acceptance estimate per draft position for drafts from ``source`` (nothing stored)."""
        return self.acceptance.get(f"{akey} {source}", Acceptance()).rates(k_max)

    def observe(self, step: Step) -> None:
        """One finished step: its drafts' acceptance and its timings. A draft forward that caught
        up on many missed tokens (after k = 0 steps) is not a typical drafted token: its timing
        is skipped."""
        if step.k > 0:
            self.acceptance.setdefault(f"{step.akey} {step.source}", Acceptance()).add(step.accepted, step.k)
            if step.timed and (step.source != MODEL or step.fed <= 2):
                self.costs.add_draft(step.draft_seconds / step.k, step.source)
        if step.timed:
            self.observe_verify(step.k + 1, step.verify_seconds)
        self.dirty = True

    def observe_verify(self, width: int, seconds: float) -> None:
        """One verifier call of ``width`` tokens (several runs' rows, stepped together, count as one)."""
        if self.watch is not None:  # (held against the cached curve, at the widths it has)
            self.watch.add(width, seconds)
        self.costs.add_verify(width, seconds)
        if not self.costs.source.endswith("+online"):
            self.costs.source += "+online"
        self.dirty = True

    def describe(self, akey: str | None = None, k_max: int = 8, source: str = MODEL) -> dict[str, Any]:
        """The cost model's figures and, for ``akey``, the acceptance estimate and the predicted
        speed-up per k (read only: describing changes nothing)."""
        out = self.costs.describe(k_max + 1)
        if akey is not None:
            acc = self.acceptance.get(f"{akey} {source}", Acceptance())
            rates = acc.rates(k_max)
            out["draft_source"] = source
            out["acceptance_estimate"] = acc.a
            out["acceptance_by_position"] = rates
            known = self.costs.knows(source)
            out["best_k"] = best_k(self.costs, rates, k_max, source) if known else None
            if known:
                base = 1 / self.costs.t_v(1)
                out["predicted_speedup_by_k"] = {
                    str(k): tokens_per_second(self.costs, rates, k, source) / base for k in range(k_max + 1)
                }
        return out

    def save(self, every: float = 0.0) -> None:
        """Atomically write the timings and acceptance estimates (best effort: a read-only cache
        folder only costs the next run its head start). ``every``: put the write off while the last
        one is younger than this (seconds; the engine's save after each run, SAVE_EVERY): the store
        is then written by the next save or, at the latest, when the process exits."""
        if self.path is None or not self.dirty:
            return
        if time.monotonic() - self.saved_at < every:
            _UNSAVED.add(self)
            return
        if file_stamp(self.path) != self.stamp:
            self._changed_under()
            return
        doc = {
            "schema": SCHEMA,
            "key": self.key,
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "conditions": self.conditions,  # the probe's: when, under what load, whether quiet
            "costs": self.costs.to_json(),
            "acceptance": {k: [v.accepted, v.tested] for k, v in self.acceptance.items()},
            "calibration": {k: [v.accepted, v.tested] for k, v in self.calibrations.items()},
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps(doc, indent=1))
            self.dirty, self.stamp, self.saved_at = False, file_stamp(self.path), time.monotonic()
            _UNSAVED.discard(self)
        except OSError:
            pass

    def _changed_under(self) -> None:
        """The file was removed (`cactus models remeasure`) or rewritten by another process since
        this store read or wrote it: what it holds now replaces what this store held (nothing, when
        removed), never the other way round. The timings are then learned again from the next
        steps; saved without a probe's conditions, they are provisional, so the next start probes."""
        now = CostStore(self.path, self.key, self.kinds)
        vars(self.costs).update(vars(now.costs))  # (in place: the policies hold this CostModel)
        for mine, theirs in ((self.acceptance, now.acceptance), (self.calibrations, now.calibrations)):
            mine.clear()
            mine.update(theirs)
        self.conditions, self.stamp, self.dirty = now.conditions, now.stamp, False
        self.watch = self._watching()


def file_stamp(path: Path | None) -> tuple[int, int, int] | None:
    """What tells one version of a file from another: inode, modification time, size."""
    try:
        st = path.stat() if path is not None else None
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size) if st is not None else None


@atexit.register
def _save_put_off() -> None:
    """The writes ``save(every=...)`` put off (a killed process loses at most SAVE_EVERY of them)."""
    for store in list(_UNSAVED):
        store.save()
