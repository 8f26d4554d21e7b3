"""Greedy answers stepped together against the same answers alone, on the real embedded pair:

    python benchmarks/batch_greedy.py -n 96          # the default profile, 8 requests, 8 slots

Eight requests (built-in prompts and edits of mixed lengths, two sharing a long prefix, two with a
stop string) are generated alone (slot 0, one at a time, each from a cold cache), then all eight in
one batch (one verifier call per step over every slot's rows). Each answer is compared token for
token. Where two answers part, the verifier's two best logits at that position are computed again
from the alone run's prefix (one forward of the prefix, then the one row): a gap of a few rounding
steps is llama.cpp's batched kernels adding in another order (as a verify block and a one-token
step already do, README), not a bug.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from cactus_cli.app.prompts import load_prompts
from cactus_cli.app.session import Session
from cactus_cli.infer.decode.batch import Batch


def requests(session: Session, n: int) -> list[tuple[str, list[int], object]]:
    prompts = load_prompts(None, 4) + load_prompts(None, 2, ["edit"])
    texts = [p.prompt for p in prompts]
    texts += [texts[4] + "\nKeep every comment.", texts[0] + " Answer in one paragraph."]  # shared prefixes
    params = session.params()
    out = []
    for i, text in enumerate(texts):
        stop = ("\n\n",) if i in (1, 6) else ()
        p = dataclasses.replace(params, max_tokens=n // 2 + (n * i) // 16, stop=stop, seed=0)
        out.append((text[:60].replace("\n", " "), session.encode(text), p))
    return out


def gap(session: Session, ids: list[int]) -> float:
    """The top two logits' gap of the verifier after ``ids`` (prefix then one row, slot 0)."""
    engine = session.engine
    slot = engine.slots[0]
    slot.reset()
    with torch.inference_mode():
        slot.verifier.forward(ids[:-1], keep=1)
        logits = slot.verifier.forward(ids[-1:], keep=1)[-1].float()
    slot.reset()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=96, help="the longest answer's tokens (the others shorter)")
    args = ap.parse_args()
    session = Session.load(temperature=0, sequences=8)
    engine = session.engine
    jobs = requests(session, args.n)
    alone = []
    for _, ids, params in jobs:
        engine.reset()
        alone.append([t for ev in engine.generate(ids, params) for t in ev.emitted])
    engine.reset()
    batch = Batch(engine)
    entries = [batch.add(engine.start(ids, params, slot=i)) for i, (_, ids, params) in enumerate(jobs)]
    got = {id(e): [] for e in entries}
    widest = 0
    while len(batch):
        widest = max(widest, len(batch))
        for entry, ev in batch.step():
            if isinstance(ev, BaseException):
                raise ev
            got[id(entry)] += ev.emitted
    same = 0
    for (label, ids, _), entry, want in zip(jobs, entries, alone):
        out = got[id(entry)]
        if out == want:
            same += 1
            print(f"  same   {len(out):4d} tokens  {label!r}")
            continue
        at = next((i for i, (a, b) in enumerate(zip(out, want)) if a != b), min(len(out), len(want)))
        g = gap(session, ids + want[:at]) if at < len(want) else float("nan")
        print(f"  parts  at token {at} of {len(want)} (logit gap {g:.4f} there)  {label!r}")
    print(f"{same}/{len(jobs)} answers equal alone and together ({widest} stepped at once)")


if __name__ == "__main__":
    main()
