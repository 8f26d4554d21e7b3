"""One load, decided up front. ``plan_load`` takes one ``LoadRequest`` (app/runtime.load_request
builds it from the resolved settings) and resolves every choice a load makes into one frozen
``LoadPlan``, each with its reason: the sources and the files each model loads (embedded parts
assembled, a GGUF converted or requantized), the backend (backends/), the device, the dtype, the
quantization with its fallback, the threads, tensor parallelism, whether the draft drafts across
vocabularies, and compilation. ``models.load_plan`` then loads from it in one pass (a
tensor-parallel follower included), and ``generate --json`` reports it as it is (``describe``).
Nothing here loads weights or starts processes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from cactus_cli.core.errors import ModelError
from cactus_cli.infer.backends import registry
from cactus_cli.infer.backends.torch.compiled import compile_problem
from cactus_cli.infer.kpolicy.store import CostStore
from cactus_cli.infer.load.devices import resolve_device
from cactus_cli.infer.load.sources import Source, load_tokenizer, materialize, resolve_source
from cactus_cli.infer.pair.keys import key_of


@dataclass(frozen=True, kw_only=True)
class LoadRequest:
    """What a load is asked for: the models by name and the runtime settings, as the user gave
    them (``auto`` where a choice is left to the plan)."""

    verifier: str | None
    draft: str | None = None  # a draft model (not a model-free drafter: those need no loading)
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "auto"
    tp: int = 1
    cross_vocab: str = "auto"
    backend: str = "auto"
    threads: int | None = None
    compile: str = "auto"
    sequences: int = 1  # the engine's slots (serve, bench --concurrency): compiled steps hold one
    quality_texts: tuple[str, ...] = ()  # what a requantized verifier's quality is measured on
    tokenizer_files: Source | None = None  # (set by plan_load: --tokenizer's files, for the backends)


@dataclass(frozen=True, kw_only=True)
class LoadPlan:
    """What a load will do, and why. Names are what the user gave; ``files`` what each loads."""

    request: LoadRequest
    verifier_files: tuple[Source, Source]  # (weights, tokenizer) as the backend reads them
    draft_source: Source | None
    draft_files: tuple[Source, Source] | None
    tokenizer_source: Source | None
    backend: str  # a key of registry.BACKENDS
    backend_reason: str
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str
    quantize: str  # none, int8, int4, w8a8 (torch); gguf (llama.cpp: the file's own types) or q4_0
    quantize_reason: str
    gate: float | None  # the quality gate of the first quantization (torch's w8a8) ...
    fallback: str | None  # ... and what the quantization becomes if it fails
    threads: int | None
    threads_reason: str
    tp: int
    tp_load: dict[str, Any] | None  # what every tensor-parallel rank loads
    cross_vocab: str  # none, or as asked: auto, string, intersection (a draft with its own vocabulary)
    cross_reason: str
    compiled: bool
    compile_reason: str

    @property
    def verifier(self) -> str | None:
        return self.request.verifier

    @property
    def draft(self) -> str | None:
        return self.request.draft

    def describe(self) -> dict[str, Any]:
        return {
            "backend": {"value": self.backend, "reason": self.backend_reason},
            "device": {"value": str(self.device)},
            "dtype": {"value": str(self.dtype).removeprefix("torch."), "reason": self.dtype_reason},
            "quantize": {"value": self.quantize, "reason": self.quantize_reason, "fallback": self.fallback},
            "tp": {"value": self.tp},
            "threads": {"value": self.threads, "reason": self.threads_reason},
            "cross_vocab": {"value": self.cross_vocab, "reason": self.cross_reason},
            "compile": {"value": self.compiled, "reason": self.compile_reason},
        }

    def draft_plan(self) -> LoadPlan:
        """How the draft model loads: beside the verifier, on its device and dtype, quantized as
        the verifier (unquantized beside a tensor-parallel one), never sharded."""
        return dataclasses.replace(self, quantize="none" if self.tp > 1 else self.quantize, gate=None, tp=1)


def plan_load(request: LoadRequest, reporter=None) -> LoadPlan:
    """Every choice of a load, resolved now. Sources are all resolved first, so a missing one
    fails before any file is made; then the files each model loads."""
    if not request.verifier:
        raise ModelError(
            "no verifier model: pass --verifier (hub id, folder or .gguf) or use a --profile that names one"
        )
    dev = resolve_device(request.device)
    vsrc = resolve_source(request.verifier)
    dsrc = resolve_source(request.draft) if request.draft is not None else None
    tsrc = resolve_source(request.tokenizer) if request.tokenizer else None
    named = [(request.verifier, vsrc)] + ([(request.draft, dsrc)] if dsrc is not None else [])
    backend, backend_why, note = registry.choose(request.backend, named, request, dev)
    if note and reporter is not None:
        reporter.warn(f"running the models on {backend.name} (slower on a CPU): {note}")
    if reporter is not None:
        reporter.task(f"preparing verifier {request.verifier}")
    files = backend.files(vsrc, reporter)
    tok_files = materialize(tsrc, reporter) if tsrc is not None else None
    decided = backend.decide(dataclasses.replace(request, tokenizer_files=tok_files), vsrc, files, dev, reporter)
    dfiles = backend.files(dsrc, reporter) if dsrc is not None else None
    cross, cross_why = _cross(request, dfiles, tok_files or decided.files[1])
    plan = LoadPlan(
        request=request,
        verifier_files=decided.files,
        draft_source=dsrc,
        draft_files=dfiles,
        tokenizer_source=tsrc,
        backend=backend.name,
        backend_reason=backend_why,
        device=dev,
        dtype=decided.dtype,
        dtype_reason=decided.dtype_reason,
        quantize=decided.quantize,
        quantize_reason=decided.quantize_reason,
        gate=decided.gate,
        fallback=decided.fallback,
        threads=decided.threads,
        threads_reason=decided.threads_reason,
        tp=request.tp,
        tp_load=decided.tp_load,
        cross_vocab=cross,
        cross_reason=cross_why,
        compiled=False,
        compile_reason="",
    )
    return with_compile(plan)


def with_compile(plan: LoadPlan, mode: str | None = None, sequences: int | None = None) -> LoadPlan:
    """``plan`` with its compile choice made (``mode``, when given, replaces the request's
    ``--compile``: bench times one pair eager and compiled; ``sequences``, its slots: a pair
    loaded once runs in engines of several)."""
    asked = {name: v for name, v in (("compile", mode), ("sequences", sequences)) if v is not None}
    if asked:
        plan = dataclasses.replace(plan, request=dataclasses.replace(plan.request, **asked))
    compiled, why = choose_compile(plan)
    return dataclasses.replace(plan, compiled=compiled, compile_reason=why)


def _cross(request: LoadRequest, dfiles: tuple[Source, Source] | None, tok: Source) -> tuple[str, str]:
    """Whether the draft drafts across vocabularies (its tokenizer differs from the one the
    verifier runs with), decided from the two tokenizers (no weights read). With --tokenizer
    both models use that one."""
    if dfiles is None:
        return "none", ""
    if request.tokenizer is None and load_tokenizer(dfiles[1]).get_vocab() != load_tokenizer(tok).get_vocab():
        method = request.cross_vocab
        return method, "the draft has its own vocabulary" + (
            " (auto: string, decided at load)" if method == "auto" else ""
        )
    if request.cross_vocab != "auto":
        raise ModelError(
            f"--cross-vocab {request.cross_vocab}: draft {request.draft!r} shares the verifier's vocabulary; "
            "drop --cross-vocab (it applies to a draft with another tokenizer)"
        )
    return "none", ""


def choose_compile(plan: LoadPlan) -> tuple[bool, str]:
    """``--compile`` to on/off, with why. auto: on for CUDA; on a CPU only where earlier runs of
    this pair measured the compiled verifier faster (compiling there costs a minute and pays only
    when a forward is overhead-bound); never where the backend does not compile or under --tp
    (``on`` there: off, said); and never for several sequences (a compiled runner's static cache
    and graphs hold one: the slots run eagerly, all of them, said)."""
    compiled, why = _compile_choice(plan)
    n = plan.request.sequences
    if compiled and n > 1:
        asked = "--compile on" if plan.request.compile == "on" else "compile auto"
        return False, f"{asked}: compiled steps hold one sequence, so the {n} slots run eagerly"
    return compiled, why


def _compile_choice(plan: LoadPlan) -> tuple[bool, str]:
    """``--compile`` to on/off for one sequence, with why."""
    mode = plan.request.compile
    if mode == "off":
        return False, "off (as asked)"
    if not registry.backend_of(plan.backend).compiles:
        return False, f"{plan.backend} runs no compiled steps"
    if plan.tp > 1:
        return False, ("--compile on does not combine with --tp yet; running eagerly" if mode == "on" else "--tp")
    problem = compile_problem(plan.device)
    if mode == "on":
        return (False, f"--compile on: {problem}; running eagerly") if problem else (True, "on (as asked)")
    if problem:
        return False, f"auto: {problem}"
    if plan.device.type == "cuda":
        return True, "auto: on for CUDA"
    return (True, "auto: measured faster here") if _measured_faster(plan) else (False, "auto: off on a CPU")


def _measured_faster(plan: LoadPlan) -> bool:
    """Both cost caches exist and the compiled verifier's one-token step was >= 10% faster."""
    t = []
    for compiled in (False, True):
        costs = CostStore.read(key_of(plan, compiled)).costs
        if not costs.verify:
            return False
        t.append(costs.t_v(1))
    return t[1] < 0.9 * t[0]
