"""Two source trees of cactus, the same `cactus` command, alternating: A B A B ..., so a machine
that speeds up or slows down during the call moves both alike. Each run's --json results give
every row's decode tok/s; the table has each row's median per tree and the median of the
pairwise ratios A/B (with their range).

    git worktree add /tmp/before HEAD~1
    python benchmarks/ab.py --a . --b /tmp/before --runs 5 -- bench --rules sps,cactus -k 4,auto --limit 4 -n 64

Both trees run on this environment's installed dependencies (PYTHONPATH puts each tree's
cactus_cli first). The command must print one JSON document (bench --json is added when absent).
One benchmark at a time: nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run(tree: Path, args: list[str], metric: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    out = subprocess.run(
        [sys.executable, "-m", "cactus_cli", *args], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode != 0:
        sys.exit(f"{tree}: cactus {' '.join(args)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    doc = json.loads(out.stdout)
    return {row["config"]: row[metric] for row in doc["results"] if row.get(metric)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="the tree under test")
    ap.add_argument("--b", type=Path, required=True, help="the tree it is compared with")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--metric", default="decode_tokens_per_second")
    ap.add_argument("--out", type=Path, help="write every run's figures here (JSON)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the cactus command after --")
    a = ap.parse_args()
    args = [x for x in a.command if x != "--"]
    if "--json" not in args:
        args.append("--json")
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for i in range(a.runs):
        for side, tree in (("a", a.a), ("b", a.b)):
            runs[side].append(run(tree, args, a.metric))
        print(f"run {i + 1}/{a.runs} done", file=sys.stderr, flush=True)
    rows = list(runs["a"][0])
    print(f"{'row':<40} {'A median':>10} {'B median':>10} {'A/B median':>11} {'A/B range':>16}")
    for row in rows:
        av = [r[row] for r in runs["a"] if row in r]
        bv = [r[row] for r in runs["b"] if row in r]
        ratios = [x / y for x, y in zip(av, bv)]
        print(
            f"{row:<40} {statistics.median(av):>10.2f} {statistics.median(bv):>10.2f} "
            f"{statistics.median(ratios):>10.3f}x {min(ratios):>7.3f}-{max(ratios):.3f}"
        )
    if a.out:
        a.out.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
