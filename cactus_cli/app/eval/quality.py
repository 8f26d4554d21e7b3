"""What quantization costs in quality, measured: the verifier's mean negative log-likelihood per
token of a fixed text set (teacher-forced), and how often its greedy choice agrees with the
unquantized model's at the same positions. Behind `cactus models quality`."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cactus_cli.core import defaults
from cactus_cli.infer.backends.torch.quant.memory import weight_bytes

NLL_TOLERANCE = defaults.QUALITY_TOLERANCE  # nats per token: what the default quantization may cost


@dataclass
class Quality:
    method: str
    dtype: str
    tokens: int = 0
    nll_sum: float = 0.0
    agree: int = 0
    weight_bytes: int = 0
    seconds: float = 0.0
    argmax: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else math.nan

    def row(self, reference: Quality) -> dict[str, Any]:
        return {
            "quantize": self.method,
            "dtype": self.dtype,
            "tokens": self.tokens,
            "mean_nll": self.mean_nll,
            "nll_vs_reference": self.mean_nll - reference.mean_nll,
            "greedy_agreement": self.agree / self.tokens if self.tokens else None,
            "weight_gb": self.weight_bytes / 1e9,
            "seconds": self.seconds,
            "within_tolerance": self.mean_nll - reference.mean_nll <= NLL_TOLERANCE,
        }


@torch.inference_mode()
def measure(
    model,
    texts: list[list[int]],
    method: str,
    dtype: str,
    reference: Quality | None,
    on_text: Callable[[], None] | None = None,
) -> Quality:
    """Teacher-forced NLL of every text (all tokens after the first) and greedy agreement with
    ``reference``'s argmax at the same positions."""

    q = Quality(method, dtype, weight_bytes=weight_bytes(model))
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    for i, ids in enumerate(texts):
        x = torch.tensor([ids], device=device)
        logits = model(input_ids=x).logits[0, :-1].float()  # [L-1, V]
        target = x[0, 1:]
        q.nll_sum += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        q.tokens += int(target.numel())
        top = logits.argmax(-1).cpu()
        q.argmax.append(top)
        if reference is not None:
            q.agree += int((top == reference.argmax[i]).sum())
        else:
            q.agree += int(top.numel())
        if on_text is not None:
            on_text()
    q.seconds = time.perf_counter() - t0
    return q
