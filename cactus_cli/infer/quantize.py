"""Weight-only quantization of every Linear layer (lm_head included), with torch's own packed
kernels, the way gpt-fast does it:

- ``int8``: symmetric, one scale per output channel. CPU: ``aten._weight_int8pack_mm``;
  elsewhere ``F.linear(x, w.to(x.dtype)) * scales``, which torch.compile fuses (CUDA).
- ``int4``: asymmetric, one scale and zero per group of ``INT4_GROUP`` input channels.
  CPU: ``aten._weight_int4pack_mm_for_cpu``; CUDA: ``aten._weight_int4pack_mm`` (tinygemm).

Activations stay in the model's dtype (bfloat16: the packed CPU kernels are fast only there).
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
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cactus_cli.core.paths import cache_dir

METHODS = ("none", "int8", "int4")
INT4_GROUP = 32  # input channels per int4 scale/zero: 32 keeps the embedded verifier within 0.03 nats
INT4_TILES = 8  # inner k tiles of the CUDA int4 packing
FORMAT = 3  # bump when what is cached changes (2: int4 keeps the head in int8; 3: a checksum)


# --------------------------------------------------------------------------- the arithmetic


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (q int8 [N, K], scales float32 [N]) with w ~= q * scales[:, None]."""
    w = w.float()
    scales = (w.abs().amax(1) / 127).clamp(min=1e-10)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales[:, None]


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (q in 0..15 as uint8 [N, K], scales [N, K/group], mins [N, K/group]) with
    w ~= q * scale + min per group (asymmetric: the group's range maps onto 16 levels)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-10)
    q = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scales, lo


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    g = q.float().reshape(n, scales.shape[1], -1)
    return (g * scales[..., None] + mins[..., None]).reshape(n, k)


# --------------------------------------------------------------------------- the layers


class Int8Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.device.type == "cpu":
            out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight, self.scales)
        else:
            out = F.linear(x2, self.weight.to(x2.dtype)) * self.scales
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.group = q.shape[1] // scales.shape[1]
        # the kernels compute w = (q - 8) * scale + zero per group, so zero = min + 8 * scale;
        # scales_and_zeros is [K/group, N, 2]
        zeros = mins + 8 * scales
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()
                             .to(device=device, dtype=dtype))
        q32 = q.to(device=device, dtype=torch.int32)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, INT4_TILES)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack((q32[:, ::2] << 4 | q32[:, 1::2]).to(torch.uint8),
                                                                INT4_TILES)
        self.register_buffer("weight", packed)
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if x2.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, self.group, self.scales_and_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm(x2, self.weight, self.group, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


def fits(method: str, linear: nn.Linear, device_type: str = "cpu") -> bool:
    """Whether the packed kernel takes this layer's [N, K] shape. int8: any. int4: whole groups
    and N % 8 on a CPU; CUDA's packing also needs K % (INT4_TILES * 16) = K % 128, so hidden
    sizes such as 576 or 960 do not fit there."""
    n, k = linear.weight.shape
    if method == "int8":
        return True
    return k % INT4_GROUP == 0 and n % 8 == 0 and (device_type != "cuda" or k % (INT4_TILES * 16) == 0)


def plan_layers(model: nn.Module, method: str, device_type: str) -> dict[str, str]:
    """Layer name -> the method it runs: ``method``, except the output head (int8 under int4:
    logits are what we sample) and int4 layers whose shape the device's kernel cannot take
    (int8 instead)."""
    out = model.get_output_embeddings()
    plan = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            kind = "int8" if m is out else method
            plan[name] = kind if fits(kind, m, device_type) else "int8"
    return plan


def describe_plan(plan: dict[str, str], method: str, device_type: str) -> str:
    """What ran, for the user and --json: '<method> weights (N layers[, M in int8: ...])'."""
    fell_back = sum(1 for kind in plan.values() if kind != method)
    if not fell_back:
        return f"{method} weights ({len(plan)} layers)"
    why = "the output head" + (f" and widths the {device_type.upper()} int4 kernel cannot take" if fell_back > 1 else "")
    return f"{method} weights ({len(plan)} layers, {fell_back} in int8: {why})"


# --------------------------------------------------------------------------- the model


def cache_file(weights_key: dict, method: str, device_type: str = "cpu") -> Path:
    """``<method>-<weights>-<everything>.safetensors``: the middle part names the model, so a new
    cache for it (new weights, a new torch) replaces the old one instead of piling up."""
    key = {"weights": weights_key, "method": method, "group": INT4_GROUP if method == "int4" else None,
           "format": FORMAT, "torch": torch.__version__.split("+")[0]}
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


def quantize_model(model: nn.Module, method: str, location: str, report: Callable[[str], None] | None = None,
                   device: torch.device | None = None) -> str:
    """Replace every nn.Linear of ``model`` (lm_head included) by its ``method`` version, from the
    cache when this model was quantized before. The new layers are built on ``device`` (default:
    where the model is): a model loaded on the CPU is quantized there and only the quantized
    weights reach the GPU. Each original layer is released as it is replaced, so the peak is one
    full-precision model, not both. Returns a description of what ran, for the user."""
    from safetensors.torch import save_file

    param = next(model.parameters())
    dtype, device = param.dtype, device or param.device
    plan = plan_layers(model, method, device.type)
    path = cache_file(weights_key(location), method, device.type)
    remove_stale_temp_files(path.parent)
    cached = _load_cache(path, model, plan, report)
    fresh: dict[str, torch.Tensor] = {}
    if report is not None and not cached:
        report(f"quantizing {len(plan)} layers to {method} (once; cached for the next start)")
    for name, kind in plan.items():
        new = _quantized_layer(model.get_submodule(name), name, kind, cached, fresh, dtype, device)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)  # the original is freed here
    if fresh:
        _save(path, {**cached, **fresh}, save_file)
    text = describe_plan(plan, method, device.type)
    if report is not None and any(kind != method for kind in plan.values()):
        report(text)  # said once: what ran is not all the method asked
    return text


