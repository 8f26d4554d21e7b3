"""Device benchmark: per-forward milliseconds of a Qwen3-8B verifier and a Qwen3-0.6B draft
(random weights from their configurations, written inline: no hub access needed), eager vs
compiled (static cache + CUDA graphs), through cactus's own runners; then the speedup over the
verifier alone that those costs project for per-token acceptance a at draft length k:

    speedup = E[tokens | k, a] * t_v(1) / (k * t_d + t_v(k + 1)),  E = (1 - a^(k+1)) / (1 - a)

    python benchmarks/gpu.py                  # CUDA, bfloat16; about 5 minutes on one H200
    python benchmarks/gpu.py --smoke          # tiny configurations, any device: checks the script

Prints a Markdown table (paste it into the README with the GPU's name it prints).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

QWEN3_8B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=4096,
)


def build(spec: dict, device: torch.device, dtype: torch.dtype, name: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from cactus_cli.infer.load.sources import LoadedModel

    config = Qwen3Config(**spec)
    t0 = time.perf_counter()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config).eval()  # random weights, made on the device
    finally:
        torch.set_default_dtype(prev)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"built {name}: {params:.2f} B parameters in {time.perf_counter() - t0:.1f} s", flush=True)
    return LoadedModel(model, name, name, device, dtype, config.max_position_embeddings, config.vocab_size)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(runner, context: int, width: int, reps: int, device: torch.device) -> float:
    """Median milliseconds of a ``width``-token forward at ``context`` cached tokens (cropped back)."""
    ids = [(7 + 31 * i) % min(1000, runner.vocab_size) for i in range(context + width)]
    runner.reset()
    runner.reserve(context + width + 1, (width,))
    runner.forward(ids[:context], keep=1)
    times = []
    for i in range(reps + 3):
        sync(device)
        t0 = time.perf_counter()
        runner.forward(ids[context : context + width], keep=width)
        sync(device)
        if i >= 3:  # warm-up calls
            times.append(time.perf_counter() - t0)
        runner.crop(context)
    return 1000 * statistics.median(times)


def expected_tokens(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=512, help="tokens already cached when a forward is timed")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ks", default="4,10")
    ap.add_argument("--smoke", action="store_true", help="2- and 1-layer tiny models: checks the script anywhere")
    args = ap.parse_args()

    from cactus_cli.infer.backends.torch.compiled import CompiledLM, compile_problem
    from cactus_cli.infer.backends.torch.eager import CachedLM

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ks = [int(k) for k in args.ks.split(",")]
    verifier_spec, draft_spec = dict(QWEN3_8B), dict(QWEN3_06B)
    if args.smoke:
        verifier_spec.update(SMOKE, num_hidden_layers=2, tie_word_embeddings=False)
        draft_spec.update(SMOKE, num_hidden_layers=1, tie_word_embeddings=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"device: {name} · {str(dtype).removeprefix('torch.')} · torch {torch.__version__} · "
        f"context {args.context} tokens",
        flush=True,
    )
    problem = compile_problem(device)
    verifier = build(verifier_spec, device, dtype, "Qwen3-8B (random)")
    draft = build(draft_spec, device, dtype, "Qwen3-0.6B (random)")
    widths = sorted({1} | {k + 1 for k in ks})
    cost: dict[str, dict[str, float]] = {}
    for mode in ("eager", "compiled"):
        if mode == "compiled" and problem:
            print(f"compiled: skipped ({problem})")
            continue
        cap = args.context + max(widths) + 2
        make = (
            (lambda lm: CompiledLM(lm, lm.logits_width, cap))
            if mode == "compiled"
            else (lambda lm: CachedLM(lm, lm.logits_width))
        )
        t0 = time.perf_counter()
        v, d = make(verifier), make(draft)
        c = {"draft 1": time_forward(d, args.context, 1, args.reps, device)}
        for w in widths:
            c[f"verifier {w}"] = time_forward(v, args.context, w, args.reps, device)
        cost[mode] = c
        print(f"{mode}: measured in {time.perf_counter() - t0:.0f} s (compiling included)", flush=True)
        del v, d
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\n### Per-forward milliseconds, {name}, {str(dtype).removeprefix('torch.')}, context {args.context}\n")
    modes = list(cost)
    print("| forward | " + " | ".join(modes) + (" | compiled / eager |" if len(modes) == 2 else " |"))
    print("|---|" + "---|" * (len(modes) + (len(modes) == 2)))
    for row in cost[modes[0]]:
        cells = [f"{cost[m][row]:.2f}" for m in modes]
        ratio = [f"{cost['eager'][row] / cost['compiled'][row]:.2f}x faster"] if len(modes) == 2 else []
        print(f"| {row} token(s) | " + " | ".join(cells + ratio) + " |")

    print("\n### Projected speedup over the verifier alone (same mode)\n")
    print("| mode | " + " | ".join(f"a={a} k={k}" for a in (0.8, 0.9) for k in ks) + " |")
    print("|---|" + "---|" * (2 * len(ks)))
    for m in modes:
        c = cost[m]
        cells = []
        for a in (0.8, 0.9):
            for k in ks:
                step = k * c["draft 1"] + c[f"verifier {k + 1}"]
                cells.append(f"{expected_tokens(a, k) * c['verifier 1'] / step:.2f}x")
        print(f"| {m} | " + " | ".join(cells) + " |")
    if len(modes) == 2:
        e, cc = cost["eager"], cost["compiled"]
        print(f"\ncompiled verifier alone vs eager verifier alone: {e['verifier 1'] / cc['verifier 1']:.2f}x")


if __name__ == "__main__":
    main()
