"""cactus against llama.cpp itself, in one run, on the same GGUF files, threads and kernels.

    python benchmarks/llama_cpp_anchor.py                          # 8 built-in prompts, the default profile
    python benchmarks/llama_cpp_anchor.py --category edit --limit 12 -n 256
    python benchmarks/llama_cpp_anchor.py --category edit -t 0     # both sides greedy
    python benchmarks/llama_cpp_anchor.py --limit 8 -- --draft suffix   # more cactus bench arguments after --

1. Builds llama-bench, llama-speculative, llama-speculative-simple and llama-server (once, cached in
   ~/.cache/cactus/llama.cpp-VERSION) from the llama.cpp vendored in the llama-cpp-python sdist of the
   installed version (pip download; cmake and a C++ compiler).
2. Resolves the files and threads the default profile runs (the embedded verifier may run requantized:
   infer/backends/llama_cpp/gguf_layout.py); every llama.cpp row runs that same file on those threads.
3. llama-bench: plain decoding (tg, -p 0 -n 64) and the verifier's cost per width (pp 1..64).
4. llama.cpp's plain decoding of the same prompts: llama-server with --spec-type none (both sides pay
   the same context), one request per prompt, its own timings.
5. llama.cpp's free-draft speculation: llama-speculative-simple --spec-type ngram-simple, ngram-mod and
   ngram-cache at their default draft sizes, and ngram-simple / ngram-mod with longer drafts (it
   overshoots -n by up to a draft of fast copying: each row says how many tokens it decoded), and the
   same through llama-server, which stops at exactly -n tokens; the best row is the reference.
   With --draft-model, llama-speculative with the 0.5B draft too (--spec-n).
6. cactus bench: the verifier alone and the default profile as it ships (arguments after -- change it).
7. llama-bench's plain decoding again: a shared machine drifts over minutes, so the anchor is the mean
   of the runs before and after (both printed).

Prints every row's decode tokens/s (after each prompt's prefill, as llama-bench's tg and llama.cpp's own
"decoded" count), its ratio to llama.cpp's plain decoding of the same prompts and to the best ngram
row, its mean acceptance length (tokens per verifier call, plain steps included) and end-to-end
tokens/s; writes JSON with
--out. Sampling is the profile's (T, top-k, top-p; min-p 0 on llama.cpp's side, as cactus has none),
or greedy with -t 0. On AMX builds (gguf.amx_in_use) llama.cpp's tools get --repack 0 / --no-repack:
their one switch turns every extra buffer type off, and with AMX's on a verify crashes; cactus puts
the weights the CPU repack has kernels for in its buffers by name (gguf.repack_overrides), so there
its kernels are the faster ones (the JSON's "buffers" says which each side ran). One benchmark at a
time: nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

from cactus_cli.core.paths import cache_dir
from cactus_cli.infer.backends.llama_cpp import gguf
from cactus_cli.infer.load import embedded

TOOLS = ("llama-bench", "llama-speculative", "llama-speculative-simple", "llama-server")
# (name, --spec-type, extra arguments): the defaults, then longer drafts (ngram-cache drafts 8, fixed)
NGRAM_ROWS = (
    ("ngram-simple", "ngram-simple", []),
    ("ngram-simple, drafts of 64", "ngram-simple", ["--spec-ngram-simple-size-m", "64"]),
    ("ngram-mod", "ngram-mod", []),
    ("ngram-mod, drafts of 64-128", "ngram-mod", ["--spec-ngram-mod-n-min", "64", "--spec-ngram-mod-n-max", "128"]),
    ("ngram-cache", "ngram-cache", []),
)


def build_tools(log) -> Path:
    """llama.cpp's tools from the sdist of the installed llama-cpp-python."""
    ver = version("llama-cpp-python")
    root = cache_dir() / f"llama.cpp-{ver}"
    bin_dir = root / "build" / "bin"
    if all((bin_dir / tool).is_file() for tool in TOOLS):
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    if not src.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            log(f"downloading the llama-cpp-python {ver} sdist")
            subprocess.run(
                [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={ver}", "--no-deps"]
                + ["--no-binary", ":all:", "-d", tmp, "-q"],
                check=True,
            )
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            os.replace(next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")), src)
    t0 = time.perf_counter()
    log(f"building {', '.join(TOOLS)} (a few minutes, once)")
    subprocess.run(
        ["cmake", "-S", str(src), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF"]
        + ["-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    subprocess.run(
        ["cmake", "--build", str(root / "build"), "--target", *TOOLS, "-j", str(os.cpu_count() or 2)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log(f"built in {time.perf_counter() - t0:.0f} s")
    return bin_dir


def llama_bench(bin_dir: Path, model: Path, threads: int, plain: bool, args: list[str]) -> list[dict]:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-o", "json", "-r", "3"]
    cmd += ["--repack", "0" if plain else "1", *args]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def sampling_args(sampling: dict) -> list[str]:
    return ["--temp", str(sampling["temperature"]), "--top-k", str(sampling["top_k"])] + [
        "--top-p",
        str(sampling["top_p"]),
        "--min-p",
        "0",
        "--seed",
        "0",
    ]


def speculative_simple(
    bin_dir: Path, verifier: Path, texts: list[Path], threads: int, plain: bool, n: int, sampling: dict, row: tuple
) -> dict:
    """llama-speculative-simple over the prompts: decoded tokens / decode seconds, summed."""
    name, spec_type, extra = row
    tokens = seconds = encode = accepted = drafted = 0.0
    for text in texts:
        cmd = [str(bin_dir / "llama-speculative-simple"), "-m", str(verifier), "-f", str(text), "-n", str(n)]
        cmd += ["-t", str(threads), "-c", "4096", "--spec-type", spec_type, *extra, *sampling_args(sampling)]
        if plain:
            cmd.append("--no-repack")
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        tokens, seconds = tokens + int(m.group(1)), seconds + float(m.group(2))
        encode += float(re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log).group(1))
        accepted += int(re.search(r"n_accept\s+=\s+(\d+)", log).group(1))
        drafted += int(re.search(r"n_drafted\s+=\s+(\d+)", log).group(1))

    return {
        "row": f"llama-speculative-simple {name}",
        "tokens": int(tokens),
        "decode_seconds": seconds,
        "decode_tokens_per_second": tokens / seconds,
        "end_to_end_tokens_per_second": tokens / (seconds + encode),
        "mean_acceptance_length": tokens / (tokens - accepted),  # per verifier call: each emits one not drafted
        "acceptance": accepted / drafted if drafted else None,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server(
    bin_dir: Path, verifier: Path, texts: list[Path], threads: int, plain: bool, n: int, sampling: dict, row: tuple
):
    """llama-server with ``row``'s --spec-type (none: plain decoding) over the same prompts, one
    request each, its own timings: exactly ``n`` tokens a prompt, where llama-speculative-simple
    overshoots by up to a draft."""
    name, spec_type, extra = row
    port = _free_port()
    cmd = [str(bin_dir / "llama-server"), "-m", str(verifier), "-t", str(threads), "-c", "4096", "-np", "1"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--spec-type", spec_type, *extra]
    cmd += ["--no-repack"] if plain else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        tokens = decode = prompt = drafted = accepted = 0.0
        for text in texts:
            body = {"prompt": text.read_text(), "n_predict": n, "cache_prompt": False, "temperature"
                    : sampling["temperature"], "top_k": sampling["top_k"], "top_p": sampling["top_p"], "min_p": 0.0,
                    "seed": 0}  # fmt: skip
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            timings = json.load(urllib.request.urlopen(req, timeout=3600))["timings"]
            tokens += timings["predicted_n"]
            decode += timings["predicted_ms"] / 1000
            prompt += timings["prompt_ms"] / 1000
            drafted += timings.get("draft_n", 0)
            accepted += timings.get("draft_n_accepted", 0)
    finally:
        proc.terminate()
        proc.wait()
    return {
        "row": "llama.cpp plain decoding (llama-server)" if spec_type == "none" else f"llama-server {name}",
        "tokens": int(tokens),
        "decode_seconds": decode,
        "decode_tokens_per_second": tokens / decode,
        "end_to_end_tokens_per_second": tokens / (decode + prompt),
        "mean_acceptance_length": tokens / (tokens - accepted) if tokens > accepted else None,  # per verifier call
        "acceptance": accepted / drafted if drafted else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="default: the profile's (measured at first start)")
    ap.add_argument("-n", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--category", default=None, help="built-in prompt categories (edit: standard-library edits)")
    ap.add_argument("-t", "--temperature", type=float, default=None, help="both sides (default: the profile's)")
    ap.add_argument("--draft-model", action="store_true", help="also llama-speculative with the 0.5B draft")
    ap.add_argument("--ngram", default=None, help="only these ngram rows (comma list of their names)")
    ap.add_argument("--spec-n", default="2,4", help="llama-speculative draft lengths (comma list)")
    ap.add_argument("--out", type=Path, default=None, help="write the whole result as JSON here")
    ap.add_argument("bench_args", nargs="*", help="after --: more cactus bench arguments")
    a = ap.parse_args()

    def log(line: str) -> None:
        print(f"[anchor] {line}", file=sys.stderr, flush=True)

    from transformers import AutoTokenizer

    from cactus_cli.app.config.profile_files import resolve_settings
    from cactus_cli.app.prompts import load_prompts
    from cactus_cli.app.runtime import load_request
    from cactus_cli.infer.pair.plan import plan_load

    settings = resolve_settings(None, {"threads": a.threads} if a.threads else {})
    bin_dir = build_tools(log)
    request = dataclasses.replace(load_request(settings, device="cpu", backend="llama.cpp"), draft=None)
    plan = plan_load(request)  # the verifier as cactus runs it
    verifier, threads = Path(plan.verifier_files[0].location), plan.threads
    plain = gguf.amx_in_use()
    log(f"verifier {verifier.name} ({plan.quantize_reason}); threads {threads}")
    log(
        f"cactus: {gguf.buffer_layout()}; llama.cpp's tools: plain buffers (AMX build: --repack 0)"
        if plain
        else "extra buffers (repacked weights) on both sides"
    )
    sampling = {"temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p}
    if a.temperature is not None:
        sampling["temperature"] = a.temperature
    result: dict = {
        "threads": threads,
        "verifier_file": str(verifier),
        "buffers": {"cactus": gguf.buffer_layout(), "llama.cpp tools": "plain" if plain else "repacked"},
        "sampling": sampling,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "llama_cpp_python": version("llama-cpp-python"),
        "rows": [],
    }
    log("llama-bench: plain decoding")
    before = llama_bench(bin_dir, verifier, threads, plain, ["-p", "0", "-n", "64"])[0]["avg_ts"]
    widths = llama_bench(bin_dir, verifier, threads, plain, ["-p", "1,2,4,8,16,32,64", "-n", "0"])
    result["llama_bench_width_ms"] = {str(r["n_prompt"]): 1000 * r["n_prompt"] / r["avg_ts"] for r in widths}
    tok = AutoTokenizer.from_pretrained(str(Path(plan.verifier_files[1].location)))
    prompts = load_prompts(None, a.limit, a.category.split(",") if a.category else None)
    folder = Path(tempfile.mkdtemp(prefix="cactus-anchor-"))
    texts = []
    for i, p in enumerate(prompts):
        texts.append(folder / f"{i}.txt")
        chat = [{"role": "user", "content": p.prompt}]
        texts[-1].write_text(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    rows = result["rows"]
    log("llama-server: plain decoding of the same prompts")
    rows.append(server(bin_dir, verifier, texts, threads, plain, a.n, sampling, ("plain", "none", [])))
    wanted = a.ngram.split(",") if a.ngram else [r[0] for r in NGRAM_ROWS]
    for row in (r for r in NGRAM_ROWS if r[0] in wanted):
        log(f"llama-speculative-simple --spec-type {row[1]} {' '.join(row[2])}")
        rows.append(speculative_simple(bin_dir, verifier, texts, threads, plain, a.n, sampling, row))
        if row[1] != "ngram-cache":  # (the server's ngram-cache needs cache files)
            log(f"llama-server --spec-type {row[1]} {' '.join(row[2])}")
            rows.append(server(bin_dir, verifier, texts, threads, plain, a.n, sampling, row))
    if a.draft_model:
        draft = embedded.embedded_gguf("qwen2.5-coder-0.5b")
        for k in a.spec_n.split(","):
            log(f"llama-speculative, the 0.5B draft, --spec-draft-n-max {k}")
            rows.append(speculative(bin_dir, verifier, draft, texts, threads, plain, a.n, int(k), sampling))
    log("cactus bench")
    cmd = [sys.executable, "-m", "cactus_cli", "bench", "--limit", str(a.limit), "-n", str(a.n), "--json"]
    cmd += ["--threads", str(threads), "--temperature", str(sampling["temperature"])]
    cmd += ["--category", a.category] if a.category else []
    cmd += [] if "--rules" in a.bench_args else ["--rules", settings.rule]
    doc = json.loads(subprocess.run([*cmd, *a.bench_args], capture_output=True, text=True, check=True).stdout)
    result["cactus"] = doc
    for r in doc["results"]:
        rows.append(
            {
                "row": f"cactus {r['config']}",
                "tokens": r["num_output_tokens"],
                "decode_tokens_per_second": r["decode_tokens_per_second"],
                "end_to_end_tokens_per_second": r["tokens_per_second"],
                "mean_acceptance_length": 1 / r["verifier_forward_passes_per_token"],  # tokens per verifier call
                "mean_k": r["mean_k"],
            }
        )
    log("llama-bench: plain decoding again")
    after = llama_bench(bin_dir, verifier, threads, plain, ["-p", "0", "-n", "64"])[0]["avg_ts"]
    result["llama_bench_tg"] = {"before": before, "after": after}
    report(result, before, after)
    if a.out:
        a.out.write_text(json.dumps(result, indent=2))
        log(f"wrote {a.out}")


def report(result: dict, before: float, after: float) -> None:
    rows = result["rows"]
    plain = rows[0]["decode_tokens_per_second"]
    ngram = [r for r in rows if "ngram" in r["row"]]
    best = max(ngram, key=lambda r: r["decode_tokens_per_second"])
    print(f"verifier {Path(result['verifier_file']).name}, {result['threads']} threads, sampling {result['sampling']}")
    print(f"llama-bench tg64: {before:.2f} tok/s before, {after:.2f} after (anchor {(before + after) / 2:.2f})")
    print(
        "llama-bench ms per width: " + ", ".join(f"{w}: {ms:.0f}" for w, ms in result["llama_bench_width_ms"].items())
    )
    head = f"{'row':<58} {'tokens':>6} {'decode tok/s':>12} {'x plain':>8} {'x best ngram':>12} {'MAL':>6} {'e2e tok/s':>9}"
    print(head)
    for r in rows:
        tps = r["decode_tokens_per_second"] or 0.0
        print(
            f"{r['row'][:58]:<58} {r['tokens']:6d} {tps:12.2f} {tps / plain:7.2f}x {tps / best['decode_tokens_per_second']:11.2f}x "
            f"{r['mean_acceptance_length'] or 0:6.2f} {r['end_to_end_tokens_per_second'] or 0:9.2f}"
        )
    print(f"best ngram row: {best['row']}")


def speculative(
    bin_dir: Path,
    verifier: Path,
    draft: Path,
    texts: list[Path],
    threads: int,
    plain: bool,
    n: int,
    spec_n: int,
    sampling,
) -> dict:
    """llama-speculative with a draft model over the prompts."""
    tokens = seconds = accepted = drafted = 0.0
    for text in texts:
        cmd = [
            str(bin_dir / "llama-speculative"),
            "-m",
            str(verifier),
            "-md",
            str(draft),
            "-f",
            str(text),
            "-n",
            str(n),
        ]
        cmd += ["-t", str(threads), "--spec-draft-n-max", str(spec_n), "-c", "4096", *sampling_args(sampling)]
        if plain:
            cmd.append("--no-repack")
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        tokens, seconds = tokens + int(m.group(1)), seconds + float(m.group(2))
        accepted += int(re.search(r"n_accept\s+=\s+(\d+)", log).group(1))
        drafted += int(re.search(r"n_drafted\s+=\s+(\d+)", log).group(1))
    return {
        "row": f"llama-speculative, 0.5B draft, {spec_n} drafts",
        "tokens": int(tokens),
        "decode_seconds": seconds,
        "decode_tokens_per_second": tokens / seconds,
        "end_to_end_tokens_per_second": None,
        "mean_acceptance_length": None,
        "acceptance": accepted / drafted if drafted else None,
    }


if __name__ == "__main__":
    main()