def _quantized_layer(lin: nn.Linear, name: str, kind: str, cached: dict[str, torch.Tensor],
                     fresh: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> nn.Module:
    """One layer's quantized replacement on ``device``, from ``cached`` tensors or computed (and
    added to ``fresh``). Which layers fall back to int8 depends on the device, so int4 caches
    are kept per device type (``cache_file``)."""
    bias = lin.bias.detach() if lin.bias is not None else None
    if kind == "int8":
        if f"{name}.q" in cached:
            q, scales = cached[f"{name}.q"], cached[f"{name}.scales"]
        else:
            q, scales = quantize_int8(lin.weight.detach())
            fresh.update({f"{name}.q": q.cpu(), f"{name}.scales": scales.cpu()})
        return Int8Linear(q.to(device), scales.to(device), None if bias is None else bias.to(device), dtype)
    if f"{name}.mins" in cached:
        packed, scales, mins = cached[f"{name}.q"], cached[f"{name}.scales"], cached[f"{name}.mins"]
        q = torch.stack([packed >> 4, packed & 15], -1).reshape(packed.shape[0], -1)
    else:
        q, scales, mins = quantize_int4(lin.weight.detach())
        fresh.update({f"{name}.q": (q[:, ::2] << 4 | q[:, 1::2]).cpu(), f"{name}.scales": scales.cpu(),
                      f"{name}.mins": mins.cpu()})
    return Int4Linear(q, scales, mins, bias, dtype, device)


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, shape, dtype and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def expected_shapes(lin: nn.Linear, name: str, kind: str) -> dict[str, tuple[int, ...]]:
    """The cached tensors of one layer and their shapes."""
    n, k = lin.weight.shape
    if kind == "int8":
        return {f"{name}.q": (n, k), f"{name}.scales": (n,)}
    g = k // INT4_GROUP
    return {f"{name}.q": (n, k // 2), f"{name}.scales": (n, g), f"{name}.mins": (n, g)}


def _load_cache(path: Path, model: nn.Module, plan: dict[str, str], report: Callable[[str], None] | None
                ) -> dict[str, torch.Tensor]:
    """The cached tensors, if the file is whole: its checksum matches and every layer of the
    plan has its tensors in their shapes. Otherwise nothing (the model is quantized again and
    the file replaced), said in one line."""
    from safetensors import safe_open

    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = (f.metadata() or {}).get("sha256")
            # copies, not views of a memory map: a cache file replaced or truncated while this
            # process runs must not pull the weights from under it
            cached = {k: f.get_tensor(k).clone() for k in f.keys()}
        want = {}
        for name, kind in plan.items():
            want.update(expected_shapes(model.get_submodule(name), name, kind))
        wrong = next((k for k, shape in want.items() if k not in cached or tuple(cached[k].shape) != shape), None)
        if wrong is not None:
            problem = f"{wrong} is {'missing' if wrong not in cached else 'the wrong shape'}"
        elif stored != checksum(cached):
            problem = "its checksum does not match"
        else:
            return cached
    except Exception as err:  # noqa: BLE001 - any damage (truncated, not safetensors) means quantize again
        problem = f"it cannot be read ({type(err).__name__})"
    if report is not None:
        report(f"the quantized cache {path.name} is damaged ({problem}); quantizing again")
    return {}


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


def _save(path: Path, tensors: dict[str, torch.Tensor], save_file) -> None:
    """Atomically (a crash leaves no half-written cache), with a checksum; any failure (a full
    disk raises safetensors' own error, not an OSError) only costs the next start."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, tmp, metadata={"sha256": checksum(tensors)})
        os.replace(tmp, path)
        method, model, _ = path.name.split("-", 2)
        for stale in path.parent.glob(f"{method}-{model}-*.safetensors"):
            if stale != path:
                stale.unlink(missing_ok=True)
    except Exception:  # noqa: BLE001 - not cached: the next start quantizes again
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers (what a forward reads, roughly)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
