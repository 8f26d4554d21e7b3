"""Suffix drafts one-hot (the most frequent path) vs sampled (drawn from the tree's counts, which
are then the draft distribution): acceptance, mean accepted length and tokens/s on the built-in
eval tasks, interleaved problem by problem, each way with its own history, for SpS and Cactus.

    python benchmarks/suffix_draws.py --limit 16 -n 96     # the default profile's verifier

Prints one JSON line per configuration."""

from __future__ import annotations

import argparse
import dataclasses
import json

from cactus_cli.app import runtime
from cactus_cli.app.config.profile_files import resolve_settings
from cactus_cli.app.eval.tasks import load_tasks
from cactus_cli.core.stats import SpecStats
from cactus_cli.infer.decode.engine import SpeculativeEngine
from cactus_cli.infer.draft import Free
from cactus_cli.infer.draft.suffix import SUFFIX


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("-k", type=int, default=8, help="the cap on a draft's length (the tree sizes each draft below it)")
    args = ap.parse_args()
    settings = resolve_settings(None, {"draft": "suffix", "max_tokens": args.n})
    pair = runtime.load_engine(settings).pair
    engines = {sampled: SpeculativeEngine(pair, Free(SUFFIX, {"sampled": sampled})) for sampled in (False, True)}
    tasks = runtime.encode_prompts(engines[False], load_tasks(None, args.limit), settings.chat_template)
    base = dataclasses.replace(runtime.generation_params(settings), num_draft_tokens=args.k, seed=0)
    rules = {"sps": {}, "cactus": {"delta": 1.0}}
    stats = {(s, r): SpecStats() for s in engines for r in rules}
    for i, (_, ids) in enumerate(tasks):
        for (sampled, rule), st in stats.items():
            params = dataclasses.replace(base, rule=rule, rule_kwargs=rules[rule], seed=i, memory=rule)
            one = SpecStats()  # (per run, then merged: a run's clock is its own)
            for ev in engines[sampled].steps(ids, params):
                one.update(ev)
            st.merge(one)
    for (sampled, rule), st in stats.items():
        print(
            json.dumps(
                {
                    "drafts": "sampled" if sampled else "one-hot",
                    "rule": rule,
                    "tokens": st.num_output_tokens,
                    "acceptance": st.draft_acceptance_rate,
                    "mal": st.mean_acceptance_length,
                    "tokens_per_verifier_pass": st.num_output_tokens / max(st.verifier_forward_passes, 1),
                    "tokens_per_second": st.tokens_per_second,
                    "mean_k": st.mean_k,
                }
            )
        )


if __name__ == "__main__":
    main()
