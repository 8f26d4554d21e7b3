"""-k auto sizing suffix drafts by the tree's own estimates (calibrated: policy.Calibration) vs by
per-position rates alone (as before), with prompt lookup beside them: the default profile's
verifier, the built-in eval problems interleaved problem by problem, each row its own engine
(and history). Prints one JSON line per row; progress on stderr.

    python benchmarks/suffix_sizing.py --limit 12 -n 128                  # Cactus delta 1
    python benchmarks/suffix_sizing.py --limit 12 -n 128 --rule sps
"""

import argparse
import dataclasses
import json
import sys
import time

from cactus_cli.app import runtime
from cactus_cli.app.config.profile_files import resolve_settings
from cactus_cli.app.eval.tasks import load_tasks
from cactus_cli.core.stats import SpecStats
from cactus_cli.infer.decode.engine import SpeculativeEngine
from cactus_cli.infer.draft import Free, Peek
from cactus_cli.infer.draft.ngram import NGRAM
from cactus_cli.infer.draft.suffix import SUFFIX


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--rule", default="cactus")
    ap.add_argument(
        "--rows",
        default="est,pos,ngram",
        help="est: sized by the estimates; pos: by position; long: est with longer paths; ngram: lookup",
    )
    args = ap.parse_args()
    settings = resolve_settings(None, {"draft": "suffix", "max_tokens": args.n, "num_draft_tokens": "auto"})
    pair = runtime.load_engine(settings).pair
    rows = args.rows.split(",")
    engines = {}
    for r in rows:
        e = SpeculativeEngine(pair, Free(NGRAM if r == "ngram" else SUFFIX))
        if r == "pos":  # the drafter offers no estimate: -k auto sizes it by its per-position rates
            drafter = e.slots[0].drafter  # (the engine's one slot)
            drafter.peek = lambda seq, peek=drafter.peek: (p := peek(seq)) and Peek(p.source)
        if r == "long":  # sized by the estimates, paths followed down to 0.05 and up to 16 tokens
            e.slots[0].drafter.min_prob = 0.05
        engines[r] = e
    tasks = runtime.encode_prompts(engines[rows[0]], load_tasks(None, args.limit), settings.chat_template)
    base = runtime.generation_params(settings)
    kw = {"delta": 1.0} if args.rule == "cactus" else {}
    stats = {r: SpecStats() for r in rows}
    t0 = time.time()
    for i, (_, ids) in enumerate(tasks):
        for r in rows:
            params = dataclasses.replace(
                base,
                rule=args.rule,
                rule_kwargs=kw,
                seed=i,
                num_draft_tokens=16 if r == "long" else base.num_draft_tokens,
            )
            one = SpecStats()
            for ev in engines[r].steps(ids, params):
                one.update(ev)
            stats[r].merge(one)
        print(
            i,
            f"{time.time() - t0:.0f}s",
            {r: round(stats[r].tokens_per_second, 2) for r in rows},
            file=sys.stderr,
            flush=True,
        )
    for r, st in stats.items():
        print(
            json.dumps(
                {
                    "row": r,
                    "tokens": st.num_output_tokens,
                    "acceptance": st.draft_acceptance_rate,
                    "mal": st.mean_acceptance_length,
                    "tps": st.tokens_per_second,
                    "mean_k": st.mean_k,
                    "tok_per_pass": st.num_output_tokens / max(st.verifier_forward_passes, 1),
                }
            )
        )


if __name__ == "__main__":
    main()
