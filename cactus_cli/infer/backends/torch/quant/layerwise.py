"""A first w8a8 start, one decoder layer at a time: the calibration forward (smooth.py), the
smoothing, the quantization and the quality gate's two NLLs, each layer finished before the next
is read. Run on the whole model, the calibration and the gate's "before" forward touched every
full-precision weight while none was yet replaced, so the whole bfloat16 model was resident at
once (the peak of a first start, above 1.3x the quantized model's steady size); here only one
layer's weights are, beside what is already quantized.

How: the model runs once with every decoder layer replaced by a relay that records how the model
calls it (the hidden states, the mask and rotary tables of its kind) and passes nothing on. Then
each real layer runs on the recorded call: its activations give its smoothing factors, then it is
smoothed and quantized, and with the gate the quantized layer runs too, on the quantized path's
hidden states. The model's tail (final norm, output head, any soft-capping) runs through the same
relays, the last one handing back the final hidden states. The numbers are those of the
whole-model forwards (tests/test_quantize.py checks it).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cactus_cli.infer.backends.torch.quant import smooth


class _Stop(Exception):
    """Raised by the last relay of the recording pass: nothing after the layers is needed."""


class _Relay(nn.Module):
    """Stands in for a decoder layer: records (hidden states, args, kwargs) and passes its input
    on, or ``final`` when given; the last one of a recording pass stops the forward."""

    def __init__(self, calls: list, final: torch.Tensor | None = None, stop: bool = False):
        super().__init__()
        self.calls, self.final, self.stop = calls, final, stop

    def forward(self, hidden_states, *args, **kwargs):
        self.calls.append((hidden_states, args, kwargs))
        if self.stop:
            raise _Stop
        return hidden_states if self.final is None else self.final


def decoder_layers(model: nn.Module, found: list[smooth.Group]) -> tuple[str, nn.ModuleList] | None:
    """The decoder layers' list (the longest ModuleList) when every smoothing group lies inside
    one of its layers; None otherwise, or when there is no group to place them by (then the
    whole-model path runs: the longest list might be a mixture's experts)."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) and n]
    if not lists or not found:
        return None
    name, layers = max(lists, key=lambda nm: len(nm[1]))
    inside = all(any(g.owner.startswith(f"{name}.{i}.") for i in range(len(layers))) for g in found)
    return (name, layers) if inside else None


@torch.inference_mode()
def _relayed(model: nn.Module, layers: nn.ModuleList, ids: list[int], final: torch.Tensor | None = None):
    """The layers' calls (``final`` None), or the logits of the model whose last layer outputs
    ``final``. The real layers are back in place however it ends."""
    real, calls = list(layers), []
    for i in range(len(layers)):
        last = i == len(layers) - 1
        layers[i] = _Relay(calls, final if last else None, stop=last and final is None)
    try:
        x = torch.tensor([ids], device=next(model.parameters()).device)
        logits = model(input_ids=x, use_cache=False).logits  # (no cache: each layer is run twice)
    except _Stop:
        logits = None
    finally:
        for i, layer in enumerate(real):
            layers[i] = layer
    return calls if final is None else logits


def _hidden(out):
    return out[0] if isinstance(out, tuple) else out


def nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Teacher-forced mean negative log-likelihood of ``ids`` from their logits [1, L, V] (nats/token)."""
    target = torch.tensor(ids[1:], device=logits.device)
    return float(F.cross_entropy(logits[0, :-1].float(), target))


@torch.inference_mode()
def quantize(
    model: nn.Module,
    layers: tuple[str, nn.ModuleList],
    found: list[smooth.Group],
    ids: list[int],
    plan: list[str],
    replace: Callable[[list[str]], None],
    known: dict[str, torch.Tensor] | None = None,
    gate: bool = False,
) -> tuple[dict[str, torch.Tensor], float | None, float | None]:
    """Smooth (by ``known`` factors, their readers already quantized in the cache, or by factors
    measured here on ``ids``) and quantize (``replace`` the ``plan`` layers) one decoder layer at
    a time, then the rest. Returns (factors, NLL before, NLL after): the two mean NLLs of ``ids``
    (nats/token) with ``gate``, else None."""
    prefix, stack = layers
    calls = _relayed(model, stack, ids)
    h = hq = calls[0][0]
    factors, done = {}, set()
    for i, layer in enumerate(stack):
        mine = [g for g in found if g.owner.startswith(f"{prefix}.{i}.")]
        _, args, kwargs = calls[i]
        with smooth.recording(model, mine if known is None else []) as maxima:
            out = _hidden(layer(h, *args, **kwargs))  # the model as loaded
        s = {g.key: known[g.key] for g in mine} if known is not None else smooth.scales(model, mine, maxima)
        smooth.apply(model, mine, s, readers_too=known is None)
        factors.update(s)
        names = [n for n in plan if n.startswith(f"{prefix}.{i}.")]
        replace(names)
        done.update(names)
        if gate:
            hq = _hidden(layer(hq, *args, **kwargs))  # the model as quantized
        h = out
    before = nll(_relayed(model, stack, ids, final=h), ids) if gate else None
    replace([n for n in plan if n not in done])  # the output head and anything outside the layers
    after = nll(_relayed(model, stack, ids, final=hq), ids) if gate else None
    return factors, before, after
