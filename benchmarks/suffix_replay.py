"""Drafters replayed over recorded verifier text: a cheap proxy for tuning drafts from memory.

    python benchmarks/suffix_replay.py record trace.json -n 160   # the verifier alone on the eval set (~25 min here)
    python benchmarks/suffix_replay.py replay trace.json          # seconds: ngram, suffix and its variants

``record`` runs the default profile's verifier alone (T = 0.6, seed = problem index, as eval does)
on every built-in eval problem and saves the prompt and output token ids. ``replay`` walks each
output the way a speculative run would: a one-hot draft is accepted token by token while it equals
the recorded sample. Since the sample was drawn from q, P(draft token == sample) = q(token): this is
SpS's acceptance of one-hot drafts, exactly in distribution along the recorded text (Cactus's
boost and sampled drafts are not modelled, so read the variants against each other). The k of each
step is chosen as -k auto does (policy.Calibration on the tree's estimates for suffix, per-position
rates for ngram) with a step cost of 1 + SLOPE k verifier steps (SLOPE from this machine's w8a8
costs: a 9-token verify costs 1.4x a 1-token one). Variants:

- the suffix tree's constants (EVIDENCE, MAX_SCAN, MAX_MATCH, MIN_PROB);
- ``digits``: digit tokens match each other when a context is looked up (the numbers differ from
  problem to problem, the reasoning around them does not);
- trees (SuffixDecoding's tree verification, in a form that leaves every rule's output
  distribution unchanged): beside the drafted path, every other child of a path node whose
  estimate is >= s, each with the branch under it (<= d tokens), all verified in the same pass.
  The rule walks the path as now; when it rejects a token and the correction it samples from the
  residual (as it always does) is one of those children, the verifier's logits after that child
  are already computed, so the walk goes on down its branch (and emits one more token after it).
  Each node costs SLOPE of a step, as a drafted token does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

import cactus_cli.infer.draft.suffix as S
import cactus_cli.infer.draft.suffix_tree as T
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.draft.ngram import NgramDrafter
from cactus_cli.infer.kpolicy.policy import Calibration

K, SLOPE, VOCAB = 8, 0.05, 1 << 20
GREEDY = SamplingParams(temperature=0)  # (one-hot drafts: the most frequent path)


def record(path: Path, n: int) -> None:
    from cactus_cli.app import runtime
    from cactus_cli.app.config.profile_files import resolve_settings
    from cactus_cli.app.eval.tasks import load_tasks
    from cactus_cli.infer.decode.engine import SpeculativeEngine

    settings = resolve_settings(None, {"max_tokens": n})
    engine = SpeculativeEngine(runtime.load_engine(settings).pair, None)
    tasks = runtime.encode_prompts(engine, load_tasks(None, None), settings.chat_template)
    base = dataclasses.replace(runtime.generation_params(settings), num_draft_tokens=0)
    rows, t0 = [], time.time()
    for i, (_, ids) in enumerate(tasks):
        out = [t for ev in engine.steps(ids, dataclasses.replace(base, seed=i)) for t in ev.emitted]
        rows.append({"prompt": ids, "output": out})
        path.write_text(json.dumps(rows))
        print(f"{i + 1}/{len(tasks)} problems, {time.time() - t0:.0f} s", flush=True)


def best_k(rates: list[float]) -> int:
    best, k, expected, p = 1.0, 0, 1.0, 1.0
    for j, r in enumerate(rates, 1):
        p *= r
        expected += p
        if expected / (1 + SLOPE * j) > best:
            best, k = expected / (1 + SLOPE * j), j
    return k


def siblings_of(node, path: list[int], matched: int, sib: float, depth: int) -> dict[tuple[int, int], list[int]]:
    """The tree around a drafted path: at each depth d of the path, every other child whose
    estimate is >= ``sib``, with the branch under it (followed as the path is, <= ``depth`` tokens)."""
    out = {}
    for d in range(len(path)):
        counts: dict[int, int] = {}
        for s, o in node:
            if o + d < len(s):
                counts[s[o + d]] = counts.get(s[o + d], 0) + 1
        total = sum(counts.values()) + T.EVIDENCE / (matched + d)
        for c, n in counts.items():
            if c != path[d] and n / total >= sib:
                under = [(s, o + d + 1) for s, o in node if o + d < len(s) and s[o + d] == c]
                out[(d, c)] = T.follow(under, depth, S.MIN_PROB, matched=matched + d + 1)[0] if depth else []
        node = [(s, o) for s, o in node if o + d < len(s) and s[o + d] == path[d]]
    return out


def replay(rows: list[dict], make, siblings: tuple[float, int] | None = None) -> dict[str, float]:
    drafter = make()
    cal, pos_acc, pos_tested = Calibration(), [1.0] * K, [2.0] * K
    drafts = accepted = steps = tokens = landed = tree_nodes = 0
    cost = 0.0
    for row in rows:
        prompt, out = row["prompt"], row["output"]
        drafter.start(prompt, [])
        seq, pos = list(prompt), 0
        while pos < len(out):
            draft = drafter.propose(seq, K, GREEDY, None).tokens.tolist()
            peek = drafter.peek(seq) if isinstance(drafter, S.SuffixDrafter) else None
            conf = peek.confidence if peek is not None else None
            if draft:
                rates = cal.rates(conf[: len(draft)]) if conf else [a / t for a, t in zip(pos_acc, pos_tested)]
                draft = draft[: best_k(rates[: len(draft)])]
            m = 0
            while m < len(draft) and pos + m < len(out) and draft[m] == out[pos + m]:
                m += 1
            more = nodes = 0  # tokens a sibling branch adds (its accepted ones and the one after them); its nodes
            if siblings and draft:
                match = drafter._match(seq)[0]
                tree = siblings_of(match.node, draft, match.length, *siblings)
                nodes = sum(1 + len(b) for b in tree.values())
                branch = tree.get((m, out[pos + m])) if m < len(draft) and pos + m < len(out) else None
                if branch is not None:  # (the correction was a node: the verifier's logits after it are known)
                    landed += 1
                    while (
                        more < len(branch) and pos + m + 1 + more < len(out) and branch[more] == out[pos + m + 1 + more]
                    ):
                        more += 1
                    more = min(more + 1, len(out) - pos - m - 1)
            if draft:
                drafts += 1
                accepted += m + more
                if conf:
                    cal.add(conf[: len(draft)], m)
                else:
                    for i in range(min(m + 1, len(draft))):
                        pos_tested[i] += 1
                        pos_acc[i] += i < m
            cost += 1 + SLOPE * (len(draft) + nodes)
            tree_nodes += nodes
            advance = min(m + 1 + more, len(out) - pos)
            seq += out[pos : pos + advance]
            pos += advance
            steps += 1
            drafter.accept(seq, m)
        drafter.finish(seq)
        tokens += len(out)
    return {
        "drafting_steps": drafts,
        "tree_nodes": tree_nodes,
        "mal": 1 + accepted / max(drafts, 1),
        "tokens_per_step": tokens / steps,
        "tokens_per_cost": tokens / cost,
        "corrections_on_a_sibling": landed,
    }


def digit_wildcards(tokenizer) -> None:
    """Make the suffix trees treat every digit token as one token when they look a context up
    (the index and the backwards match read token classes; drafts still copy the real tokens)."""
    digits = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip().isdigit()]
    cls = {i: digits[0] for i in digits}
    c = lambda t: cls.get(t, t)  # noqa: E731

    class Wild(T.SuffixTree):
        def add(self, doc, tokens):
            index = self.index
            self.docs[doc] = tokens
            for o in range(max(self.indexed.get(doc, 0), 1), len(tokens)):
                pos = doc << 32 | o
                index.setdefault(c(tokens[o - 1]), []).append(pos)
                if o >= 2:
                    index.setdefault(T._SPAN * (c(tokens[o - 2]) + 1) + c(tokens[o - 1]), []).append(pos)
            self.indexed[doc] = max(len(tokens), self.indexed.get(doc, 0))

        def occurrences(self, context):
            if not context:
                return []
            positions = self.index.get(T._SPAN * (c(context[-2]) + 1) + c(context[-1])) if len(context) >= 2 else None
            base = 2
            if not positions:
                positions, base = self.index.get(c(context[-1])), 1
                if not positions:
                    return []
            out, n = [], len(context)
            for pos in reversed(positions[-T.MAX_SCAN :]):
                tokens = self.docs.get(pos >> 32)
                if tokens is None:
                    continue
                o, m = pos & 0xFFFFFFFF, base
                while m < T.MAX_MATCH and m < n and m < o and c(tokens[o - 1 - m]) == c(context[n - 1 - m]):
                    m += 1
                out.append((m, pos >> 32, tokens, o))
            return out

    S.SuffixTree = Wild
    history_init = T.History.__init__

    def init(self, *a, **k):
        history_init(self, *a, **k)
        self.tree = Wild()

    T.History.__init__ = init


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["record", "replay"])
    ap.add_argument("trace", type=Path)
    ap.add_argument("-n", type=int, default=160, help="record: tokens per problem")
    ap.add_argument(
        "--slope", type=float, default=SLOPE, help="replay: a drafted token's (a tree node's) share of a step's cost"
    )
    args = ap.parse_args()
    globals()["SLOPE"] = args.slope
    if args.mode == "record":
        return record(args.trace, args.n)
    rows = json.loads(args.trace.read_text())
    suffix = lambda: S.SuffixDrafter(VOCAB, torch.device("cpu"), sampled=False)  # noqa: E731
    runs = [
        ("ngram", lambda: replay(rows, lambda: NgramDrafter(VOCAB, torch.device("cpu")))),
        ("suffix", lambda: replay(rows, suffix)),
    ]
    for name, values in (("EVIDENCE", (0.5, 2.0)), ("MAX_SCAN", (64, 1024)), ("MAX_MATCH", (8, 32))):
        for v in values:

            def run(name=name, v=v):
                old = getattr(T, name)
                setattr(T, name, v)
                try:
                    return replay(rows, suffix)
                finally:
                    setattr(T, name, old)

            runs.append((f"suffix {name}={v}", run))
    for v in (0.05, 0.2, 0.3):

        def run(v=v):
            S.MIN_PROB = v
            try:
                return replay(rows, suffix)
            finally:
                S.MIN_PROB = 0.1

        runs.append((f"suffix MIN_PROB={v}", run))
    for sib, depth in ((0.0, K), (0.05, 4), (0.1, 2), (0.1, 0), (0.2, 0)):
        runs.append(
            (
                f"suffix tree: siblings >= {sib}, {depth} deep",
                lambda sib=sib, depth=depth: replay(rows, suffix, siblings=(sib, depth)),
            )
        )
    for name, run in runs:
        print(json.dumps({"drafter": name, **{k: round(v, 4) for k, v in run().items()}}), flush=True)
    from transformers import AutoTokenizer

    from cactus_cli.infer.load.embedded import prepare_embedded

    digit_wildcards(AutoTokenizer.from_pretrained(str(prepare_embedded("qwen2.5-coder-1.5b"))))
    print(json.dumps({"drafter": "suffix digits", **{k: round(v, 4) for k, v in replay(rows, suffix).items()}}))


if __name__ == "__main__":
    main()
