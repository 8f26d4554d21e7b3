"""eval --out DIR keeps every finished problem, so a long eval can stop and go on: each problem's
generations (configuration, stats, text, verdict) are appended to DIR/progress.jsonl as soon as
they are graded, behind a first line naming the run (its settings, grid, samples and problems, and
their digest) and each row's rule and parameters. ``--resume`` reads them back and the run does only
the rest; a folder holding another run, or a run without --resume, is refused, so no finished work
is overwritten or mixed. ``records`` is the one reader (benchmarks/eval_tables.py uses it too)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cactus_cli.app.grid.sweep import Generated
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.fileio import read_utf8_file
from cactus_cli.core.stats import SpecStats

FILE = "progress.jsonl"


def run_of(settings: dict[str, Any], labels: list[str], samples: int, problems: list[str]) -> dict[str, Any]:
    """What must match for earlier results to count as this run's (as JSON would read it back)."""
    keep = {k: v for k, v in settings.items() if k not in ("description", "history")}  # (not results)
    keep["draft_params"] = {k: v for k, v in (keep.get("draft_params") or {}).items() if k != "remember"}
    doc = {"settings": keep, "grid": labels, "samples": samples, "problems": problems}
    return json.loads(json.dumps(doc, sort_keys=True, default=str))


def run_key(run: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:16]


def differences(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the run a progress file was made by differs from this one, in words."""
    out = [
        f"{k}: {then['settings'].get(k)!r} then, {now['settings'].get(k)!r} now"
        for k in sorted(set(then["settings"]) | set(now["settings"]))
        if then["settings"].get(k) != now["settings"].get(k)
    ]
    if then["grid"] != now["grid"]:
        out.append(f"rows: {', '.join(then['grid'])} then, {', '.join(now['grid'])} now")
    if then["samples"] != now["samples"]:
        out.append(f"samples: {then['samples']} then, {now['samples']} now")
    if then["problems"] != now["problems"]:
        out.append(f"problems: {len(then['problems'])} then, {len(now['problems'])} now (or others)")
    return out


def records(path: Path) -> tuple[dict[str, Any], dict[str, list[Generated]], bool]:
    """A progress file read back: its first line (the run's key, and each row's rule and parameters),
    each finished problem's generations (every sample, in order), and whether its last line was cut
    short by a kill (that problem is left out). Anything else that does not parse is refused."""
    lines = read_utf8_file(path, "the progress file").splitlines()
    try:
        head = json.loads(lines[0])
    except (json.JSONDecodeError, IndexError):
        head = None
    if not isinstance(head, dict):
        raise ConfigError(f"{path}: not an eval progress file; give another --out folder")
    done: dict[str, list[Generated]] = {}
    for n, line in enumerate(lines[1:], start=2):
        try:
            row = json.loads(line)
            done[row["problem"]] = [
                Generated(
                    g["label"],
                    SpecStats(**g["stats"]),
                    g["text"],
                    tuple(g["verdict"]) if g["verdict"] is not None else None,
                )
                for g in row["generated"]
            ]
        except (ValueError, KeyError, TypeError, RecursionError):
            if n == len(lines):
                return head, done, True
            raise ConfigError(f"{path}:{n}: not a progress record; give another --out folder") from None
    return head, done, False


class Checkpoint:
    def __init__(self, folder: Path, run: dict[str, Any], resume: bool, rows: dict[str, dict[str, Any]] | None = None):
        """``run``: ``run_of`` this run; ``rows``: each row's label -> its rule and parameters, written
        beside it so the file says what its rows are (benchmarks/eval_tables.py checks the rule's
        budget with them)."""
        self.path = folder / FILE
        self.run, self.key = run, run_key(run)
        self.done: dict[str, list[Generated]] = {}
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_file()):  # (a pipe would block)
            raise ConfigError(
                f"--out {folder}: its {FILE} is not a plain file (a folder, a link or a pipe); "
                "remove it or give another folder"
            )
        if self.path.is_file() and self.path.stat().st_size:
            if not resume:
                raise ConfigError(
                    f"--out {folder} already holds an eval ({FILE}); add --resume to go on with it, "
                    "or give another folder"
                )
            self._read()
        else:  # a fresh start (also --resume on a folder with nothing to resume)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w", encoding="utf-8") as f:
                f.write(json.dumps({"run": self.key, "of": run, "rows": rows or {}}) + "\n")

    def _read(self) -> None:
        head, self.done, cut = records(self.path)
        if head.get("run") != self.key:
            try:
                said = differences(head["of"], self.run)
            except (KeyError, TypeError, AttributeError):  # a file from before the run was kept, or edited
                said = []
            what = f" ({'; '.join(said[:3])})" if said else " (each must match)"
            raise ConfigError(
                f"--resume: {self.path} is from a run with other settings, grid, samples or problems{what}; "
                "give the same options and profile as that run, or another --out folder"
            )
        if cut:  # a last line cut short by a kill: that problem is simply done again
            lines = self.path.read_text(encoding="utf-8").splitlines()[:-1]
            self.path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")

    def add(self, problem: str, generated: list[Generated]) -> None:
        """One finished problem, on disk before the next starts."""
        row = {
            "problem": problem,
            "generated": [
                {
                    "label": g.label,
                    "stats": dataclasses.asdict(g.stats),
                    "text": g.text,
                    "verdict": list(g.verdict) if g.verdict is not None else None,
                }
                for g in generated
            ],
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[problem] = generated
