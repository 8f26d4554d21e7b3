"""The one device script: on one GPU, within about 8 minutes including compiles,

(a) runs the test suite's CUDA-marked tests and the CPU proofs of the CUDA fixes,
(b) proves each fix on tiny models on the device: crop/reset outside inference mode, int4
    packing vs a dequantized reference at K = 4096 and the K = 576 fallback, int8 vs bf16
    milliseconds at M = 1 and 5 (eager and compiled), host syncs per step, the cost of one
    crop, no recompiles after warm-up, no memory kept across a cache re-size, the command
    tensor of tensor parallelism, and (measured only) the cost of attention as the cache grows,
(c) runs benchmarks/gpu.py on the Qwen3-8B / 0.6B shapes and prints its table,
(d) ends with one line per check, PASS or FAIL (exit 1 if any failed).

  python benchmarks/gpu_check.py              # on a CUDA machine
  python benchmarks/gpu_check.py --cpu-smoke  # everything a CPU can run: checks the script itself
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str) -> Callable:
    """Run the decorated function now; record PASS (its return is the detail) or FAIL (the error)."""

    def run(fn: Callable[[], str]) -> None:
        t0 = time.perf_counter()
        try:
            detail, ok = fn(), True
        except Exception as err:  # noqa: BLE001 - a failed check is reported, the others still run
            detail, ok = f"{type(err).__name__}: {' '.join(str(err).split())[:240]}", False
        RESULTS.append((name, ok, f"{detail} [{time.perf_counter() - t0:.1f} s]"))
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    return run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def counted_syncs(device: torch.device, run: Callable[[], int]) -> tuple[int, int]:
    """(what ``run`` returns, the host syncs it made): CUDA's sync debug mode on a GPU; on a CPU,
    which has none, the calls that would sync."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = run()
        torch.cuda.set_sync_debug_mode("default")
        return out, sum("synchroniz" in str(w.message).lower() for w in caught)
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    count = [0]

    def wrap(real):
        def counted(t, *a, **kw):
            count[0] += 1
            return real(t, *a, **kw)

        return counted

    try:
        for n in names:
            setattr(torch.Tensor, n, wrap(saved[n]))
        out = run()
    finally:
        for n, real in saved.items():
            setattr(torch.Tensor, n, real)
    return out, count[0]


