"""The conditions a measurement of this machine was taken under, and a watch on later runs.

Every choice cactus makes from timings (llama.cpp's threads and weight type, the torch dtype and
int8 kind) is stored with when it was taken and the share of the CPU its threads got. A timing
beside another busy process is stored as provisional and taken again at the next start; a stored
curve that later runs beat persistently (``Watch``) was slowed by something too, and is marked
provisional the same way. ``cactus models remeasure`` forgets them all.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from typing import Any, Callable

from cactus_cli.core.errors import warn

QUIET_SHARE = 0.7  # of the CPU time its threads could use, a timing must get to count as quiet
MIN_WALL = 0.01  # seconds: a shorter timing tells nothing of its share (a scheduler slice is ~3 ms)


def cpu_share(wall: float, cpu: float, threads: int) -> float:
    """Of the CPU time ``threads`` threads could use in ``wall`` seconds, the share this process got
    (llama.cpp's threads spin: ~1.0 on a quiet machine, ~0.5 beside another busy process on 2 cores).
    (torch's threads spin between the calls of a timing loop too). A timing too short to tell
    counts as quiet."""
    return cpu / (wall * threads) if wall >= MIN_WALL else 1.0


class Conditions:
    """The load a measurement was taken under: the machine's load average before it, and the share
    of the CPU time each timing's threads could have used that the process got (``cpu_share``).
    A measurement that is not quiet is stored as provisional and taken again at the next start."""

    def __init__(self, load: float | None):
        self.load = load
        self.shares: dict[str, float] = {}
        self._spent: dict[str, tuple[float, float]] = {}  # label -> (wall, cpu) seconds, summed over its timings

    @classmethod
    def start(cls) -> Conditions:
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):  # (no load average on this system)
            load = None
        return cls(load)

    def measure(self, threads: int, fn: Callable[[], Any], label: str | None = None) -> Any:
        """``fn()``, its CPU share counted under ``label`` (several timings of one label add up)."""
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        key = label or str(threads)
        before = self._spent.get(key, (0.0, 0.0))
        self._spent[key] = wall, cpu = before[0] + wall, before[1] + cpu
        self.shares[key] = round(cpu_share(wall, cpu, threads), 3)
        return out

    def finish(self) -> dict[str, Any]:
        """What the stored measurement says of its conditions (the load average is kept to read, not
        judged: it counts this process's own loading just before)."""
        quiet = min(self.shares.values(), default=1.0) >= QUIET_SHARE
        return {
            "taken": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "quiet": quiet,
            "load": self.load,
            "cpu_share": self.shares,
        }


def taken(result: dict[str, Any]) -> str:
    """When a measurement was taken and under what load, in words."""
    when = str(result.get("taken", ""))[:16].replace("T", " ") or "before loads were recorded"
    if result.get("quiet") is False:
        why = "later runs beat it" if result.get("drift") else "beside another busy process"
        return f"provisional: measured {when} {why}; measured again at the next start"
    return f"measured {when}" + (", quiet" if result.get("quiet") else "")


WATCH_STEPS = 32  # calls at a measured width before live timings are held against the stored curve
FASTER, SLOWER = 0.75, 2.0  # live / stored medians past these are said (a long context alone costs < 2x)


class Watch:
    """Live timings of the calls a stored measurement priced (``curve``: width -> seconds), held
    against it once ``WATCH_STEPS`` have run at measured widths (their median ratio). Persistently
    faster: the measurement was slowed by another process although it looked quiet; ``mark``
    stores it as provisional (the next start measures again) and it is said once. Persistently
    slower: something is busy now; said once, with the command that measures again."""

    def __init__(self, what: str, curve: dict[int, float], result: dict[str, Any], mark: Callable[[float], None]):
        self.what, self.curve, self.result, self.mark = what, curve, result, mark
        self.ratios: list[float] = []
        self.said: float | None = None  # the ratio said, once

    def add(self, width: int, seconds: float) -> None:
        expected = self.curve.get(width)
        if expected is None or expected <= 0 or self.said is not None:
            return
        self.ratios.append(seconds / expected)
        if len(self.ratios) < WATCH_STEPS:
            return
        ratio = statistics.median(self.ratios[-WATCH_STEPS:])
        if ratio < FASTER:
            self.said = ratio
            self.mark(ratio)
            warn(
                f"{self.what} run {1 / ratio:.2f}x faster than the measurement its choice was made from "
                f"({taken(self.result)}): that measurement was slowed by something else; it is taken again at "
                "the next start (or now: `cactus models remeasure`)"
            )
        elif ratio > SLOWER:
            self.said = ratio
            warn(
                f"{self.what} run {ratio:.2f}x slower than measured ({taken(self.result)}): another process may be "
                "busy now; if the measurement is what is wrong, `cactus models remeasure` takes it again"
            )
