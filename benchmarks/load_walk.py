"""Walk one profile's load and count, for each loading module, how often control enters it from
another module (a call whose caller sits in a different file), and the reads that cost time: each
tokenizer loaded, each JSON file read (the cost store, the GGUF layouts, the stored measurements).
The first load of a process pays for imports and
the machine's one-time measurements, so the walk is of a second load (what a server restart, a
bench grid row or `cactus chat` pays):

    python benchmarks/load_walk.py                  # the embedded default profile
    python benchmarks/load_walk.py --profile PATH   # any profile
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

from transformers import AutoTokenizer

from cactus_cli.app.session import Session

WATCHED = {  # the modules a load walks through, by name (before the folders by purpose, all in infer/)
    *("plan", "loader", "models", "sources", "devices", "embedded", "gguf", "gguf_layout", "vocab"),
    *("costs", "store", "rates", "policy"),
}


def short(filename: str) -> str | None:
    path = Path(filename)
    parts = path.as_posix().split("/cactus_cli/infer/")
    return parts[1] if len(parts) == 2 and path.stem in WATCHED else None


def walk(profile: str | None) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    entries: collections.Counter = collections.Counter()
    functions: collections.Counter = collections.Counter()
    reads: collections.Counter = collections.Counter()

    def on_event(frame, event, arg):
        if event == "call" and (callee := short(frame.f_code.co_filename)) is not None:
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            if Path(caller).as_posix() != Path(frame.f_code.co_filename).as_posix():
                entries[callee] += 1
                caller_name = short(caller) or Path(caller).name
                functions[(callee, frame.f_code.co_name, caller_name, frame.f_back.f_code.co_name)] += 1

    descriptor = AutoTokenizer.__dict__["from_pretrained"]  # (the classmethod itself, put back after)
    tokenizer_load, read_text = AutoTokenizer.from_pretrained, Path.read_text

    def counted_tokenizer(name, *a, **k):
        reads[f"tokenizer {Path(str(name)).name}"] += 1
        return tokenizer_load(name, *a, **k)

    def counted_read(self, *a, **k):
        if self.suffix == ".json":
            reads[f"file {self.name}"] += 1
        return read_text(self, *a, **k)

    AutoTokenizer.from_pretrained, Path.read_text = counted_tokenizer, counted_read
    sys.setprofile(on_event)
    try:
        Session.load(profile)
    finally:
        sys.setprofile(None)
        AutoTokenizer.from_pretrained, Path.read_text = descriptor, read_text
    return entries, reads, functions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="a profile name or path (default: the embedded default)")
    ap.add_argument("--functions", action="store_true", help="also each function entered, and from where")
    args = ap.parse_args()
    Session.load(args.profile)  # (imports, first-start measurements)
    entries, reads, functions = walk(args.profile)
    print("entries into each loading module from another module, second load:")
    for module, n in sorted(entries.items()):
        print(f"  {n:4d}  {module}")
        if args.functions:
            for (callee, name, caller, caller_name), m in sorted(functions.items()):
                if callee == module:
                    print(f"        {m:3d}  {name}  <- {caller}:{caller_name}")
    print("reads:")
    for what, n in sorted(reads.items()):
        print(f"  {n:4d}  {what}")


if __name__ == "__main__":
    main()
