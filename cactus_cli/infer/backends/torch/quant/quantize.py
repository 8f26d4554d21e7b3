"""Quantization of every Linear layer (lm_head included), with torch's own kernels. Weight-only,
the way gpt-fast does it:

- ``int8``: symmetric, one scale per output channel. CPU: ``aten._weight_int8pack_mm``;
  elsewhere ``F.linear(x, w.to(x.dtype)) * scales``, which torch.compile fuses (CUDA).
- ``int4``: asymmetric, one scale and zero per group of ``INT4_GROUP`` input channels.
  CPU: ``aten._weight_int4pack_mm_for_cpu``; CUDA: ``aten._weight_int4pack_mm`` (tinygemm).

Activations stay in the model's dtype (bfloat16: the packed CPU kernels are fast only there).
And int8 x int8 on a CPU:

- ``w8a8``: int8 weights (symmetric, per output channel, as ``int8``) times activations quantized
  to int8 at each call (one scale per row: see ``Int8DynamicLinear``), on fbgemm's dynamic linear
  (``quantized.linear_dynamic`` over ``quantized.linear_prepack``): x86's int8 GEMM, flat in the
  number of rows, where the weight-only kernels slow down with every verified token on AVX2. The
  layers whose inputs carry outlier channels (``mlp.down_proj``, after SwiGLU) and the output
  head stay on the weight-only int8 kernel: one scale per row cannot hold those inputs (README,
  "Quantized weights": NLL per plan).
torchao was the first choice and was measured first: torchao 0.18 with torch 2.13 could not load
its compiled extension, its Int8WeightOnlyConfig ran a 1536x8960 matmul 2.3x *slower* than
bfloat16 (3.85 vs 1.70 ms) and its CPU int4 layout is gone; torch's kernels ran it in 0.60 ms
(int8) and 0.56 ms (int4). See CHANGELOG.

Quantized tensors are cached (``$CACTUS_HOME/quantized``, keyed by the weights, method, group
and versions), so a second start does not quantize again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from cactus_cli.core.errors import warn
from cactus_cli.core.fileio import atomic_write
from cactus_cli.core.paths import cache_dir, cache_path
from cactus_cli.infer.backends.torch.quant import layerwise, smooth
from cactus_cli.infer.backends.torch.quant.memory import file_mappings, release_pages, trim_heap
from cactus_cli.infer.backends.torch.quant.qcache import CacheReader, CacheWriter, checksum  # noqa: F401 (checksum: tests)
from cactus_cli.infer.backends.torch.quant.qlayers import (  # noqa: F401  (the layers and arithmetic, re-exported)
    INT4_GROUP,
    INT4_TILES,
    Int4Linear,
    Int8DynamicLinear,
    Int8Linear,
    SharedInput,
    SharedInputSlice,
    dequantize_int4,
    dequantize_int8,
    input_stacks,
    quantize_int4,
    quantize_int8,
    w8a8_problem,
)

METHODS = ("none", "int8", "int4", "w8a8")
W8A8_KEEP: tuple[str, ...] = ()  # layer names (last part) kept on weight-only int8 under w8a8 (see README)
FORMAT = 3  # bump when what is cached changes (2: int4 keeps the head in int8; 3: a checksum)


def fits(method: str, linear: nn.Linear, device_type: str = "cpu") -> bool:
    """Whether the packed kernel takes this layer's [N, K] shape. int8: any. int4: whole groups
    and N % 8 on a CPU; CUDA's packing also needs K % (INT4_TILES * 16) = K % 128, so hidden
    sizes such as 576 or 960 do not fit there."""
    n, k = linear.weight.shape
    if method in ("int8", "w8a8"):
        return True
    return k % INT4_GROUP == 0 and n % 8 == 0 and (device_type != "cuda" or k % (INT4_TILES * 16) == 0)


def plan_layers(model: nn.Module, method: str, device_type: str) -> dict[str, str]:
    """Layer name -> the method it runs: ``method``, except the output head under int4 (int8:
    logits are what we sample; w8a8 runs it too, measured within 0.01 nats/token), ``W8A8_KEEP``
    layers under w8a8 (int8) and int4 layers whose shape the device's kernel cannot take (int8)."""
    out = model.get_output_embeddings()
    plan = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            kept = (m is out and method != "w8a8") or (method == "w8a8" and name.rpartition(".")[2] in W8A8_KEEP)
            kind = "int8" if kept else method
            plan[name] = kind if fits(kind, m, device_type) else "int8"
    return plan


