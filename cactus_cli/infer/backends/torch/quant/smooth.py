"""SmoothQuant (Xiao et al., 2023) for w8a8: some input channels of a Linear layer carry
activations 10-100x the others (after an RMSNorm in Qwen and Llama models), and one int8 scale per
row cannot hold both. So each such channel j is divided by s_j where the activation is made and
multiplied by s_j in the weights that read it, which leaves the model's function unchanged:

- the attention and MLP inputs: the RMSNorm's weight (gamma_j / s_j) and the q/k/v or gate/up
  weights' column j (* s_j);
- ``mlp.down_proj``'s input, silu(gate) * up: up_proj's row j (/ s_j) and down_proj's column j.

s_j = max|x_j|^ALPHA / max|w_j|^(1 - ALPHA), from one forward over ``CALIBRATION_TEXT`` (core/defaults.py: prose and
code; a few hundred tokens, seconds). The factors are cached with the quantized weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

ALPHA = 0.5  # how much of the activations' range moves into the weights (the paper's default)


@dataclass(frozen=True)
class Group:
    """Linear layers that read one activation, and where that activation is made."""

    owner: str  # an RMSNorm (its weight scales channel j) or a Linear (its output row j)
    readers: tuple[str, ...]  # the Linear layers whose column j reads channel j

    @property
    def key(self) -> str:
        return f"{self.readers[0]}.smooth"


def groups(model: nn.Module) -> list[Group]:
    """Every decoder layer's (input norm -> q, k, v), (post-attention norm -> gate, up) and
    (up -> down), where the layer has those parts and its norms scale by their weight."""
    out = []
    for name, m in model.named_modules():
        attn, mlp = getattr(m, "self_attn", None), getattr(m, "mlp", None)
        norm_in, norm_post = getattr(m, "input_layernorm", None), getattr(m, "post_attention_layernorm", None)
        if (
            attn is not None
            and _scales_by_weight(norm_in)
            and all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj"))
        ):
            out.append(
                Group(f"{name}.input_layernorm", tuple(f"{name}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")))
            )
        if mlp is not None and all(
            isinstance(getattr(mlp, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")
        ):
            if _scales_by_weight(norm_post):
                out.append(Group(f"{name}.post_attention_layernorm", (f"{name}.mlp.gate_proj", f"{name}.mlp.up_proj")))
            if mlp.up_proj.bias is None:
                out.append(Group(f"{name}.mlp.up_proj", (f"{name}.mlp.down_proj",)))
    return out


@torch.inference_mode()
def _scales_by_weight(norm: nn.Module | None) -> bool:
    """Whether ``norm(x)`` is linear in its weight (y = weight * f(x)), checked on a probe: then
    dividing the weight by s divides the output by s (not so for Gemma's (1 + weight))."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return False
    x = torch.randn(2, w.numel(), generator=torch.Generator().manual_seed(0)).to(w.dtype)
    y1 = norm(x).float()
    saved = w.detach().clone()
    w.mul_(2)
    try:
        y2 = norm(x).float()
    finally:
        w.copy_(saved)
    return bool(torch.allclose(y2, 2 * y1, rtol=1e-2, atol=1e-3))


@contextmanager
def recording(model: nn.Module, found: list[Group]) -> Iterator[dict[str, torch.Tensor]]:
    """While open, every forward through the groups' layers raises the recorded largest
    activation per channel (group key -> [channels] float32)."""
    maxima: dict[str, torch.Tensor] = {}
    hooks = []
    for g in found:

        def hook(module, args, key=g.key):  # noqa: ARG001
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
            maxima[key] = torch.maximum(maxima[key], x) if key in maxima else x

        hooks.append(model.get_submodule(g.readers[0]).register_forward_pre_hook(hook))
    try:
        yield maxima
    finally:
        for h in hooks:
            h.remove()


@torch.inference_mode()
def scales(
    model: nn.Module, found: list[Group], maxima: dict[str, torch.Tensor], alpha: float = ALPHA
) -> dict[str, torch.Tensor]:
    """s per group, from its largest activations and the largest weight per column of the
    layers that read it."""
    out = {}
    for g in found:
        w = torch.stack([model.get_submodule(r).weight.detach().abs().amax(0).float() for r in g.readers]).amax(0)
        s = maxima[g.key].clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)
        out[g.key] = s.clamp(min=1e-5).cpu()
    return out


@torch.inference_mode()
def factors(model: nn.Module, found: list[Group], ids: list[int], alpha: float = ALPHA) -> dict[str, torch.Tensor]:
    """s per group over one forward of the whole model on ``ids`` (layerwise.py gets the same
    one decoder layer at a time, holding less of the model in memory)."""
    with recording(model, found) as maxima:
        model(input_ids=torch.tensor([ids], device=next(model.parameters()).device))
    return scales(model, found, maxima, alpha)


@torch.inference_mode()
def apply(model: nn.Module, found: list[Group], s: dict[str, torch.Tensor], readers_too: bool = True) -> None:
    """Move the factors in: the owner's channel j / s_j; with ``readers_too``, each reader's column
    j * s_j (a cached model's readers come quantized with it already)."""
    for g in found:
        owner, sj = model.get_submodule(g.owner), s[g.key]
        if isinstance(owner, nn.Linear):
            owner.weight.copy_((owner.weight.float() / sj.to(owner.weight.device)[:, None]).to(owner.weight.dtype))
        else:
            owner.weight.copy_((owner.weight.float() / sj.to(owner.weight.device)).to(owner.weight.dtype))
        if readers_too:
            for r in g.readers:
                lin = model.get_submodule(r)
                lin.weight.copy_((lin.weight.float() * sj.to(lin.weight.device)[None, :]).to(lin.weight.dtype))
