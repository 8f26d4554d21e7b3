"""JSON output on a real pair: the same requests with and without a grammar (response_format's
json_schema), each answer checked against its schema; tokens per second, drafts cut by the grammar,
MAL, and the time the masks take.

    python benchmarks/json_output.py [--profile cactus] [-n 256] [--rule sps] [-k auto]

Runs on the embedded default pair unless a profile says otherwise; one process, one run at a time."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from cactus_cli.app.session import Session
from cactus_cli.infer import grammar as G

TASKS = [
    (
        "Extract the person as JSON: Ada Lovelace, born 1815 in London, mathematician; "
        "email ada@example.org; interests: engines, poetry.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "born": {"type": "integer"},
                "city": {"type": "string"},
                "email": {"type": "string"},
                "interests": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "born", "city", "email", "interests"],
            "additionalProperties": False,
        },
    ),
    (
        "List three Python web frameworks as JSON with their name, first release year and a one-line summary.",
        {
            "type": "object",
            "properties": {
                "frameworks": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "year": {"type": "integer"},
                            "summary": {"type": "string"},
                        },
                        "required": ["name", "year", "summary"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["frameworks"],
            "additionalProperties": False,
        },
    ),
    (
        "Return a JSON object describing this function: def add(a: int, b: int) -> int: return a + b. "
        "Give its name, its parameters (name and type) and its return type.",
        None,
    ),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None)
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    ap.add_argument("--rule", default="sps")
    ap.add_argument("-k", default="auto")
    args = ap.parse_args()
    given = {"max_tokens": args.max_tokens, "rule": args.rule, "num_draft_tokens": args.k, "temperature": 0.0}
    session = Session.load(profile=args.profile, **given)
    masks = {"seconds": 0.0, "calls": 0}
    original = G.Constraint.masks

    def timed(self, drafts):
        t0 = time.perf_counter()
        try:
            return original(self, drafts)
        finally:
            masks["seconds"] += time.perf_counter() - t0
            masks["calls"] += 1

    G.Constraint.masks = timed
    print("| task | grammar | tokens | tok/s | MAL | drafted | kept | mask ms/step | valid JSON |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, (prompt, schema) in enumerate(TASKS):
        ids = session.encode([{"role": "user", "content": prompt}])
        session.prepare(len(ids))
        for grammar in (None, G.Grammar.json_schema(schema)):
            params = dataclasses.replace(session.params(), grammar=grammar)
            masks.update(seconds=0.0, calls=0)
            session.engine.reset()
            t0 = time.perf_counter()
            events = list(session.engine.generate(ids, params))
            wall = time.perf_counter() - t0 - events[0].prefill_seconds
            tokens = sum(len(e.emitted) for e in events)
            text = "".join(e.text for e in events)
            drafted = sum(e.num_drafted for e in events)
            kept = sum(len(e.accepted) for e in events)
            try:
                json.loads(text)
                valid = "yes"
            except ValueError:
                valid = "no"
            mask_ms = 1000 * masks["seconds"] / max(masks["calls"], 1)
            label = "none" if grammar is None else ("schema" if schema else "any object")
            print(
                f"| {i + 1} | {label} | {tokens} | {tokens / wall:.2f} | {tokens / len(events):.2f} | {drafted} | "
                f"{kept} | {mask_ms:.2f} | {valid} |",
                flush=True,
            )
            if grammar is not None and valid == "no":
                print("  (the answer: " + json.dumps(text[:300]) + ")")


if __name__ == "__main__":
    main()
