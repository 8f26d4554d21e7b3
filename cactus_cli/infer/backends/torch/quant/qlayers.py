"""The quantized Linear layers and their arithmetic: int8 weight-only (``Int8Linear``), int4
(``Int4Linear``) and int8 x int8 (``Int8DynamicLinear``, w8a8); quantize.py plans, caches and
installs them (its docstring says which kernel runs where, and why)."""

from __future__ import annotations

import itertools
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 32  # input channels per int4 scale/zero: 32 keeps the embedded verifier within 0.03 nats
INT4_TILES = 8  # inner k tiles of the CUDA int4 packing
CHUNK = 1 << 22  # elements quantized at a time (16 MB of float32)


# --------------------------------------------------------------------------- the arithmetic


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (q int8 [N, K], scales float32 [N]) with w ~= q * scales[:, None]. Computed
    ``CHUNK`` elements at a time (rows are independent): done whole, the float32 copies of an
    output head (151936 x 1536) took 2.6 GB for a moment, the peak of a first start."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    scales = torch.empty(n, dtype=torch.float32, device=w.device)
    rows = max(1, CHUNK // max(k, 1))
    for i in range(0, n, rows):
        c = w[i : i + rows].to(torch.float32, copy=True)  # (a copy even of float32: changed in place below)
        s = (c.abs().amax(1) / 127).clamp(min=1e-10)
        q[i : i + rows] = c.div_(s[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        scales[i : i + rows] = s
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


_W8A8_LAYERS: weakref.WeakValueDictionary[int, Int8DynamicLinear] = weakref.WeakValueDictionary()
_W8A8_KEYS = itertools.count()


@torch.library.custom_op("cactus::w8a8_linear", mutates_args=())
def w8a8_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """fbgemm's dynamic linear with layer ``key``'s packed weight, as one opaque op for compiled
    graphs (torch.compile cannot trace the packed weight itself; eager calls fbgemm directly)."""
    return torch.ops.quantized.linear_dynamic(x, _W8A8_LAYERS[key]._packed, True)


@w8a8_linear.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class Int8DynamicLinear(nn.Module):
    """int8 weights x int8 activations, quantized per row at each call, on fbgemm's dynamic linear
    (CPU). fbgemm picks one activation scale per call, from the whole input: a row's result would
    then depend on the other rows of the call, so a token verified among k drafts would not get
    the logits it gets alone, and greedy speculation would drift from plain decoding. So each row
    is divided by its own largest magnitude first and multiplied back after (the matmul is linear),
    and a pinned row (+1, -1) fixes the call's range at [-1, 1]: every row is quantized with its
    own scale, whatever else is in the call (per-token quantization, one extra row of work).
    Activations come in and go out in the model's dtype; the kernel reads float32."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        with warnings.catch_warnings():  # torch 2.13 marks the quantized tensor types deprecated; the ops are not
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(
                q.contiguous(), scales.double(), torch.zeros(q.shape[0], dtype=torch.long), 0
            )
            self._packed = torch.ops.quantized.linear_prepack(qw, None)
        pin = torch.zeros(1, self.in_features)
        pin[0, 0], pin[0, -1] = 1.0, -1.0
        self.register_buffer("pin", pin)
        # the packed weight (int8, float32 scale per channel) is no buffer: weight_bytes counts it from here
        self.packed_bytes = q.numel() + 4 * q.shape[0]
        self.register_buffer("bias", None if bias is None else bias.float())
        self.key = next(_W8A8_KEYS)
        _W8A8_LAYERS[self.key] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        m = x2.abs().amax(1, keepdim=True).clamp_(min=1e-30)  # [M, 1]
        rows = torch.cat([x2 / m, self.pin])
        if torch.compiler.is_compiling():
            out = w8a8_linear(rows, self.key, self.out_features)
        else:
            out = torch.ops.quantized.linear_dynamic(rows, self._packed, True)
        out = out[:-1] * m
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)


class SharedInput:
    """One int8 x int8 matmul for Linear layers that read the same activation (an attention's q, k
    and v; an MLP's gate and up): their weights stacked into one ``Int8DynamicLinear``, whose
    output each layer takes its slice of. Fewer, wider calls: per token 113 fbgemm calls instead of
    197 on a 28-layer Qwen (each call also quantizes its input and scales its rows), ~10% of a
    w8a8 forward. Bit for bit what the separate layers give: the rows are quantized alike (the
    same input, the same per-row scale) and each output channel has its own weight scale and an
    exact int32 sum. The first slice asked for an input computes all of them; the others take
    theirs while the input is the same tensor (identity checked, and its version outside inference
    mode: any call order and any other input stay correct, only slower; no model modifies a
    projection's input in place between its readers)."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]):
        """``parts``: each layer's (int8 weight [N, K], scales [N], bias [N] or None), packed once."""
        qs, scales, biases = zip(*parts)
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([torch.zeros(q.shape[0]) if b is None else b.detach().float() for q, b in zip(qs, biases)])
        self.layer = Int8DynamicLinear(torch.cat(qs), torch.cat(scales), bias, torch.float32)
        self.sizes = [q.shape[0] for q in qs]
        self._input: tuple[torch.Tensor, int | None] | None = None
        self._outputs: list[torch.Tensor | None] = []

    def take(self, x: torch.Tensor, i: int) -> torch.Tensor:
        # inference tensors keep no version, and compiled graphs are traced once (identity only)
        version = None if torch.compiler.is_compiling() or x.is_inference() else x._version
        if self._input is None or self._input[0] is not x or self._input[1] != version or self._outputs[i] is None:
            self._outputs = list(self.layer(x).split(self.sizes, -1))
            self._input = (x, version)
        out, self._outputs[i] = self._outputs[i], None
        if all(o is None for o in self._outputs):
            self._input, self._outputs = None, []  # all taken: nothing held between calls
        return out


class SharedInputSlice(nn.Module):
    """One of a ``SharedInput``'s layers (replaces it in the model). The first slice holds the
    stacked layer as its submodule, so the model's modules list its weights once."""

    def __init__(self, shared: SharedInput, index: int):
        super().__init__()
        self.in_features, self.out_features = shared.layer.in_features, shared.sizes[index]
        self.index = index
        self.__dict__["shared"] = shared  # not a submodule (see the class docstring)
        if index == 0:
            self.stacked = shared.layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.take(x, self.index)


def input_stacks(model: nn.Module, names: set[str]) -> list[tuple[str, ...]]:
    """Every attention's q/k/v and every MLP's gate/up whose layers are all in ``names`` and read
    the same width: the layers a ``SharedInput`` stacks."""
    stacks = []
    for prefix, m in model.named_modules():
        for part, members in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            parent = getattr(m, part, None)
            full = tuple(f"{prefix}.{part}.{n}" if prefix else f"{part}.{n}" for n in members)
            if parent is None or not all(n in names for n in full):
                continue
            if len({getattr(parent, n).in_features for n in members}) == 1:
                stacks.append(full)
    return stacks


def w8a8_problem(device: torch.device) -> str | None:
    """Why w8a8 cannot run here (None: it can)."""
    if device.type != "cpu":
        return f"--quantize w8a8 runs on a CPU (fbgemm); on {device.type} use --quantize int8"
    engines = torch.backends.quantized.supported_engines
    if not any(e in engines for e in ("fbgemm", "x86")):
        return f"--quantize w8a8 needs fbgemm (x86); this torch has {', '.join(engines)}; use --quantize int8"
    return None


class Int4Linear(nn.Module):
    def __init__(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.group = q.shape[1] // scales.shape[1]
        # the kernels compute w = (q - 8) * scale + zero per group, so zero = min + 8 * scale;
        # scales_and_zeros is [K/group, N, 2]
        zeros = mins + 8 * scales
        self.register_buffer(
            "scales_and_zeros",
            torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(device=device, dtype=dtype),
        )
        q32 = q.to(device=device, dtype=torch.int32)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, INT4_TILES)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack(
                (q32[:, ::2] << 4 | q32[:, 1::2]).to(torch.uint8), INT4_TILES
            )
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