def describe_plan(plan: dict[str, str], method: str, device_type: str) -> str:
    """What ran, for the user and --json: '<method> weights (N layers[, M in int8: ...])'."""
    fell_back = sum(1 for kind in plan.values() if kind != method)
    if not fell_back:
        return f"{method} weights ({len(plan)} layers)"
    if method == "w8a8":
        why = " and ".join(f"mlp.{k}" for k in W8A8_KEEP)
    else:
        why = "the output head" + (
            f" and widths the {device_type.upper()} int4 kernel cannot take" if fell_back > 1 else ""
        )
    return f"{method} weights ({len(plan)} layers, {fell_back} in int8: {why})"


# --------------------------------------------------------------------------- the model


def cache_file(weights_key: dict, method: str, device_type: str = "cpu") -> Path:
    """``<method>-<weights>-<everything>.safetensors``: the middle part names the model, so a new
    cache for it (new weights, a new torch) replaces the old one instead of piling up."""
    key = {
        "weights": weights_key,
        "method": method,
        "group": INT4_GROUP if method == "int4" else None,
        "format": FORMAT,
        "torch": torch.__version__.split("+")[0],
    }
    if method == "int4" and device_type == "cuda":  # CUDA's int4 kernel takes fewer widths: another plan
        key["plan"] = "cuda"
    model = hashlib.sha256(json.dumps(weights_key.get("source")).encode()).hexdigest()[:8]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "quantized" / f"{method}-{model}-{digest}.safetensors"


def weights_key(location: str) -> dict:
    """What identifies the weights: each weight file's name, size and modification time (a
    folder), or the cached hub snapshot they come from."""
    folder = Path(location)
    if not folder.is_dir():
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(location, "config.json")
            if isinstance(found, str):
                folder = Path(found).parent  # .../snapshots/<commit>
        except Exception:  # noqa: BLE001 - no hub cache: key by name alone
            return {"source": location}
    files = sorted(p for p in folder.glob("*") if p.suffix in (".safetensors", ".bin", ".json"))
    return {"source": str(folder.resolve()), "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


class QualityGateFailed(Exception):
    """``--quantize auto`` tried w8a8 and it cost more than the tolerance on this model."""

    def __init__(self, delta: float):
        super().__init__(f"w8a8 costs {delta:+.3f} nats/token on this model")
        self.delta = delta


def verdict_path(location: str) -> Path:
    """Where w8a8's measured quality for these weights is kept (mean NLL change, nats/token)."""
    return cache_path(
        {
            "weights": weights_key(location),
            "method": "w8a8",
            "format": FORMAT,
            "torch": torch.__version__.split("+")[0],
        },
        "quality-",
    )


def quality_verdict(location: str) -> float | None:
    """w8a8's measured NLL change on these weights, or None when not measured (or unreadable:
    said in one line, as it is measured again)."""
    path = verdict_path(location)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))["nll_delta"]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    warn(f"the w8a8 quality verdict {path} is unreadable; measuring w8a8's quality again and replacing it")
    return None


@torch.inference_mode()
def mean_nll(model: nn.Module, ids: list[int]) -> float:
    """Teacher-forced mean negative log-likelihood of ``ids`` (nats/token)."""
    return layerwise.nll(model(input_ids=torch.tensor([ids], device=next(model.parameters()).device)).logits, ids)


