"""The cost store's key (kpolicy/store.py) of a loaded pair (``cost_key``) or of a load plan
before anything is loaded (``key_of``): what a step's cost depends on, made here, above the
backends and the devices, and handed to the store as plain data."""

from __future__ import annotations

from typing import Any

import torch

from cactus_cli.infer.backends.registry import backend_of
from cactus_cli.infer.load.devices import device_name
from cactus_cli.infer.load.sources import ModelPair


def cost_key(pair: ModelPair, compiled: bool = False) -> dict[str, Any]:
    """What step costs depend on: the models, device, dtype, threads, torch, what the backend adds
    (backends/), quantization (as it ran: int8 where w8a8 failed its gate), compilation and --tp."""
    v = pair.verifier
    return _key(
        v.path,
        pair.draft.path if pair.draft else None,
        v.device,
        v.dtype,
        v.backend,
        v.threads,
        v.quantize,
        v.tp,
        compiled,
    )


def key_of(plan: Any, compiled: bool = False) -> dict[str, Any]:
    """``cost_key`` of the pair a load plan (plan.LoadPlan) will load, before it is loaded."""
    draft = plan.draft_files[0].location if plan.draft_files else None
    return _key(
        plan.verifier_files[0].location,
        draft,
        plan.device,
        plan.dtype,
        plan.backend,
        plan.threads,
        plan.quantize,
        plan.tp,
        compiled,
    )


def _key(verifier, draft, device, dtype, backend, threads, quantize, tp, compiled) -> dict[str, Any]:
    key = {
        "verifier": verifier,
        "draft": draft,
        "device": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **backend_of(backend).cost_key(threads),  # (nothing for torch: its earlier caches still apply)
    }
    if compiled:
        key["compiled"] = True  # (absent when eager, so eager caches from earlier versions still apply)
    if quantize != "none":
        key["quantize"] = quantize
    if tp > 1:
        key["tp"] = tp
    return key
