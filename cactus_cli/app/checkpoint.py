"""eval --out DIR keeps every finished problem, so a long eval can stop and go on: each problem's
generations (configuration, stats, text, verdict) are appended to DIR/progress.jsonl as soon as
they are graded, behind a first line naming the run (a digest of its settings, grid, samples and
problems). ``--resume`` reads them back and the run does only the rest; a folder holding another
run, or a run without --resume, is refused, so no finished work is overwritten or mixed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cactus_cli.app.grid import Generated
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.stats import SpecStats

FILE = "progress.jsonl"


def run_key(settings: dict[str, Any], labels: list[str], samples: int, problems: list[str]) -> str:
    """What must match for earlier results to count as this run's."""
    keep = {k: v for k, v in settings.items() if k not in ("description", "remember", "history")}  # (not results)
    doc = json.dumps(
        {"settings": keep, "grid": labels, "samples": samples, "problems": problems}, sort_keys=True, default=str
    )
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


class Checkpoint:
    def __init__(self, folder: Path, key: str, resume: bool):
        self.path = folder / FILE
        self.key = key
        self.done: dict[str, list[Generated]] = {}
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
                f.write(json.dumps({"run": key}) + "\n")

    def _read(self) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            head = json.loads(lines[0])
        except (json.JSONDecodeError, IndexError):
            raise ConfigError(f"{self.path}: not an eval progress file; give another --out folder") from None
        if head.get("run") != self.key:
            raise ConfigError(
                f"--resume: {self.path} is from a run with other settings, grid, samples or problems "
                "(each must match); give another --out folder, or the same options as that run"
            )
        for n, line in enumerate(lines[1:], start=2):
            try:
                row = json.loads(line)
                gens = [
                    Generated(
                        g["label"],
                        SpecStats(**g["stats"]),
                        g["text"],
                        tuple(g["verdict"]) if g["verdict"] is not None else None,
                    )
                    for g in row["generated"]
                ]
            except (ValueError, KeyError, TypeError, RecursionError):
                if n == len(lines):  # a line cut short by a kill: that problem is simply done again
                    self._truncate(lines[: n - 1])
                    break
                raise ConfigError(f"{self.path}:{n}: not a progress record; give another --out folder") from None
            self.done[row["problem"]] = gens

    def _truncate(self, lines: list[str]) -> None:
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
