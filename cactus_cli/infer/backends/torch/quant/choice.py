"""Choosing a quantization for the torch backend on this machine: ``--quantize auto`` on a CPU
measures int8 weight-only against w8a8 on the model's MLP matmul (``fastest_cpu_quantization``,
timed and cached as load/devices.py times dtypes), and quantized weights run on the activations
their kernels are fast on (``quantized_dtype``)."""

from __future__ import annotations

import functools

import torch

from cactus_cli.core.conditions import Conditions
from cactus_cli.core.errors import ModelError
from cactus_cli.infer.backends.torch.quant.qlayers import Int8DynamicLinear, Int8Linear, quantize_int8, w8a8_problem
from cactus_cli.infer.load.devices import cuda_native_bf16, median_seconds, timed_once


def fastest_cpu_quantization(hidden: int, inter: int, rows: int = 9) -> tuple[str, str]:
    """``--quantize auto`` on a CPU: int8 weight-only or w8a8, whichever runs the model's MLP
    matmul faster at the two widths a step runs (1 token, and a verify of ``rows``: k_max + 1),
    measured once per machine and cached. (w8a8's quality gate: models.load_pair.)"""
    if w8a8_problem(torch.device("cpu")) is not None:
        return "int8", "fbgemm is not available for w8a8"
    gen = torch.Generator().manual_seed(0)

    @functools.cache
    def weights() -> tuple[torch.Tensor, torch.Tensor]:  # made only when not cached: not on every start
        return quantize_int8(torch.randn(inter, hidden, generator=gen) * 0.02)

    def seconds(name: str, watch: Conditions) -> float:
        layer = (Int8DynamicLinear if name == "w8a8" else Int8Linear)(*weights(), None, torch.bfloat16)
        return sum(
            median_seconds(layer, torch.randn(n, hidden, generator=gen).to(torch.bfloat16), 7, watch, name)
            for n in (1, rows)
        )

    times, when = timed_once("quantize-", [hidden, inter, rows], ("int8", "w8a8"), seconds)
    best = min(times, key=times.get)
    other = "int8" if best == "w8a8" else "w8a8"
    return best, (
        f"measured {best} {times[other] / times[best]:.2f}x faster than "
        f"{other} on a {hidden}x{inter} matmul at 1 and {rows} rows ({when})"
    )


def quantized_dtype(method: str, dtype: str, device: torch.device) -> tuple[torch.dtype, str]:
    """Activations for quantized weights: the packed kernels run fast on bfloat16 only (on a CPU
    float32 activations take a slow path: 7.6 ms instead of 0.6 for one int8 row)."""
    if device.type == "cuda" and method == "int4" and torch.cuda.get_device_capability(device) < (8, 0):
        major, minor = torch.cuda.get_device_capability(device)
        raise ModelError(
            f"--quantize int4 on CUDA needs compute capability 8.0 or newer (this GPU has "
            f"{major}.{minor}); use --quantize int8 or none"
        )
    if method == "w8a8":
        if (problem := w8a8_problem(device)) is not None:
            raise ModelError(problem)
        if dtype not in ("auto", "bfloat16", "float32"):
            raise ModelError(f"--quantize w8a8 runs on bfloat16 or float32 activations; use --dtype auto, not {dtype}")
        return (
            (torch.float32, "w8a8 weights, float32 activations (as asked)")
            if dtype == "float32"
            else (torch.bfloat16, "w8a8 weights, bfloat16 activations between the int8 matmuls")
        )
    if dtype in ("auto", "bfloat16"):
        if device.type == "cuda" and not cuda_native_bf16(device):
            return torch.float16, f"{method} weights, float16 activations (no bfloat16 on this GPU)"
        return torch.bfloat16, f"{method} weights run on bfloat16 activations"
    if device.type == "cuda" and method == "int8":
        return getattr(torch, dtype), "as asked"
    raise ModelError(
        f"--quantize {method} runs on bfloat16 activations; use --dtype bfloat16 (or auto), "
        f"or --quantize none to run in {dtype}"
    )
