"""`cactus serve` against cactus in-process and against llama-server, on the same prompts, one after
the other in one run:

    python benchmarks/serve_bench.py --limit 4 -n 128                    # ordinary prompts, greedy
    python benchmarks/serve_bench.py --category edit --limit 4 -n 128    # edits: where drafts run long

1. In-process: Session.load (the default profile), each prompt generated and timed (decode tok/s
   after the first token, time to first token), then the same prompt again with the KV cache
   kept (time to first token with the prefix cached).
2. `cactus serve --port 0` in a subprocess: its resident memory once loaded and idle, then the same
   prompts through the `openai` client, streamed, timed the same way from the client's side (first
   chunk, last chunk, usage), each prompt then sent again (its prefix cached).
3. llama-server (built from the llama.cpp of the installed llama-cpp-python, as
   llama_cpp_anchor.py builds it) on the same GGUF, threads and buffers, plain (--spec-type none) and
   with --spec-type ngram-simple (its best server row on edits), through the same client code.

Both greedy (-t 0) by default, so every side decodes the same text. Prints one table, writes JSON
with --out. One benchmark at a time: nothing else should run on the machine meanwhile.

Many requests at once: ``--concurrent N`` sends N requests together (half edits, half
ordinary prompts, -n tokens each), streamed, to cactus serve one at a time (--parallel 1) and
batched (--parallel N), and to llama-server -np 1 with ngram-mod and -np N plain, ngram-simple and
ngram-mod (same GGUF and threads); each side's aggregate rate (every answer's tokens over the wall
time from the first request sent to the last answer) and time to first token (p50, p90):

    python benchmarks/serve_bench.py --concurrent 4 -n 256 -t 0.6
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import threading
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


def served(cmd: list[str], url_of, prompts, n, temperature) -> tuple[list[dict], float]:
    """Start a server (``cmd``; ``url_of(proc)`` waits for it and gives its /v1 url), measure its
    idle memory, then stream each prompt twice through the openai client."""
    from openai import OpenAI

    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    proc.tail = collections.deque(maxlen=40)
    try:
        url = url_of(proc)
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
                        seed=0,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    for chunk in stream:
                        if chunk.usage is not None:
                            usage["tokens"] = chunk.usage.completion_tokens
                        if chunk.choices and chunk.choices[0].delta.content:
                            seen += 1
                            yield seen
                    usage.setdefault("tokens", seen)  # (a server without the usage chunk: one token a chunk)

                out.append(timed(chunks(), lambda: usage.get("tokens", 0)))
            rows.append({"cold": out[0], "warm_ttft": out[1]["ttft"], "tokens": out[0]["tokens"]})
        return rows, idle
    finally:
        proc.terminate()
        proc.wait(30)


def drain(proc, lines: collections.deque) -> None:
    """Keep a server's stderr pipe drained, its last lines in ``lines`` (said if it dies)."""
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()


def cactus_url(proc) -> str:
    for line in proc.stderr:
        proc.tail.append(line)
        if m := re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line):
            drain(proc, proc.tail)
            return m.group(1)
    raise SystemExit("cactus serve did not start: " + "".join(proc.tail)[-2000:])


def llama_server_cmd(spec_type: str, parallel: int = 1) -> tuple[list[str], object]:
    """llama-server on the verifier GGUF cactus runs, with its threads and buffers; ``parallel``
    slots of 4096 tokens each."""
    import socket
    import urllib.request

    from cactus_cli.app.config.profile_files import resolve_settings
    from cactus_cli.app.runtime import load_request
    from cactus_cli.infer.backends.llama_cpp import gguf
    from cactus_cli.infer.pair.plan import plan_load

    sys.path.insert(0, str(Path(__file__).parent))
    from llama_cpp_anchor import build_tools

    request = load_request(resolve_settings(None, {}), device="cpu", backend="llama.cpp")
    plan = plan_load(dataclasses.replace(request, draft=None))
    bin_dir = build_tools(lambda line: print(f"[serve_bench] {line}", file=sys.stderr, flush=True))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(bin_dir / "llama-server"), "-m", plan.verifier_files[0].location, "-t", str(plan.threads)]
    cmd += ["-c", str(4096 * parallel), "-np", str(parallel), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--spec-type", spec_type]
    cmd += (
        ["--no-repack"] if gguf.amx_in_use() else []
    )  # (an AMX build: its only batch-safe choice, llama_cpp_anchor.py)

    def url_of(proc) -> str:
        drain(proc, proc.tail)
        for _ in range(1200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                return f"http://127.0.0.1:{port}/v1"
            except OSError:
                time.sleep(0.2)
        raise SystemExit("llama-server did not start")

    return cmd, url_of


def concurrent(cmd: list[str], url_of, prompts: list[str], n: int, temperature: float, rounds: int) -> dict:
    """Start a server; ``rounds`` times, send every prompt at once, streamed; the aggregate rate
    and each request's time to first token per round."""
    from openai import OpenAI

    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    proc.tail = collections.deque(maxlen=40)
    try:
        url = url_of(proc)
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1200)
        model = client.models.list().data[0].id
        out = []
        for r in range(rounds):
            results: list = [None] * len(prompts)
            t0 = time.perf_counter()

            def one(i: int) -> None:
                first, tokens, text = None, 0, []
                stream = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompts[i]}],
                    max_tokens=n,
                    temperature=temperature,
                    seed=i + 1000 * r,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                for chunk in stream:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first if first is not None else time.perf_counter() - t0
                        text.append(chunk.choices[0].delta.content)
                results[i] = {"ttft": first, "tokens": tokens, "done": time.perf_counter() - t0, "text": "".join(text)}

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if None in results:  # (a request failed: say what the server said last, and its exit code)
                time.sleep(1)
                raise SystemExit(
                    f"{' '.join(cmd[:6])}: a request failed (server exit code {proc.poll()}); its last lines:\n"
                    + "".join(proc.tail)
                )
            wall = max(x["done"] for x in results)
            out.append({"wall": wall, "tokens": sum(x["tokens"] for x in results), "requests": results})
        return {"rounds": out}
    finally:
        proc.terminate()
        proc.wait(30)


