"""Devices and dtypes: which device to run on, which dtype is fastest there (measured on a CPU,
cached: ``timed_once``, which the torch backend's quantization choice times with too), what
quantization ``auto`` means on it before measuring, and a name that tells machines apart for
cached measurements."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from cactus_cli.core.conditions import Conditions, taken
from cactus_cli.core.errors import ModelError, warn
from cactus_cli.core.fileio import atomic_write
from cactus_cli.core.paths import cache_path


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"--device {name}: CUDA is not available on this machine (use --device cpu or auto)")
    if name.startswith("cuda"):
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise ModelError(f"--device {name}: not a device name; use cuda, cuda:N, cpu or auto") from None
        check_cuda_device(dev)
        return dev
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ModelError("--device mps: MPS is not available on this machine (use --device cpu or auto)")
    return torch.device(name)


def cuda_native_bf16(device: torch.device) -> bool:
    """bfloat16 in hardware (compute capability >= 8.0). ``is_bf16_supported()`` alone also counts
    emulation (a Turing card runs it, slowly)."""
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # an older torch: no emulation to count
        return bool(torch.cuda.is_bf16_supported())


def check_cuda_device(device: torch.device) -> None:
    """``cuda:N`` must name a visible GPU: fail now with one line, not at the first allocation."""
    if device.type == "cuda" and device.index is not None:
        visible = torch.cuda.device_count()
        if device.index >= visible:
            raise ModelError(
                f"--device {device}: only {visible} GPU{'s' if visible != 1 else ''} visible "
                f"(cuda:0{f'..cuda:{visible - 1}' if visible > 1 else ''}); pick one of those"
            )


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_fast_bf16() -> bool:
    """CPUs with AVX-512 BF16 or AMX have native bfloat16 dot products."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def device_name(device: torch.device) -> str:
    """A name that tells machines apart for cached measurements: the GPU's name, or the CPU's
    model name with the flags that decide matmul speed."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    model = "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "asimd", "sve"})
    isa = torch.backends.cpu.get_cpu_capability()  # what torch's kernels use (ATEN_CPU_CAPABILITY can lower it)
    return f"{model} [{' '.join(flags)}] {isa}"


def median_seconds(
    fn, x: torch.Tensor, reps: int = 9, watch: Conditions | None = None, label: str = "timings"
) -> float:
    """Median seconds of ``fn(x)`` over ``reps`` calls, after one untimed warm-up call (the
    first call picks kernels); the timed calls' CPU share counted by ``watch`` under ``label``
    (each candidate its own: a busy spell during one of them is not averaged away by the other)."""

    def timed() -> list[float]:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
        return times

    with torch.inference_mode():
        fn(x)
        times = watch.measure(torch.get_num_threads(), timed, label) if watch is not None else timed()
    return statistics.median(times)


def _median_linear_seconds(
    dtype: torch.dtype, hidden: int, inter: int, rows: int, reps: int = 9, watch: Conditions | None = None
) -> float:  # (its CPU share counted under the dtype's name)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(inter, hidden, generator=gen).to(dtype)  # [out, in], like an MLP up-projection
    x = torch.randn(rows, hidden, generator=gen).to(dtype)  # [rows, in]
    return median_seconds(lambda x: torch.nn.functional.linear(x, w), x, reps, watch, str(dtype).removeprefix("torch."))


def timed_once(prefix: str, shape: list[int], names: tuple[str, ...], seconds) -> tuple[dict[str, float], str]:
    """``seconds(name, conditions)`` for each name, measured once per machine, threads, torch and
    shape and cached with the conditions it was taken under; (the times, when and how they were
    taken, in words). A corrupt file (zero, negative or NaN timings) or one taken beside another
    busy process (provisional) is measured again and replaced."""
    key = {
        "cpu": device_name(torch.device("cpu")),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "shape": shape,
    }
    path = cache_path(key, prefix)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        times = {name: float(v) for name, v in doc["seconds"].items() if name in names}
        if len(times) == len(names) and all(0 < t < 60 for t in times.values()):
            if doc.get("quiet") is not False:
                return times, f"cached: {taken(doc)}"
            problem = None  # (provisional: measured again below, said in the answer)
        else:
            problem = "holds invalid or incomplete timings"
    except FileNotFoundError:
        problem = None  # the first time on this machine
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        problem = "is unreadable"
    if problem:
        warn(f"the timing cache {path} {problem}; measuring again and replacing it")
    watch = Conditions.start()
    times = {name: seconds(name, watch) for name in names}
    doc = {"key": key, "seconds": times, **watch.finish()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(doc, indent=1))
    except OSError:
        pass  # not cached: the next run measures again
    return times, taken(doc)


def fastest_cpu_dtype(hidden: int, inter: int) -> tuple[torch.dtype, str]:
    """Time the model's MLP matmul shape in float32 and bfloat16 at 1 and 5 rows (one decode
    step, one short verify) and keep the faster; cached per machine, threads, torch and shape,
    so only the first run on a machine pays the ~1 s. CPU flags alone mislead: on a 2-core AVX2
    EPYC bfloat16 is 2.6x faster for a 1-token forward although it has no AVX-512 BF16."""
    times, when = timed_once(
        "dtype-",
        [hidden, inter],
        ("float32", "bfloat16"),
        lambda name, watch: sum(
            _median_linear_seconds(getattr(torch, name), hidden, inter, rows, watch=watch) for rows in (1, 5)
        ),
    )
    best = min(times, key=times.get)
    other = "float32" if best == "bfloat16" else "bfloat16"
    why = f"measured {best} {times[other] / times[best]:.2f}x faster than {other} on a {hidden}x{inter} matmul ({when})"
    return getattr(torch, best), why


def resolve_dtype(name: str, device: torch.device, mlp_shape: tuple[int, int] | None = None) -> tuple[torch.dtype, str]:
    """The dtype to run in, and why. ``auto`` on a CPU is measured (see fastest_cpu_dtype)."""
    if name != "auto":
        return getattr(torch, name), "as asked"
    if device.type == "cuda":
        if cuda_native_bf16(device):
            return torch.bfloat16, "CUDA with native bfloat16"
        return torch.float16, "CUDA without native bfloat16 (compute capability < 8.0)"
    if device.type == "mps":
        return torch.float16, "MPS"
    if mlp_shape is None:
        return (torch.bfloat16, "CPU has AVX-512 BF16 / AMX") if cpu_has_fast_bf16() else (torch.float32, "CPU flags")
    return fastest_cpu_dtype(*mlp_shape)


AUTO_QUANTIZE_CPU = "int8"  # quantize: auto on a CPU before measuring (models.choose_quantize may pick w8a8)


def resolve_quantize(name: str, device: torch.device, dtype: str = "auto") -> str:
    """``auto``: weight-only quantization on a CPU (decoding there is bound by bytes read per
    token), none on a GPU (whose kernels here need a compiled graph to pay), and none when the
    user asked for activations the kernels do not run fast on (``--dtype float32``)."""
    if name != "auto":
        return name
    return AUTO_QUANTIZE_CPU if device.type == "cpu" and dtype in ("auto", "bfloat16") else "none"