def quantize_model(
    model: nn.Module,
    method: str,
    location: str,
    report: Callable[[str], None] | None = None,
    device: torch.device | None = None,
    calibration: list[int] | None = None,
    gate: float | None = None,
) -> str:
    """Replace every nn.Linear of ``model`` (lm_head included) by its ``method`` version, from the
    cache when this model was quantized before. The new layers are built on ``device`` (default:
    where the model is): a model loaded on the CPU is quantized there and only the quantized
    weights reach the GPU. Each original layer is released as it is replaced, so the peak is one
    full-precision model, not both; w8a8, which first smooths the model (smooth.py) over the
    ``calibration`` token ids, goes one decoder layer at a time (layerwise.py). With ``gate``
    (``--quantize auto`` trying w8a8 on a model never measured), the mean NLL of that text
    before and after is compared, kept (``quality_verdict``) and QualityGateFailed raised past
    ``gate`` nats/token. Returns a description of what ran."""
    param = next(model.parameters())
    dtype, device = param.dtype, device or param.device
    plan = plan_layers(model, method, device.type)
    path = cache_file(weights_key(location), method, device.type)
    remove_stale_temp_files(path.parent)
    found = smooth.groups(model) if method == "w8a8" else []
    extra = {g.key: (model.get_submodule(g.readers[0]).in_features,) for g in found}
    specs = _cache_specs(model, plan, extra)
    cached = _open_cache(path, {k: shape for k, (_, shape) in specs.items()})
    fresh = CacheWriter(path, specs) if cached is None else None  # written tensor by tensor, never all held
    if cached is None:
        cached = {}
        if report is not None:
            report(f"quantizing {len(plan)} layers to {method} (once; cached for the next start)")
    gate = gate if calibration else None
    known = {g.key: cached[g.key] for g in found} if fresh is None else None
    ids = calibration or [i % model.get_input_embeddings().num_embeddings for i in range(1, 257)]

    def replace(names: list[str]) -> None:
        _replace_layers(model, {n: plan[n] for n in names}, cached, fresh, dtype, device)

    try:
        factors, before, after = _smooth_and_replace(model, plan, found, ids, known, gate is not None, replace)
        if fresh is not None:
            for k in extra:
                fresh.add(k, factors[k])
            fresh.finish()
            _remove_stale(path)
    except BaseException:  # Ctrl-C, SIGTERM (raised as KeyboardInterrupt), an error: no partial file left
        if fresh is not None:
            fresh.abort()
        raise
    trim_heap()
    text = describe_plan(plan, method, device.type)
    if before is not None:
        delta = after - before
        try:
            verdict_path(location).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(verdict_path(location), json.dumps({"nll_delta": delta, "tokens": len(calibration)}))
        except OSError:
            pass  # measured again next time
        if delta > gate:
            raise QualityGateFailed(delta)
        text += f"; {delta:+.3f} nats/token on the calibration text"
    if report is not None and any(kind != method for kind in plan.values()):
        report(text)  # said once: what ran is not all the method asked
    return text


def _smooth_and_replace(
    model: nn.Module,
    plan: dict[str, str],
    found: list[smooth.Group],
    ids: list[int],
    known: dict[str, torch.Tensor] | None,
    gate: bool,
    replace: Callable[[list[str]], None],
) -> tuple[dict[str, torch.Tensor], float | None, float | None]:
    """Smooth the ``found`` groups (by ``known`` factors, or measured on ``ids`` and cached) and
    quantize every planned layer: one decoder layer at a time where the model's layers allow
    (layerwise.py), else over whole-model forwards. Returns (factors, the gate's NLL before and
    after)."""
    layers = layerwise.decoder_layers(model, found)
    if layers is not None:
        factors, before, after = layerwise.quantize(model, layers, found, ids, list(plan), replace, known, gate)
    else:
        before = mean_nll(model, ids) if gate else None
        factors = known if known is not None else smooth.factors(model, found, ids) if found else {}
        smooth.apply(model, found, factors, readers_too=known is None)
        replace(list(plan))
        after = mean_nll(model, ids) if gate else None
    return factors, before, after


