"""cactus against llama.cpp itself, in one run, on the same GGUF files, threads and kernels.

    python benchmarks/llama_cpp_anchor.py                   # the embedded pair, the default profile
    python benchmarks/llama_cpp_anchor.py --limit 8 -n 128 --category grounded -- --draft suffix

1. Builds llama-bench and llama-speculative (once, cached in ~/.cache/cactus/llama.cpp-VERSION) from
   the llama.cpp vendored in the llama-cpp-python sdist of the installed version (pip download;
   cmake and a C++ compiler, the flags pip's build of the bindings uses).
2. llama-bench: plain decoding of each GGUF (tg, -p 0 -n 64) and the verifier's cost per width
   (pp 1..32).
3. llama-speculative: llama.cpp's own speculative decoding with the draft on the same prompts (chat
   template applied, the profile's sampling, draft lengths --spec-n).
4. cactus bench (the profile as it ships, its rule, unless arguments after -- say otherwise), JSON.
5. llama-bench's plain decoding again: a shared machine drifts over minutes, so the anchor is the
   mean of the runs before and after (both printed).
Prints every row's decode tokens/s (after the prompt's prefill, as llama-bench's tg and
llama-speculative's "decoded" count) against llama.cpp's plain and speculative decoding, its
end-to-end tokens/s beside it, and writes JSON with --out. Where cactus runs llama.cpp with plain buffers (AMX builds: gguf.amx_in_use), llama.cpp's
tools get --repack 0 / --no-repack, so both sides run the same kernels. One benchmark at a time:
nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from cactus_cli.core.paths import cache_dir
from cactus_cli.infer import embedded, gguf


def build_tools(log) -> Path:
    """llama-bench and llama-speculative from the sdist of the installed llama-cpp-python."""
    ver = version("llama-cpp-python")
    root = cache_dir() / f"llama.cpp-{ver}"
    bin_dir = root / "build" / "bin"
    if (bin_dir / "llama-bench").is_file() and (bin_dir / "llama-speculative").is_file():
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    if not src.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            log(f"downloading the llama-cpp-python {ver} sdist")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    f"llama-cpp-python=={ver}",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "-d",
                    tmp,
                    "-q",
                ],
                check=True,
            )
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            os.replace(next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")), src)
    t0 = time.perf_counter()
    log("building llama-bench and llama-speculative (a few minutes, once)")
    subprocess.run(
        [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(root / "build"),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_SERVER=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DGGML_NATIVE=ON",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        [
            "cmake",
            "--build",
            str(root / "build"),
            "--target",
            "llama-bench",
            "llama-speculative",
            "-j",
            str(os.cpu_count() or 2),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    log(f"built in {time.perf_counter() - t0:.0f} s")
    return bin_dir


def llama_bench(bin_dir: Path, model: Path, threads: int, plain: bool, args: list[str]) -> list[dict]:
    cmd = [
        str(bin_dir / "llama-bench"),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-o",
        "json",
        "-r",
        "3",
        "--repack",
        "0" if plain else "1",
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def speculative(
    bin_dir: Path,
    verifier: Path,
    draft: Path,
    prompts: list[str],
    threads: int,
    plain: bool,
    n: int,
    spec_n: int,
    sampling: dict,
) -> dict:
    """llama-speculative over the prompts: decoded tokens / decode seconds, summed."""
    tokens = seconds = accepted = drafted = 0.0
    for prompt in prompts:
        cmd = [
            str(bin_dir / "llama-speculative"),
            "-m",
            str(verifier),
            "-md",
            str(draft),
            "-p",
            prompt,
            "-n",
            str(n),
            "-t",
            str(threads),
            "--spec-draft-n-max",
            str(spec_n),
            "-c",
            "4096",
            "--temp",
            str(sampling["temperature"]),
            "--top-k",
            str(sampling["top_k"]),
            "--top-p",
            str(sampling["top_p"]),
            "--seed",
            "0",
        ]
        if plain:
            cmd.append("--no-repack")
        text = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
        tokens, seconds = tokens + int(m.group(1)), seconds + float(m.group(2))
        accepted += int(re.search(r"n_accept\s+=\s+(\d+)", text).group(1))
        drafted += int(re.search(r"n_drafted\s+=\s+(\d+)", text).group(1))
    return {
        "spec_n": spec_n,
        "tokens": int(tokens),
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "acceptance": accepted / drafted if drafted else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=gguf.default_threads())
    ap.add_argument("-n", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--category", default=None)
    ap.add_argument("--spec-n", default="2,4", help="llama-speculative draft lengths (comma list)")
    ap.add_argument("--out", type=Path, default=None, help="write the whole result as JSON here")
    ap.add_argument("bench_args", nargs="*", help="after --: more cactus bench arguments")
    a = ap.parse_args()

    def log(line: str) -> None:
        print(f"[anchor] {line}", file=sys.stderr, flush=True)

    from transformers import AutoTokenizer

    from cactus_cli.app.profiles import resolve_settings
    from cactus_cli.app.prompts import load_prompts

    settings = resolve_settings(None, {})
    bin_dir = build_tools(log)
    verifier = embedded.embedded_gguf(settings.verifier.split(":", 1)[1])
    draft = embedded.embedded_gguf("qwen2.5-coder-0.5b")
    plain = gguf.amx_in_use()
    log(f"threads {a.threads}; {'plain buffers (AMX build: --repack 0 both sides)' if plain else 'extra buffers'}")
    result: dict = {
        "threads": a.threads,
        "plain_buffers": plain,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "llama_cpp_python": version("llama-cpp-python"),
    }
    log("llama-bench: plain decoding")
    tg = {
        name: llama_bench(bin_dir, path, a.threads, plain, ["-p", "0", "-n", "64"])[0]["avg_ts"]
        for name, path in (("verifier", verifier), ("draft", draft))
    }
    widths = llama_bench(bin_dir, verifier, a.threads, plain, ["-p", "1,2,3,5,9,17,32", "-n", "0"])
    result["llama_bench_tg"] = tg
    result["llama_bench_width_ms"] = {str(r["n_prompt"]): 1000 * r["n_prompt"] / r["avg_ts"] for r in widths}
    tok = AutoTokenizer.from_pretrained(str(embedded.gguf_tokenizer(verifier, settings.verifier.split(":", 1)[1])))
    prompts = load_prompts(None, a.limit, a.category.split(",") if a.category else None)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    sampling = {"temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p}
    log("llama-speculative")
    result["llama_speculative"] = [
        speculative(bin_dir, verifier, draft, texts, a.threads, plain, a.n, int(k), sampling)
        for k in a.spec_n.split(",")
    ]
    best_spec = max(r["tokens_per_second"] for r in result["llama_speculative"])
    log("cactus bench")
    rules = [] if "--rules" in a.bench_args else ["--rules", settings.rule]
    cmd = [
        sys.executable,
        "-m",
        "cactus_cli",
        "bench",
        "--limit",
        str(a.limit),
        "-n",
        str(a.n),
        "--json",
        "--threads",
        str(a.threads),
        *(["--category", a.category] if a.category else []),
        *rules,
        *a.bench_args,
    ]
    doc = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    result["cactus"] = doc
    log("llama-bench: plain decoding again")
    after = llama_bench(bin_dir, verifier, a.threads, plain, ["-p", "0", "-n", "64"])[0]["avg_ts"]
    result["llama_bench_tg_after"] = after
    anchor = (tg["verifier"] + after) / 2
    print(
        f"llama-bench plain decoding (tg64): verifier {tg['verifier']:.2f} tok/s before, {after:.2f} after "
        f"(anchor {anchor:.2f}); draft {tg['draft']:.2f} tok/s"
    )
    print(
        "llama-bench verifier ms per width: "
        + ", ".join(f"{w}: {ms:.0f}" for w, ms in result["llama_bench_width_ms"].items())
    )
    for r in result["llama_speculative"]:
        print(
            f"llama-speculative --spec-draft-n-max {r['spec_n']}: {r['tokens_per_second']:.2f} tok/s "
            f"(acceptance {r['acceptance']:.0%})"
        )
    print(
        f"{'cactus row':<48} {'decode tok/s':>12} {'x llama.cpp plain':>18} {'x llama.cpp spec':>17} {'end to end':>11}"
    )
    for row in doc["results"]:
        tps = row["decode_tokens_per_second"] or 0
        print(
            f"{row['config']:<48} {tps:12.2f} {tps / anchor:17.2f}x {tps / best_spec:16.2f}x "
            f"{row['tokens_per_second'] or 0:11.2f}"
        )
    if a.out:
        a.out.write_text(json.dumps(result, indent=2))
        log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
