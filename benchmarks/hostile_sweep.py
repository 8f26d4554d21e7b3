"""Hostile inputs against the new surface, each case classified: the server (a real uvicorn on
127.0.0.1 with the tiny test pair), the command line (long drafts, caches, output files, serve's
flags) and the code sandbox (model-written code that attacks the machine or the eval).

    python benchmarks/hostile_sweep.py                 # every case, a table at the end
    python benchmarks/hostile_sweep.py --only server   # server | cli | sandbox
    python benchmarks/hostile_sweep.py --json out.json

Outcomes: fine (the answer a user should get: a 4xx in OpenAI's shape naming the problem, a
one-line error with exit code 2, a refused attack), traceback (a 500, an exception in the log, a
Python traceback on stderr), hang (no answer within the case's time), wrong (accepted what should
be refused, or refused what should be accepted), lost (the server stopped answering, or answered
the canary differently afterwards), leak (threads or file descriptors left behind), security (an
attack that got through). Light: tiny models, a few minutes on 2 cores.
"""

from __future__ import annotations

# The rounds live beside this script: hostile_sweep_harness.py (outcomes, the tiny pair, a served
# app), hostile_sweep_server.py, hostile_sweep_cli.py and hostile_sweep_inprocess.py (sandbox, cache,
# long drafts); the fifth round is sweep_fifth.py. The names imported `as` themselves are what the
# module handed to sweep_fifth.run, and sweep_sixth's `import hostile_sweep as hs`, read from it.
import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from hostile_sweep_cli import cli_sweep
from hostile_sweep_harness import RESULTS, tiny_models
from hostile_sweep_harness import ROOT as ROOT
from hostile_sweep_harness import Errors as Errors
from hostile_sweep_harness import _raw as _raw
from hostile_sweep_harness import httpx as httpx
from hostile_sweep_harness import one_line_error as one_line_error
from hostile_sweep_harness import record as record
from hostile_sweep_harness import serve as serve
from hostile_sweep_inprocess import cache_sweep, long_draft_sweep, sandbox_sweep
from hostile_sweep_server import server_sweep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("server", "cli", "sandbox", "cache", "drafts", "fifth"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cactus-sweep-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        os.environ["CACTUS_HOME"] = str(home)
        os.environ["HF_HUB_OFFLINE"] = "1"
        models = tiny_models(Path(tmp)) if a.only not in ("sandbox", "cache", "fifth") else {}
        if a.only in (None, "server"):
            server_sweep(models)
        if a.only in (None, "cli"):
            cli_sweep(models, home)
        if a.only in (None, "sandbox"):
            sandbox_sweep()
        if a.only in (None, "cache"):
            cache_sweep(Path(tmp))
        if a.only in (None, "drafts"):
            long_draft_sweep(models)
        if a.only in (None, "fifth"):  # (the fifth round: slots, tools, JSON output, logprobs, remeasure)
            import sweep_fifth

            sweep_fifth.run(sys.modules[__name__], Path(tmp))
    kinds = ("fine", "traceback", "hang", "wrong", "lost", "leak", "security")
    print(f"\n| surface | cases | {' | '.join(kinds)} |\n|---|---|{'---|' * len(kinds)}")
    surfaces = ("server", "cli", "sandbox", "cache", "drafts", "tools", "json", "logprobs", "slots", "remeasure")
    for surface in (*surfaces, None):
        rows = [r for r in RESULTS if surface is None or r.surface == surface]
        counts = [sum(r.outcome == k for r in rows) for k in kinds]
        print(f"| {surface or 'all'} | {len(rows)} | {' | '.join(map(str, counts))} |")
    if a.json:
        a.json.write_text(json.dumps([asdict(r) for r in RESULTS], indent=2))
    sys.exit(0 if all(r.outcome == "fine" for r in RESULTS) else 1)


if __name__ == "__main__":
    main()