def tiny_pair(device: torch.device, dtype: torch.dtype, layers: int = 2):
    """A Qwen3-shaped verifier and draft with random weights, and a ModelPair over them."""
    from gpu import SMOKE, build
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from cactus_cli.infer.load.sources import ModelPair

    spec = dict(SMOKE, num_hidden_layers=layers, tie_word_embeddings=False, vocab_size=512)
    v = build(spec, device, dtype, "tiny verifier")
    torch.manual_seed(1)
    d = build(dict(spec, num_hidden_layers=1), device, dtype, "tiny draft")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    )
    return ModelPair(v, d, tok, 512, "as asked")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="run what a CPU can (small shapes, gpu.py --smoke)")
    args = ap.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run with --cpu-smoke to check the script on a CPU")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    name = "CPU" if args.cpu_smoke else torch.cuda.get_device_name(device)
    print(f"gpu_check on {name} · torch {torch.__version__}", flush=True)

    from cactus_cli.core.sampling import SamplingParams
    from cactus_cli.infer.backends.torch import compiled as runners
    from cactus_cli.infer.backends.torch import sharded as distributed
    from cactus_cli.infer.backends.torch.quant import quantize
    from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
    from cactus_cli.infer.load import devices as models

    compile_ok = runners.compile_problem(device) is None

    # ---------------------------------------------------------------- (a) tests
    @check("a. tests: CUDA-marked and the CPU proofs of the CUDA fixes")
    def _() -> str:
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-o",
            "addopts=",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_cuda_paths.py",
        ]
        if not args.cpu_smoke:
            cmd += ["-m", "cuda or not cuda", "tests/test_compile.py"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
        tail = (out.stdout.strip().splitlines() or [""])[-1]
        if out.returncode != 0:
            raise RuntimeError(f"pytest exited {out.returncode}: {tail}")
        return tail or "passed"

    pair = tiny_pair(device, dtype)

    # ---------------------------------------------------------------- (b) the fixes
    @check("1. crop/reset of a compiled cache outside inference mode")
    def _() -> str:
        r = runners.CompiledLM(pair.verifier, pair.vocab_size, 4096, "verifier")
        r.reserve(64, (2,) if compile_ok else ())
        r.forward(list(range(1, 20)), keep=1)
        inference = all(layer.cumulative_length.is_inference() for layer in r.cache.layers)
        r.crop(5)
        r.reset()
        return f"counters are inference tensors: {inference}; crop and reset ran"

    @check("2. int4: CUDA packing vs dequantized reference at K = 4096; K = 576 kept in int8")
    def _() -> str:
        w = torch.randn(256, 4096)
        q, scales, mins = quantize.quantize_int4(w)
        layer = quantize.Int4Linear(q, scales, mins, None, torch.bfloat16, device)
        x = torch.randn(5, 4096, device=device, dtype=torch.bfloat16)
        ref = x.float() @ quantize.dequantize_int4(q, scales, mins).to(device).T
        err = ((layer(x).float() - ref).norm() / ref.norm()).item()
        if err > 0.02:
            raise AssertionError(f"relative error {err:.4f}")
        lin = torch.nn.Linear(576, 256)
        if quantize.fits("int4", lin, "cuda"):
            raise AssertionError("K = 576 accepted for CUDA int4")
        return f"relative error {err:.5f}; K = 576 refused for CUDA int4 (falls back to int8)"

    @check("3. int8 weight-only vs bf16, one 4096x12288 projection (ms, eager / compiled)")
    def _() -> str:
        n, k = (12288, 4096) if not args.cpu_smoke else (1536, 512)
        act = torch.bfloat16
        w = torch.randn(n, k, device=device, dtype=act)
        q, s = quantize.quantize_int8(w.float())
        i8 = quantize.Int8Linear(q.to(device), s.to(device), None, act).to(device)
        bf = torch.nn.Linear(k, n, bias=False, device=device, dtype=act)
        runners.tune_inductor(device.type)
        cells = []
        for m in (1, 5):
            x = torch.randn(m, k, device=device, dtype=act)
            row = {"bf16": median_ms(lambda: bf(x), device), "int8": median_ms(lambda: i8(x), device)}
            if compile_ok:
                cb, ci = torch.compile(bf), torch.compile(i8)
                with torch.inference_mode():
                    row["bf16 compiled"] = median_ms(lambda: cb(x), device)
                    row["int8 compiled"] = median_ms(lambda: ci(x), device)
            cells.append(f"M={m}: " + ", ".join(f"{key} {v:.3f}" for key, v in row.items()))
        return "; ".join(cells)

    @check("4. host syncs per sampled k = 4 step (at most 2)")
    def _() -> str:
        engine = SpeculativeEngine(pair, compiled=compile_ok)
        engine.prepare(128, {5})
        params = GenerationParams(
            sampling=SamplingParams(temperature=1.0, top_k=0, top_p=1.0),
            num_draft_tokens=4,
            max_tokens=48,
            ignore_eos=True,
        )
        gen = engine.generate(list(range(5, 40)), params)
        next(gen)
        steps, syncs = counted_syncs(device, lambda: sum(1 for _ in gen))
        per = syncs / max(steps, 1)
        if per > 2:
            raise AssertionError(f"{syncs} syncs in {steps} steps ({per:.2f} per step)")
        return f"{syncs} syncs in {steps} steps ({per:.2f} per step; compiled: {engine.compiled})"

    @check("11. many runs: 4 slots verified in one forward per step, at most 2 host syncs per step")
    def _() -> str:
        from cactus_cli.infer.decode.batch import Batch

        engine = SpeculativeEngine(pair, sequences=4)  # (eager: a static cache holds one sequence)
        sampled = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
        batch = Batch(engine)
        for slot, k in enumerate((4, 2, 0, 3)):  # each its own k, and a plain row
            params = GenerationParams(sampling=sampled, num_draft_tokens=k, max_tokens=32, ignore_eos=True, seed=slot)
            batch.add(engine.start(list(range(5 + slot, 40 + 3 * slot)), params, slot=slot))
        batch.step()  # the prefills, then the first step
        model = pair.verifier.model
        real, widths = model.forward, []
        model.forward = lambda *a, **kw: (widths.append(kw["input_ids"].shape[0]), real(*a, **kw))[1]
        try:
            steps, syncs = counted_syncs(
                device, lambda: sum(1 for _ in iter(lambda: batch.step() if len(batch) else None, None))
            )
        finally:
            del model.forward
        per = syncs / max(steps, 1)
        if len(widths) != steps or max(widths) != 4:
            raise AssertionError(f"{len(widths)} verifier forwards in {steps} steps (rows per forward: {widths[:8]})")
        if per > 2:
            raise AssertionError(f"{syncs} syncs in {steps} steps ({per:.2f} per step)")
        return f"{steps} steps, one verifier forward each (4 rows), {syncs} syncs ({per:.2f} per step)"

    @check("5. one crop of a 36-layer static cache (microseconds)")
    def _() -> str:
        deep = tiny_pair(device, dtype, layers=36)
        r = runners.CompiledLM(deep.verifier, deep.vocab_size, 4096, "verifier")
        r.reserve(64, ())
        r.forward(list(range(1, 40)), keep=1)

        def crop_and_restore() -> None:
            r.crop(20)
            r.length = 39
            r._rewind(-19)  # forward again: a negative rewind

        us = 1000 * median_ms(crop_and_restore, device, reps=50) / 2
        return f"{us:.1f} us per crop (one foreach kernel over 36 counters)"

    @check("6. no recompiles after warm-up; cache re-size frees the old one")
    def _() -> str:
        if not compile_ok:
            return f"skipped: {runners.compile_problem(device)}"
        from torch._dynamo.utils import counters

        engine = SpeculativeEngine(pair, compiled=True)
        engine.prepare(200, {5})
        params = GenerationParams(
            sampling=SamplingParams(temperature=0.0), num_draft_tokens=4, max_tokens=32, ignore_eos=True
        )
        list(engine.generate(list(range(5, 40)), params))
        before = sum(counters["stats"].values())
        list(engine.generate(list(range(7, 50)), params))
        after = sum(counters["stats"].values())
        if after != before:
            raise AssertionError(f"dynamo stats moved {before} -> {after}: something recompiled")
        detail = "no recompiles"
        if device.type == "cuda":
            mem0 = torch.cuda.memory_allocated(device)
            v = engine.slots[0].verifier  # (a compiled engine holds one slot)
            cap0 = v.capacity
            per_token = runners.kv_bytes_per_token(pair.verifier.model.config, dtype)
            v.reserve(cap0 * 4, ())
            grown = torch.cuda.memory_allocated(device) - mem0
            expected = (v.capacity - cap0) * per_token
            if grown > expected + (64 << 20):
                raise AssertionError(f"grew {grown >> 20} MiB for {expected >> 20} MiB of cache: old cache kept")
            detail += f"; re-size grew {grown >> 20} MiB (cache delta {expected >> 20} MiB)"
        return detail

    @check("7. native bfloat16 and int4 capability")
    def _() -> str:
        if device.type != "cuda":
            return "n/a on a CPU (unit tests cover the rule)"
        cc = torch.cuda.get_device_capability(device)
        return f"compute capability {cc[0]}.{cc[1]}, native bf16: {models.cuda_native_bf16(device)}"

    @check("9. tensor-parallel command tensor on the device")
    def _() -> str:
        ids = torch.arange(300, device=device)
        cmd, rest = distributed.command("forward", 3, ids, device)
        op, n, arg, inline = distributed.parse_command(cmd)
        if (op, n, arg) != ("forward", 300, 3) or torch.cat([inline, rest]).tolist() != ids.tolist():
            raise AssertionError("round trip failed")
        return f"{distributed.CMD_SLOTS} int64 slots, rest sent after"

    @check("10. attention cost as the static cache grows (measured; fix only if it shows)")
    def _() -> str:
        if not compile_ok:
            return f"skipped: {runners.compile_problem(device)}"
        cells = []
        for cap in (1024, 8192):
            r = runners.CompiledLM(pair.verifier, pair.vocab_size, cap, "verifier")
            r.reserve(cap - 16, (1,))
            r.forward(list(range(1, 30)), keep=1)

            def step() -> None:
                r.forward([3], keep=1)
                r.crop(29)

            cells.append(f"capacity {cap}: {median_ms(step, device):.3f} ms")
        return "; ".join(cells) + " per 1-token step (repeat_kv over the whole cache would scale with capacity)"

    # ---------------------------------------------------------------- (c) the benchmark
    @check("c. benchmarks/gpu.py" + (" --smoke" if args.cpu_smoke else " (Qwen3-8B / 0.6B shapes)"))
    def _() -> str:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py")] + (
            ["--smoke", "--reps", "3"] if args.cpu_smoke else []
        )
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
        print(out.stdout)
        if out.returncode != 0:
            raise RuntimeError((out.stderr.strip().splitlines() or ["?"])[-1])
        return "table printed above"

    # ---------------------------------------------------------------- (d) summary
    print("\n## gpu_check summary (" + name + ")\n")
    for check_name, ok, detail in RESULTS:
        print(f"{'PASS' if ok else 'FAIL'}  {check_name}: {detail}")
    sys.exit(0 if all(ok for _, ok, _ in RESULTS) else 1)


if __name__ == "__main__":
    main()
