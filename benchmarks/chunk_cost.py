"""What one verifier call of W new tokens costs per token, after C cached tokens: the curve a
joining prompt's chunks are sized on (infer/decode/batch.py, ``next_width``). On llama.cpp's CPU
build the flash attention reads 64 queries at a time on its fast path and the rest one by one, so
the cost per token drops at W = 64 and the drop grows with C (the runner's ``step_block``):

    python benchmarks/chunk_cost.py                                    # the default profile's verifier
    python benchmarks/chunk_cost.py --cached 200 1000 2600 --widths 32 63 64 65 128

Prints one row per C: each width's best time per token (ms) of ``--calls`` calls, each call fed
after the same C cached tokens and cropped back. One benchmark at a time: nothing else should run.
"""

from __future__ import annotations

import argparse
import time

from cactus_cli.app.session import Session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="default")
    ap.add_argument("--cached", type=int, nargs="+", default=[200, 1000, 2600], help="tokens cached before the call")
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 32, 48, 63, 64, 65, 96, 128])
    ap.add_argument("--calls", type=int, default=2, help="calls per width (the best is kept)")
    a = ap.parse_args()
    session = Session.load(a.profile, draft="none")
    engine = session.engine
    most = max(a.cached) + max(a.widths) + 1
    engine.prepare(most, (1,), slot=0)
    runner = engine.slots[0].verifier
    ids = [(7 + 31 * i) % min(engine.pair.vocab_size, 30000) for i in range(most)]
    print(f"{session.settings.verifier} on {engine.pair.verifier.backend}; ms per token of a W-token call")
    print("cached  " + "".join(f"{'W=' + str(w):>9}" for w in a.widths))
    for cached in a.cached:
        engine.slots[0].reset()
        runner.forward(ids[:cached], keep=1)
        row = []
        for w in a.widths:
            best = float("inf")
            for _ in range(a.calls):
                t = time.perf_counter()
                runner.forward(ids[cached : cached + w], keep=1)
                best = min(best, time.perf_counter() - t)
                runner.crop(cached)
            row.append(f"{1000 * best / w:9.1f}")
        print(f"{cached:>6}  " + "".join(row), flush=True)


if __name__ == "__main__":
    main()
