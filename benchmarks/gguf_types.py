"""Which GGUF weight types make a verify of width w cheap on this CPU, at what cost in quality.

    python benchmarks/gguf_types.py                          # the embedded verifier
    python benchmarks/gguf_types.py --types Q4_K_M,Q4_0,Q8_0 --max-width 32

For each type (requantized once from the shipped Q4_K_M GGUF with llama.cpp's own quantizer,
through the bindings; cached in ~/.cache/cactus/models/), on the llama.cpp runner with the
threads and buffers cactus uses: the verify cost per width 1..--max-width after a 90-token
context (median of 5), plain decoding's tokens/s, the mean NLL per token of the built-in
prompts against the shipped GGUF's (the tolerance --quantize auto uses: 0.03 nats/token), and
the best expected tokens/s of a free draft (prompt lookup, suffix trees) accepted at rate a,
max over k of E[tokens | a, k] / t_v(k + 1). Prints a table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from cactus_cli.app.prompts import load_prompts
from cactus_cli.core import defaults
from cactus_cli.infer.backends.llama_cpp import gguf
from cactus_cli.infer.backends.llama_cpp.runner import LlamaCppRunner
from cactus_cli.infer.kpolicy.rates import expected_tokens
from cactus_cli.infer.load import embedded
from cactus_cli.infer.pair.loader import load_pair

FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25}


def requantize(src: Path, name: str) -> Path:
    """``name`` a type (llama.cpp's mix: the output and some tensors in a larger type) or
    ``TYPE-pure`` (every tensor in TYPE, so every matmul takes that type's kernels)."""
    if name == "Q4_K_M":
        return src
    out = src.with_name(f"{src.stem}-{name}.gguf")
    if out.is_file():
        return out
    ll = gguf.bindings()
    params = ll.llama_model_quantize_default_params()
    params.ftype = FTYPES[name.removesuffix("-pure")]
    params.pure = name.endswith("-pure")
    params.allow_requantize = True
    params.nthread = gguf.default_threads()
    tmp = out.with_suffix(".tmp")
    if ll.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes_ref(params)) != 0:
        raise SystemExit(f"llama.cpp could not requantize {src} to {name}")
    tmp.replace(out)
    return out


def ctypes_ref(params):
    import ctypes

    return ctypes.byref(params)


def curve(runner: LlamaCppRunner, max_width: int, repeats: int = 5) -> dict[int, float]:
    ids = [(7 + 31 * i) % 150_000 for i in range(90 + max_width)]
    runner.reset()
    runner.forward(ids[:90], keep=1)
    out = {}
    for w in range(1, max_width + 1):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward(ids[90 : 90 + w], keep=w)
            times.append(time.perf_counter() - t0)
            runner.crop(90)
        out[w] = statistics.median(times)
    return out


def mean_nll(runner: LlamaCppRunner, texts: list[list[int]]) -> float:
    total = tokens = 0.0
    for ids in texts:
        runner.reset()
        logits = runner.forward(ids[:-1], keep=len(ids) - 1).float()
        total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        tokens += len(ids) - 1
    return total / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K_M,Q4_0,Q8_0,Q5_K_M,IQ4_NL")
    ap.add_argument("--max-width", type=int, default=32)
    ap.add_argument("--rates", default="0.5,0.7,0.9", help="acceptance rates of a free draft")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    shipped = embedded.embedded_gguf("qwen2.5-coder-1.5b")
    rates = [float(r) for r in a.rates.split(",")]
    texts = None
    rows = []
    for name in a.types.split(","):
        path = requantize(shipped, name)
        pair = load_pair(
            str(path),
            None,
            str(embedded.gguf_tokenizer(shipped, "qwen2.5-coder-1.5b")),
            "cpu",
            dtype="auto",
            backend="llama.cpp",
        )
        if texts is None:
            texts = [
                ids
                for ids in (list(pair.tokenizer(p.prompt)["input_ids"]) for p in load_prompts(None, None))
                if len(ids) > 1
            ]
        runner = LlamaCppRunner(pair.verifier, pair.vocab_size, pair.verifier.context_length)
        cost = curve(runner, a.max_width)
        best = {}
        for r in rates:
            k = max(range(a.max_width), key=lambda k: expected_tokens(r, k) / cost[k + 1])
            best[r] = (k, expected_tokens(r, k) / cost[k + 1])
        rows.append(
            {
                "type": name,
                "bytes": path.stat().st_size,
                "mean_nll": mean_nll(runner, texts),
                "width_ms": {w: 1000 * s for w, s in cost.items()},
                "plain_tokens_per_second": 1 / cost[1],
                "best_free_draft": {str(r): {"k": k, "tokens_per_second": t} for r, (k, t) in best.items()},
            }
        )
        print(f"[types] {name}: done", file=sys.stderr, flush=True)
        del runner, pair
    ref = rows[0]["mean_nll"]
    print(f"threads {gguf.default_threads()}, {'plain buffers (AMX build)' if gguf.amx_in_use() else 'extra buffers'}")
    print(
        f"{'type':<8} {'GB':>5} {'NLL vs shipped':>15} {'plain tok/s':>12} "
        + " ".join(f"{'a=' + str(r):>14}" for r in rates)
    )
    for row in rows:
        drift = row["mean_nll"] - ref
        ok = "" if drift <= defaults.QUALITY_TOLERANCE else " (over)"
        print(
            f"{row['type']:<8} {row['bytes'] / 1e9:5.2f} {drift:+15.3f}{ok} {row['plain_tokens_per_second']:12.2f} "
            + " ".join(f"{b['tokens_per_second']:9.2f} k={b['k']:<2}" for b in row["best_free_draft"].values())
        )
    widths = [1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 24, 32]
    print("ms per width: " + " ".join(f"{w:>5}" for w in widths if w <= a.max_width))
    for row in rows:
        print(f"{row['type']:<13} " + " ".join(f"{row['width_ms'][w]:5.0f}" for w in widths if w <= a.max_width))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
