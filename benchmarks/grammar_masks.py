"""What a token mask costs on the embedded pair's 151k vocabulary: llguidance (what cactus uses) against
xgrammar (if it imports), per generated token and per verify block of k + 1 positions, for JSON output.

    python benchmarks/grammar_masks.py [--tokenizer DIR] [--repeats 5]

Each library walks the same valid JSON answer (the embedded tokenizer's tokens) token by token: the mask
at every position, then the token consumed; the block figure computes the k + 1 masks a verify needs
(after each of k drafted tokens) and rolls the drafts back, as a step that rejects them all does.
xgrammar is optional (it pulls triton): install it beside the project to compare."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["mathematics", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
}
K = 8


def default_tokenizer() -> Path:
    from cactus_cli.infer.load.embedded import get, models_dir

    return models_dir() / get("qwen2.5-coder-1.5b").name


def ms(xs: list[float]) -> str:
    return f"{1000 * statistics.median(xs):.3f} ms"


def bench_llguidance(tok, ids: list[int], vocab: int, repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    tok_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    )
    per_token, per_block, compile_s = [], [], []
    executor = llguidance.LLExecutor(1)
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grammar)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        mask = lln.allocate_token_bitmask(K + 1, vocab)
        for i, t in enumerate(ids):
            t0 = time.perf_counter()
            lln.fill_next_token_bitmask(m, mask, 0)
            per_token.append(time.perf_counter() - t0)
            drafts = ids[i + 1 : i + 1 + K]
            if i % 4 == 0 and drafts:
                t0 = time.perf_counter()
                lln.fill_next_token_bitmask_par_with_draft_tokens(executor, [(m, 0, [t] + drafts[:-1])], mask)
                per_block.append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
    return {"tokenizer_s": tok_s, "compile": compile_s, "token": per_token, "block": per_block}


def bench_xgrammar(tok, ids: list[int], vocab: int, repeats: int) -> dict | None:
    try:
        import xgrammar as xgr
    except Exception as err:  # noqa: BLE001 (optional)
        return {"error": f"{type(err).__name__}: {err}"}
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    tok_s = time.perf_counter() - t0
    per_token, per_block, compile_s = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        m = xgr.GrammarMatcher(compiled, max_rollback_tokens=K + 1)
        compile_s.append(time.perf_counter() - t0)
        mask = xgr.allocate_token_bitmask(K + 1, vocab)
        for i, t in enumerate(ids):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            per_token.append(time.perf_counter() - t0)
            drafts = ids[i + 1 : i + 1 + K]
            if i % 4 == 0 and drafts:
                t0 = time.perf_counter()
                fed = 0
                for j, d in enumerate([t] + drafts[:-1]):
                    if not m.accept_token(d):
                        break
                    fed += 1
                    m.fill_next_token_bitmask(mask, j + 1)
                m.rollback(fed)
                per_block.append(time.perf_counter() - t0)
            assert m.accept_token(t)
    return {"tokenizer_s": tok_s, "compile": compile_s, "token": per_token, "block": per_block}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer folder (default: the embedded 1.5B's)")
    ap.add_argument("--vocab", type=int, default=151936, help="the model's logits width")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer or default_tokenizer())
    ids = tok.encode(json.dumps(ANSWER))
    print(f"vocabulary {args.vocab}, answer {len(ids)} tokens, k = {K}, {args.repeats} walks")
    print("| library | tokenizer set-up | grammar compile | mask per token (median) | k+1 masks per block (median) |")
    print("|---|---|---|---|---|")
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        r = fn(tok, ids, args.vocab, args.repeats)
        if "error" in r:
            print(f"| {name} | not installed ({r['error']}) | | | |")
            continue
        print(f"| {name} | {r['tokenizer_s']:.2f} s | {ms(r['compile'])} | {ms(r['token'])} | {ms(r['block'])} |")


if __name__ == "__main__":
    main()
