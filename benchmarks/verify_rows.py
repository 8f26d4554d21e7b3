"""``verify_rows`` against ``verify`` called row by row: R rows of one rule, k drafts each, a
vocabulary of V, float32 on the CPU. Checks first that every row's verdict equals ``verify`` of
that row alone, bit for bit, then prints the median time of each over several calls, the calls
interleaved. ``--before`` times another copy of core/verify.py beside it (the same calls, in turn;
it runs on this tree's acceptance.py), here the one before verify_rows decided a rule's rows at once:

    git show 99ce4b1:cactus_cli/core/verify.py > /tmp/verify_before.py
    python benchmarks/verify_rows.py --rows 1 4 8 --k 4 16 --calls 9 --before /tmp/verify_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch

from cactus_cli.core.verify import Row, verify, verify_rows


def make_rows(R: int, k: int, V: int, rule: str, delta: float, seed: int) -> list[Row]:
    """R rows whose verifier is close to the draft (most drafts accepted, as in a real run)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(R):
        logits = torch.randn(k + 1, V, generator=g) * 4  # [k+1, V]
        p = torch.softmax(logits[:k], -1)
        q = torch.softmax(logits + 3 * torch.randn(k + 1, V, generator=g), -1)
        n = torch.multinomial(p, 1, generator=g).view(-1) if k else torch.zeros(0, dtype=torch.int64)
        rows.append(Row(rule, {"delta": delta}, p, q, n, torch.Generator().manual_seed(seed + r)))
    return rows


def same_as_verify(rows: list[Row]) -> bool:
    """Each row's verdict from one verify_rows call equals verify of that row alone, bit for bit."""
    seeds = [row.generator.initial_seed() for row in rows]
    fresh = [Row(r.rule, r.params, r.p, r.q, r.n, torch.Generator().manual_seed(s)) for r, s in zip(rows, seeds)]
    for row, got, s in zip(rows, verify_rows(fresh), seeds):
        want = verify(
            row.rule, row.p[None], row.q[None], row.n[None], generator=torch.Generator().manual_seed(s), **row.params
        )
        fields = ("num_accepted", "tokens", "acceptance_probs")
        if not all(torch.equal(getattr(got, f), getattr(want, f)) for f in fields):
            return False
    return True


def median_ms(fns: list, calls: int) -> list[float]:
    """Each function's median time in ms, the calls interleaved (a busy machine slows all alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(calls + 1):  # the first round warms up
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(ts[1:]) for ts in times]


def per_row(rows: list[Row]) -> None:
    for r in rows:
        verify(r.rule, r.p[None], r.q[None], r.n[None], generator=r.generator, **r.params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--k", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rule", default="cactus", choices=["cactus", "cactus-exact"])
    ap.add_argument("--delta", type=float, default=0.5)
    ap.add_argument("--calls", type=int, default=7, help="timed calls per configuration (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--before", help="another core/verify.py whose verify_rows is timed beside this one")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fns = {"verify x R": per_row, "verify_rows": verify_rows}
    if args.before:
        spec = importlib.util.spec_from_file_location("verify_before", args.before)
        before = sys.modules["verify_before"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        fns["before"] = before.verify_rows  # (it reads a Row's fields by name: ours will do)
    print(f"rule {args.rule}, V {args.vocab}, float32, CPU, {args.threads} thread(s), median of {args.calls} calls")
    print(f"{'R':>3} {'k':>3} {'accepted':>9} " + " ".join(f"{name + ' ms':>14}" for name in fns) + f" {'equal':>6}")
    for R in args.rows:
        for k in args.k:
            rows = make_rows(R, k, args.vocab, args.rule, args.delta, seed=1000 * R + k)
            ok = same_as_verify(rows)
            accepted = sum(int(v.num_accepted) for v in verify_rows(rows)) / R
            ms = median_ms([lambda f=f: f(rows) for f in fns.values()], args.calls)
            print(f"{R:>3} {k:>3} {accepted:>9.1f} " + " ".join(f"{t:>14.2f}" for t in ms) + f" {str(ok):>6}")


if __name__ == "__main__":
    main()