def concurrent_main(a) -> None:
    from cactus_cli.app.prompts import load_prompts

    half = a.concurrent // 2
    edits = [p.prompt for p in load_prompts(None, half, ["edit"])]
    plain = [p.prompt for p in load_prompts(None, a.concurrent - half, None)]
    prompts = [x for pair in zip(edits, plain) for x in pair] + edits[len(plain) :] + plain[len(edits) :]
    serve = [sys.executable, "-m", "cactus_cli", "serve", "--port", "0", "--no-color"]
    sides = {
        "cactus serve, one at a time (--parallel 1)": (serve + ["--parallel", "1"], cactus_url),
        f"cactus serve --parallel {a.concurrent}": (serve + ["--parallel", str(a.concurrent)], cactus_url),
    }
    if not a.no_llama_server:
        sides["llama-server -np 1 ngram-mod"] = llama_server_cmd("ngram-mod", 1)
        for spec in ("none", "ngram-simple", "ngram-mod"):
            sides[f"llama-server -np {a.concurrent} {'plain' if spec == 'none' else spec}"] = llama_server_cmd(
                spec, a.concurrent
            )
    results = {}
    for name, (cmd, url_of) in sides.items():
        print(f"[serve_bench] {name}", file=sys.stderr, flush=True)
        results[name] = concurrent(cmd, url_of, prompts, a.n, a.temperature, a.rounds)

    def q(values, f):
        values = sorted(values)
        at = f * (len(values) - 1)
        lo = int(at)
        return values[lo] + (values[min(lo + 1, len(values) - 1)] - values[lo]) * (at - lo)

    first = next(iter(results))
    print(f"{'':<46} {'all tok/s':>9} {'x one at a time':>15} {'TTFT p50 s':>10} {'TTFT p90 s':>10} {'tokens':>7}")
    base = None
    for name, doc in results.items():
        rates = [r["tokens"] / r["wall"] for r in doc["rounds"]]
        rate = statistics.median(rates)
        base = rate if name == first else base
        ttfts = [x["ttft"] for r in doc["rounds"] for x in r["requests"] if x["ttft"] is not None]
        tokens = sum(r["tokens"] for r in doc["rounds"])
        print(
            f"{name:<46} {rate:>9.2f} {rate / base:>14.2f}x {q(ttfts, 0.5):>10.2f} {q(ttfts, 0.9):>10.2f} {tokens:>7}"
        )
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--temperature", type=float, default=0.0)
    ap.add_argument("--category", default=None, help="built-in prompt categories (edit: standard-library edits)")
    ap.add_argument("--no-llama-server", action="store_true", help="only cactus, in-process and served")
    ap.add_argument("--out")
    ap.add_argument("--concurrent", type=int, default=0, help="send this many requests at once (see above)")
    ap.add_argument("--rounds", type=int, default=2, help="--concurrent: rounds per side (the median is shown)")
    a = ap.parse_args()
    if a.concurrent:
        return concurrent_main(a)
    from cactus_cli.app.prompts import load_prompts

    prompts = [p.prompt for p in load_prompts(None, a.limit, a.category.split(",") if a.category else None)]
    results = {"cactus in-process (Session)": (in_process(prompts, a.n, a.temperature), None)}
    cmd = [sys.executable, "-m", "cactus_cli", "serve", "--port", "0", "--no-color", "--seed", "0"]
    results["cactus serve (openai client)"] = served(cmd, cactus_url, prompts, a.n, a.temperature)
    if not a.no_llama_server:
        for spec in ("none", "ngram-simple"):
            name = "llama-server plain" if spec == "none" else f"llama-server {spec}"
            results[name] = served(*llama_server_cmd(spec), prompts, a.n, a.temperature)

    def mean(rows, f):
        vals = [f(r) for r in rows if f(r) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    def decode(rows):
        return mean(rows, lambda r: r["cold"]["decode_tok_s"])

    print(f"{'':<30} {'decode tok/s':>12} {'TTFT cold s':>11} {'TTFT cached s':>13} {'idle RSS MB':>11} {'tokens':>6}")
    for name, (rows, idle) in results.items():
        print(
            f"{name:<30} {decode(rows):>12.2f} {mean(rows, lambda r: r['cold']['ttft']):>11.2f} "
            f"{mean(rows, lambda r: r['warm_ttft']):>13.2f} {idle or float('nan'):>11.0f} "
            f"{sum(r['cold']['tokens'] for r in rows):>6}"
        )
    base = decode(results["cactus in-process (Session)"][0])
    print(f"cactus serve / in-process decode: {decode(results['cactus serve (openai client)'][0]) / base:.3f}")
    if a.out:
        doc = {name: {"rows": rows, "idle_rss_mb": idle} for name, (rows, idle) in results.items()}
        Path(a.out).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