def _quantized_layer(
    lin: nn.Linear,
    name: str,
    kind: str,
    cached: CacheReader | dict,
    fresh: CacheWriter | None,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """One layer's quantized replacement on ``device``, from ``cached`` tensors or computed (and
    written to ``fresh``). Which layers fall back to int8 depends on the device, so int4 caches
    are kept per device type (``cache_file``)."""
    bias = lin.bias.detach() if lin.bias is not None else None
    if kind in ("int8", "w8a8"):
        q, scales = _int8_weights(lin, name, cached, fresh)
        if kind == "w8a8":
            return Int8DynamicLinear(q, scales, bias, dtype)
        return Int8Linear(q.to(device), scales.to(device), None if bias is None else bias.to(device), dtype)
    if f"{name}.mins" in cached:
        packed, scales, mins = cached[f"{name}.q"], cached[f"{name}.scales"], cached[f"{name}.mins"]
        q = torch.stack([packed >> 4, packed & 15], -1).reshape(packed.shape[0], -1)
    else:
        q, scales, mins = quantize_int4(lin.weight.detach())
        fresh.add(f"{name}.q", q[:, ::2] << 4 | q[:, 1::2])
        fresh.add(f"{name}.scales", scales)
        fresh.add(f"{name}.mins", mins)
    return Int4Linear(q, scales, mins, bias, dtype, device)


def _int8_weights(
    lin: nn.Linear, name: str, cached: CacheReader | dict, fresh: CacheWriter | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's int8 weight and per-channel scales, from the cache or quantized (and cached)."""
    if f"{name}.q" in cached:
        return cached[f"{name}.q"], cached[f"{name}.scales"]
    q, scales = quantize_int8(lin.weight.detach())
    fresh.add(f"{name}.q", q)
    fresh.add(f"{name}.scales", scales)
    return q, scales


def expected_shapes(lin: nn.Linear, name: str, kind: str) -> dict[str, tuple[int, ...]]:
    """The cached tensors of one layer and their shapes."""
    n, k = lin.weight.shape
    if kind in ("int8", "w8a8"):
        return {f"{name}.q": (n, k), f"{name}.scales": (n,)}
    g = k // INT4_GROUP
    return {f"{name}.q": (n, k // 2), f"{name}.scales": (n, g), f"{name}.mins": (n, g)}


def _replace_layers(
    model: nn.Module,
    plan: dict[str, str],
    cached: CacheReader | dict,
    fresh: CacheWriter | None,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Each planned layer replaced by its quantized version, its old weight's memory released.
    Under w8a8, an attention's q/k/v and an MLP's gate/up become one stacked matmul each
    (``SharedInput``), packed once from their int8 tensors."""
    mapped = file_mappings()
    stacks = input_stacks(model, {n for n, kind in plan.items() if kind == "w8a8"})
    stacked = {n for names in stacks for n in names}
    groups = [(n,) for n in plan if n not in stacked] + stacks
    for i, names in enumerate(groups):
        olds = [model.get_submodule(n) for n in names]
        if len(names) == 1:
            new = [_quantized_layer(olds[0], names[0], plan[names[0]], cached, fresh, dtype, device)]
        else:
            shared = SharedInput([(*_int8_weights(old, n, cached, fresh), old.bias) for n, old in zip(names, olds)])
            new = [SharedInputSlice(shared, j) for j in range(len(names))]
        for name, old, layer in zip(names, olds, new):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, layer)  # the original is freed here
            release_pages(old.weight, mapped)
        del olds, old  # nothing holds the originals now
        if i % 16 == 15 or i == len(groups) - 1:
            trim_heap()


def _cache_specs(
    model: nn.Module, plan: dict[str, str], extra: dict[str, tuple[int, ...]]
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every cached tensor's dtype and shape, known before quantizing (the cache's header)."""
    specs = {k: (torch.float32, shape) for k, shape in extra.items()}
    for name, kind in plan.items():
        specs.update(
            {
                k: (
                    torch.uint8
                    if kind == "int4" and k.endswith(".q")
                    else torch.int8
                    if k.endswith(".q")
                    else torch.float32,
                    shape,
                )
                for k, shape in expected_shapes(model.get_submodule(name), name, kind).items()
            }
        )
    return specs


def _open_cache(path: Path, want: dict[str, tuple[int, ...]]) -> CacheReader | None:
    """The cache, if the file is whole: every wanted tensor in its shape and the checksum right.
    Otherwise None (the model is quantized again and the file replaced), said in one line that
    stays on stderr (a start that takes minutes longer than the last one says why)."""
    if not path.is_file():
        return None
    try:
        return CacheReader(path, want)
    except Exception as err:  # noqa: BLE001 - any damage (truncated, not safetensors) means quantize again
        problem = str(err) if isinstance(err, ValueError) and str(err) else f"it cannot be read ({type(err).__name__})"
    warn(f"the quantized cache {path} is damaged ({problem}); quantizing again (once) and replacing it")
    return None


def remove_stale_temp_files(folder: Path) -> None:
    """Temp files of cache writers that died mid-write (killed, a full disk): named
    ``.<cache>.<pid>.<random>.tmp``; removed when that pid is no longer running."""
    for tmp in folder.glob(".*.tmp") if folder.is_dir() else ():
        parts = tmp.name.split(".")
        pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else None
        if pid is None or _alive(pid):
            continue
        tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _remove_stale(path: Path) -> None:
    """Caches of the same model and method under other keys (older weights or format)."""
    method, model, _ = path.name.split("-", 2)
    for stale in path.parent.glob(f"{method}-{model}-*.safetensors"):
        if stale != path and stale.is_file() and not stale.is_symlink():  # (only files this code wrote)
            stale.unlink(missing_ok=True)
