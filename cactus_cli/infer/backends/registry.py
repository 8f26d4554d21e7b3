"""The backend registry: every backend one object (base.Backend), in the order ``auto`` prefers
them. Everything that depends on what runs a model asks its backend; nothing else names one."""

from __future__ import annotations

from typing import Any

import torch

from cactus_cli.core.errors import ModelError
from cactus_cli.infer.backends.base import Backend, Decided
from cactus_cli.infer.backends.llama_cpp.backend import LlamaCppBackend
from cactus_cli.infer.backends.torch.backend import TorchBackend
from cactus_cli.infer.backends.vllm.backend import VllmBackend
from cactus_cli.infer.load.sources import Source

__all__ = ["BACKENDS", "CHOICES", "Backend", "Decided", "backend_of", "choose", "drives"]

BACKENDS: dict[str, Backend] = {
    b.name: b for b in (LlamaCppBackend(), TorchBackend(), VllmBackend())
}  # (auto's preference order; a backend that drives its own loop is never auto's)
CHOICES = ("auto", *BACKENDS)  # what --backend and a profile's backend take
FALLBACK = "torch"  # what auto runs where nothing it prefers can: it runs every source


def backend_of(name: str) -> Backend:
    return BACKENDS[name]


def drives(name: str) -> bool:
    """Whether ``name`` (a --backend value, auto included) runs its own decode loop (vLLM)."""
    return name in BACKENDS and BACKENDS[name].drives


def choose(
    asked: str, sources: list[tuple[str, Source]], request: Any, device: torch.device
) -> tuple[Backend, str, str | None]:
    """(backend, why, a warning or None). A backend asked for by name must run every source and
    honour every setting (else a one-line error naming what to drop); ``auto`` takes the first
    backend in BACKENDS that runs every source, honours every setting and is available here,
    and warns when a backend it prefers was passed over only because it is not installed."""
    if asked != "auto":
        chosen = BACKENDS[asked]
        if chosen.drives:
            raise ModelError(
                f"--backend {asked} runs {', '.join(chosen.commands)} (vLLM's own engine); this command runs on "
                "cactus's engine: use --backend auto, or name another backend"
            )
        other = next(((n, s) for n, s in sources if not chosen.runs(s)), None)
        if other is not None:
            raise ModelError(
                f"--backend {asked} cannot run {other[0]!r}, a {other[1].kind}; use another --backend for it"
            )
        if flag := chosen.refuses(request, device):
            owner = _owner(flag)
            hint = (
                f" (it is a {owner} setting); drop it, or use --backend {owner}"
                if owner and owner != asked
                else "; drop it, or choose another --backend"
            )
            raise ModelError(f"{flag} does not apply to the {asked} backend{hint}")
        if problem := chosen.unavailable():
            raise ModelError(problem)
        return chosen, f"backend {asked} (asked for)", None
    skipped, note = [], None
    for b in (b for b in BACKENDS.values() if not b.drives):
        other = next(((n, s) for n, s in sources if not b.runs(s)), None)
        flag = None if other else b.refuses(request, device)
        problem = None if other or flag else b.unavailable()
        if other is None and flag is None and problem is None:
            why = f"not {'; not '.join(skipped)}" if skipped else b.preferred_for
            return b, f"backend auto: {b.name}" + (f" ({why})" if why else ""), note
        if problem is not None and not skipped:
            note = f"{b.name} is not available: {problem}"
        skipped.append(
            f"{b.name}: {other[0]} is a {other[1].kind}"
            if other
            else f"{b.name}: {flag}"
            if flag
            else f"{b.name}: {problem}"
        )
    raise ModelError(f"no backend can run this (not {'; not '.join(skipped)})")


def _owner(flag: str) -> str | None:
    """The backend a --quantize value belongs to, for the message (``--quantize q4_0``: llama.cpp)."""
    value = flag.split(" ", 1)[1] if flag.startswith("--quantize ") else None
    return next((b.name for b in BACKENDS.values() if value in b.quantizations), None)
