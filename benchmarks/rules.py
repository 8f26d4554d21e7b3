"""Micro-benchmark: the cost of one verification step per acceptance rule, as a ratio to SpS.

    python benchmarks/rules.py                 # [32, 10, 152064] float32 on CPU (and CUDA if present)
    python benchmarks/rules.py --shape 1 4 151936 --repeats 50

Rules are timed interleaved (round-robin) so drift in machine load hits all of them alike;
the median of the rounds is reported. CUDA timings synchronize around every call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cactus_cli.core.verify import verify

CASES = [
    ("sps", {}),
    ("cactus", {"delta": 1.0}),
    ("cactus-exact", {"delta": 1.0}),
    ("cactus-exact", {"delta": 1.0, "divergence": "hellinger"}),
    ("tas", {}),
    ("topk", {"topk": 5}),
    ("interp", {"alpha": 0.5}),
]


def bench(device: str, B: int, k: int, V: int, repeats: int) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    p = torch.softmax(3 * torch.randn(B, k, V, generator=gen, device=device), -1)  # [B, k, V]
    q = torch.softmax(3 * torch.randn(B, k + 1, V, generator=gen, device=device), -1)  # [B, k+1, V]
    draft = torch.multinomial(p.view(-1, V), 1, generator=gen).view(B, k)  # [B, k]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def once(rule, params):
        sync()
        t0 = time.perf_counter()
        verify(rule, p, q, draft, generator=gen, **params)
        sync()
        return time.perf_counter() - t0

    for rule, params in CASES:  # warm-up
        once(rule, params)
    times = {i: [] for i in range(len(CASES))}
    for _ in range(repeats):
        for i, (rule, params) in enumerate(CASES):
            times[i].append(once(rule, params))
    base = statistics.median(times[0])
    print(f"\n{device}: [B, k, V] = [{B}, {k}, {V}] {p.dtype}, median of {repeats} rounds")
    print(f"{'rule':<28}{'ms':>9}{'x sps':>8}")
    for i, (rule, params) in enumerate(CASES):
        label = rule + (f" ({params['divergence']})" if "divergence" in params else "")
        med = statistics.median(times[i])
        print(f"{label:<28}{med * 1e3:>9.2f}{med / base:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs=3, type=int, default=[32, 10, 152064], metavar=("B", "K", "V"))
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        bench(device, *args.shape, repeats=args.repeats)


if __name__ == "__main__":
    main()
