"""A long prompt joining running streams: how long the running streams stall, and how long the
joining request waits for its first token (`cactus serve --parallel N`, the default profile):

    python benchmarks/join_gap.py                          # 2 slots, a 2,700-token prompt joins
    python benchmarks/join_gap.py --prompt-tokens 2700 --streams 1 --parallel 2 --out gap.json

1. `cactus serve --port 0 --parallel N` starts; one short request warms it up.
2. ``--streams`` requests (greedy, a long answer each) start streaming.
3. Once each has streamed a few chunks, one request whose prompt is ``--prompt-tokens`` tokens of
   this repository's source (new to the server: no cached prefix) joins, streamed.
4. Reported: each running stream's longest gap between two chunks before the join (its ordinary
   step) and from the join until the joining request's first token, and the joining request's
   time to first token. A server that prefills a joining prompt whole, inside a step, stalls
   every stream for that whole prefill; one that cuts it into chunks sharing the step with the
   streams keeps the gap near one step.

One benchmark at a time: nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from serve_bench import cactus_url

ROOT = Path(__file__).resolve().parent.parent
RUNNING = "Explain in detail how a hash table works, with a long Python example of open addressing."
ASK = "\n\nWhat does the code above do? Answer in two sentences."


def long_prompt(tokens: int) -> str:
    """``tokens`` tokens (by the embedded verifier's tokenizer) of this repository's source."""
    from transformers import AutoTokenizer

    folder = Path.home() / ".cache/cactus/models/qwen2.5-coder-1.5b-tokenizer"
    if not folder.is_dir():
        raise SystemExit("run `cactus generate` once first: the embedded tokenizer is not assembled yet")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "".join(p.read_text() for p in sorted((ROOT / "cactus_cli" / "infer").rglob("*.py")))
    ids = tokenizer.encode(text)[:tokens]
    return tokenizer.decode(ids)


def stream(client, model, prompt: str, max_tokens: int, times: list, box: dict) -> None:
    """One streamed chat request: the time of each content chunk into ``times``, the usage into ``box``."""
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in out:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            box["usage"] = chunk.usage.model_dump()
    box["done"] = time.perf_counter()


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest interval between two chunks that overlaps [start, end]."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return max(gaps, default=float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--streams", type=int, default=1, help="requests streaming when the long prompt joins")
    ap.add_argument("--prompt-tokens", type=int, default=2700)
    ap.add_argument("--max-tokens", type=int, default=700, help="each running stream's answer")
    ap.add_argument("--serve-args", default="", help="more `cactus serve` arguments (one string)")
    ap.add_argument("--out")
    a = ap.parse_args()
    from openai import OpenAI

    prompt = long_prompt(a.prompt_tokens) + ASK
    cmd = [sys.executable, "-m", "cactus_cli", "serve", "--port", "0", "--no-color", "--parallel", str(a.parallel)]
    proc = subprocess.Popen(cmd + a.serve_args.split(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    proc.tail = collections.deque(maxlen=40)
    try:
        url = cactus_url(proc)
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1200)
        model = client.models.list().data[0].id
        stream(client, model, "Say hello.", 8, [], {})  # (warm-up)
        runs = [([], {}) for _ in range(a.streams)]
        threads = [
            threading.Thread(target=stream, args=(client, model, f"{RUNNING} ({i})", a.max_tokens, t, b))
            for i, (t, b) in enumerate(runs)
        ]
        for t in threads:
            t.start()
        while any(len(t) < 8 and "done" not in b for t, b in runs):
            time.sleep(0.05)
        joined, jbox = [], {}
        sent = time.perf_counter()
        stream(client, model, prompt, 16, joined, jbox)
        first = joined[0] if joined else float("nan")
        for t in threads:
            t.join()
        rows = []
        for times, box in runs:
            rows.append(
                {
                    "gap_before_s": longest_gap(times, 0, sent),
                    "gap_during_join_s": longest_gap(times, sent, first),
                    "still_running_at_first_token": box.get("done", 0) > first,
                    "tokens": (box.get("usage") or {}).get("completion_tokens"),
                }
            )
        result = {
            "cmd": " ".join(cmd[1:] + a.serve_args.split()),
            "prompt_tokens": (jbox.get("usage") or {}).get("prompt_tokens"),
            "ttft_s": first - sent,
            "streams": rows,
        }
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"joining prompt: {result['prompt_tokens']} tokens, time to first token {result['ttft_s']:.2f} s")
    for i, r in enumerate(result["streams"]):
        print(
            f"stream {i}: longest gap before the join {r['gap_before_s']:.2f} s, during it {r['gap_during_join_s']:.2f} s"
            f"{'' if r['still_running_at_first_token'] else ' (ended before the joining request answered)'}"
        )
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
