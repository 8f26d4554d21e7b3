"""Greedy speculation against the verifier alone on the real embedded model: where do they part?

    python benchmarks/greedy_drift.py --limit 6 -n 160                  # the default profile (w8a8, bfloat16)
    python benchmarks/greedy_drift.py --limit 6 -n 160 --float32        # the same verifier in float32

For each built-in eval problem, greedy output with the verifier alone and with suffix drafts (fixed
k); at the first token where they part, the verifier's two best logits at that position computed
again two ways: one forward for the context then one row (as plain decoding ends), and the verify
block the speculative run fed at that step (its last token and its drafts, as speculation does).
In exact arithmetic every output is equal; a part with the top two logits a few rounding steps
apart, that also flips between the two ways of computing the same context, is rounding, not a bug.
"""

from __future__ import annotations

import argparse
import dataclasses

from cactus_cli.app import runtime
from cactus_cli.app.config.profile_files import resolve_settings
from cactus_cli.app.eval.tasks import load_tasks
from cactus_cli.infer.decode.engine import SpeculativeEngine
from cactus_cli.infer.draft import Free
from cactus_cli.infer.draft.suffix import SUFFIX


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--float32", action="store_true", help="the verifier in float32, unquantized")
    args = ap.parse_args()
    flags = {"max_tokens": args.n, "temperature": 0, "draft": "suffix"}
    if args.float32:
        flags.update(dtype="float32", quantize="none")
    settings = resolve_settings(None, flags)
    pair = runtime.load_engine(settings).pair
    alone, suffix = SpeculativeEngine(pair, None), SpeculativeEngine(pair, Free(SUFFIX))
    tasks = runtime.encode_prompts(alone, load_tasks(None, args.limit), settings.chat_template)
    base = runtime.generation_params(settings)
    print(f"verifier: {pair.verifier.dtype}, {pair.verifier.quantize_note or 'not quantized'}", flush=True)

    def generate(engine, ids, k, i):
        out, steps = [], []  # steps: (position of the step's first token, its drafts)
        for ev in engine.steps(ids, dataclasses.replace(base, num_draft_tokens=k, adaptive_k=False, seed=i)):
            steps.append((len(out), list(ev.accepted) + list(ev.rejected)))
            out.extend(ev.emitted)
        return out, steps

    runner = alone.runners[0]
    parted = 0
    for i, (_, ids) in enumerate(tasks):
        a, _ = generate(alone, ids, 0, i)
        b, steps = generate(suffix, ids, args.k, i)
        d = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if d is None:
            print(f"problem {i}: equal for {len(a)} tokens", flush=True)
            continue
        parted += 1
        s, drafts = max((p, dr) for p, dr in steps if p <= d)
        seq = ids + a
        runner.reset()
        runner.forward(seq[: len(ids) + d - 1], 1)
        one = runner.forward([seq[len(ids) + d - 1]], 1)[-1].float()
        runner.reset()
        runner.forward(seq[: len(ids) + s - 1], 1)
        block = [seq[len(ids) + s - 1]] + drafts
        blk = runner.forward(block, len(block))[d - s].float()
        (t, ti), (u, ui) = one.topk(2), blk.topk(2)
        print(
            f"problem {i}: part at token {d} (alone {a[d]}, speculative {b[d]}); recomputed, one row: best "
            f"{ti.tolist()} gap {float(t[0] - t[1]):.4f}; the {len(block)}-row verify block: best {ui.tolist()} "
            f"gap {float(u[0] - u[1]):.4f}",
            flush=True,
        )
    print(f"{parted} of {len(tasks)} problems parted", flush=True)


if __name__ == "__main__":
    main()
