"""`cactus serve` against cactus in-process, on the same prompts and settings, one after the other:

    python benchmarks/serve_bench.py --limit 4 -n 128           # the default profile, greedy

1. In-process: Session.load (the default profile), each prompt generated and timed (decode tok/s
   after the first token, time to first token), then the same prompt again with the KV cache
   kept (time to first token with the prefix cached).
2. The server: `cactus serve --port 0` in a subprocess, its resident memory once loaded and idle,
   then the same prompts through the `openai` client, streamed, timed the same way from the
   client's side (first chunk, last chunk, usage), each prompt then sent again.

Both greedy (-t 0) by default, so both sides decode the same tokens. Prints one table, writes JSON
with --out. One benchmark at a time: nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def timed(stream, count) -> dict:
    """Time a stream of (text, tokens-so-far) items: first token, decode rate after it."""
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    for n in stream:
        now = time.perf_counter()
        first = first if first is not None else now
        last, tokens = now, n
    tokens = count() if count else tokens
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
    return {"ttft": first - t0, "tokens": tokens, "decode_tok_s": decode}


def in_process(prompts, n, temperature) -> list[dict]:
    from cactus_cli.app.session import Session

    session = Session.load(max_tokens=n, temperature=temperature, seed=0)
    session.prepare(512)
    rows = []
    for p in prompts:
        cold = timed((session.stats.num_output_tokens for _ in session.generate(p)), None)
        warm = timed((session.stats.num_output_tokens for _ in session.generate(p, reuse_cache=True)), None)
        rows.append({"cold": cold, "warm_ttft": warm["ttft"]})
    return rows


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def served(prompts, n, temperature) -> tuple[list[dict], float]:
    from openai import OpenAI

    cmd = [sys.executable, "-m", "cactus_cli", "serve", "--port", "0", "--no-color", "--seed", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            if m := re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line):
                url = m.group(1)
                break
        if url is None:
            raise SystemExit("cactus serve did not start")
        time.sleep(2)
        idle = rss_mb(proc.pid)
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        rows = []
        for p in prompts:
            out = []
            for _ in range(2):
                usage = {}

                def chunks():
                    seen = 0
                    stream = client.chat.completions.create(
                        model=model,
                        messages=[{"role": "user", "content": p}],
                        max_tokens=n,
                        temperature=temperature,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    for chunk in stream:
                        if chunk.usage is not None:
                            usage["tokens"] = chunk.usage.completion_tokens
                        elif chunk.choices and chunk.choices[0].delta.content:
                            seen += 1
                            yield seen

                out.append(timed(chunks(), lambda: usage.get("tokens", 0)))
            rows.append({"cold": out[0], "warm_ttft": out[1]["ttft"]})
        return rows, idle
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--temperature", type=float, default=0.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    from cactus_cli.app.prompts import builtin_prompts

    prompts = [p.prompt for p in builtin_prompts(None)][: a.limit]
    local = in_process(prompts, a.n, a.temperature)
    remote, idle = served(prompts, a.n, a.temperature)

    def mean(rows, f):
        vals = [f(r) for r in rows if f(r) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    print(f"{'':<28} {'decode tok/s':>12} {'TTFT cold s':>11} {'TTFT cached s':>13}")
    for name, rows in (("cactus in-process (Session)", local), ("cactus serve (openai client)", remote)):
        print(
            f"{name:<28} {mean(rows, lambda r: r['cold']['decode_tok_s']):>12.2f} "
            f"{mean(rows, lambda r: r['cold']['ttft']):>11.2f} {mean(rows, lambda r: r['warm_ttft']):>13.2f}"
        )
    ratio = mean(remote, lambda r: r["cold"]["decode_tok_s"]) / mean(local, lambda r: r["cold"]["decode_tok_s"])
    print(f"server / in-process decode: {ratio:.3f}; idle server RSS {idle:.0f} MB")
    if a.out:
        Path(a.out).write_text(json.dumps({"in_process": local, "served": remote, "idle_rss_mb": idle}, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
