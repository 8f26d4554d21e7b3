"""JSON output on a real pair: the same requests with and without a grammar (response_format's
json_schema), each answer checked against its schema; tokens per second, drafts cut by the grammar,
MAL, and the time the masks take.

    python benchmarks/json_output.py [--profile cactus] [-n 256] [--rule sps] [-k auto]
    python benchmarks/json_output.py --people 20     # 20 extraction requests: valid answers, decode rates

With --people N: N extraction requests under one schema, each answer checked against it, decode
tok/s with the grammar against without it over the same prompts (after the first token), the
drafts by source (the grammar's forced tokens: source "grammar"), and greedy under a grammar that
allows any text against greedy without one, token for token.

Runs on the embedded default pair unless a profile says otherwise; one process, one run at a time."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from cactus_cli.app.session import Session
from cactus_cli.infer.decode import grammar as G

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


PEOPLE = [
    ("Ada Lovelace", 1815, "London"), ("Alan Turing", 1912, "London"), ("Grace Hopper", 1906, "New York"),
    ("Edsger Dijkstra", 1930, "Rotterdam"), ("Barbara Liskov", 1939, "Los Angeles"),
    ("Donald Knuth", 1938, "Milwaukee"), ("Margaret Hamilton", 1936, "Paoli"), ("John McCarthy", 1927, "Boston"),
    ("Frances Allen", 1932, "Peru"), ("Niklaus Wirth", 1934, "Winterthur"), ("Tony Hoare", 1934, "Colombo"),
    ("Leslie Lamport", 1941, "New York"), ("Radia Perlman", 1951, "Portsmouth"), ("Ken Thompson", 1943, "New Orleans"),
    ("Dennis Ritchie", 1941, "Bronxville"), ("Guido van Rossum", 1956, "Haarlem"), ("Linus Torvalds", 1969, "Helsinki"),
    ("Katherine Johnson", 1918, "White Sulphur Springs"), ("Claude Shannon", 1916, "Petoskey"),
    ("John von Neumann", 1903, "Budapest"),
]  # fmt: skip
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "born": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "born", "city"],
    "additionalProperties": False,
}


def people(session, n: int) -> None:
    rates: dict[str, list[float]] = {"none": [], "schema": []}
    valid, by_source, same = 0, {}, 0
    anything = G.Grammar("lark", "start: /(?s:.*)/")
    for name, year, city in PEOPLE[:n]:
        prompt = f"{name} was born in {year} in {city}. Extract the person as JSON with name, born and city."
        ids = session.encode([{"role": "user", "content": prompt}])
        session.prepare(len(ids))
        for label, grammar in (("none", None), ("schema", G.Grammar.json_schema(PERSON))):
            session.engine.reset()
            events = list(session.engine.generate(ids, dataclasses.replace(session.params(), grammar=grammar)))
            tokens = sum(len(e.emitted) for e in events)
            decode = sum(e.draft_seconds + e.verify_seconds for e in events[1:])
            rates[label].append((tokens - len(events[0].emitted)) / decode if decode else 0.0)
            if grammar is not None:
                text = "".join(e.text for e in events)
                try:
                    doc = json.loads(text)
                    valid += set(doc) == {"name", "born", "city"} and isinstance(doc["born"], int)
                except ValueError:
                    print("  invalid: " + json.dumps(text[:200]))
                for e in events:
                    if e.num_drafted:
                        got = by_source.setdefault(e.draft_source, [0, 0])
                        got[0] += e.num_drafted
                        got[1] += len(e.accepted)
            else:
                free = [t for e in events for t in e.emitted]
        session.engine.reset()
        held = [
            t
            for e in session.engine.generate(ids, dataclasses.replace(session.params(), grammar=anything))
            for t in e.emitted
        ]
        same += held == free
    mean = {k: sum(v) / len(v) for k, v in rates.items()}
    print(f"{n} requests: {valid}/{n} answers valid for the schema")
    print(
        f"decode tok/s (mean over requests): with the schema {mean['schema']:.2f}, without {mean['none']:.2f} "
        f"({mean['schema'] / mean['none']:.2f}x)"
    )
    print("drafts by source (drafted, accepted): " + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in by_source.items()))
    print(f"greedy under a grammar allowing any text equals greedy without one: {same}/{n} requests")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None)
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    ap.add_argument("--rule", default="sps")
    ap.add_argument("-k", default="auto")
    ap.add_argument("--people", type=int, default=0, help="N extraction requests under one schema (at most 20)")
    args = ap.parse_args()
    given = {"max_tokens": args.max_tokens, "rule": args.rule, "num_draft_tokens": args.k, "temperature": 0.0}
    session = Session.load(profile=args.profile, **given)
    if args.people:
        people(session, min(args.people, len(PEOPLE)))
        return
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
