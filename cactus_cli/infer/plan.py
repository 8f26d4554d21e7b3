"""One load, decided up front. ``plan_load`` resolves every choice a load makes into one frozen
``LoadPlan``, each with its reason: the sources and the files each backend reads from them
(embedded parts assembled, a GGUF converted for torch), the backend, the device, the dtype, the
quantization method and its quality gate, tensor parallelism. ``models.load_plan`` then loads
from it in one pass, and ``generate --json`` reports it as it is (``describe``). Nothing here
loads weights or starts processes; compilation is decided with the engine, which reads the
pair's own measured step costs (app/runtime.resolve_compile)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cactus_cli.core import defaults
from cactus_cli.core.errors import ModelError
from cactus_cli.infer import embedded, gguf, gguf_layout
from cactus_cli.infer.devices import (
    fastest_cpu_quantization,
    quantized_dtype,
    resolve_device,
    resolve_dtype,
    resolve_quantize,
)
from cactus_cli.infer.quant.quantize import quality_verdict
from cactus_cli.infer.quant.smooth import CALIBRATION_TEXT
from cactus_cli.infer.sources import (
    GGUF_KINDS,
    Source,
    load_tokenizer,
    materialize,
    mlp_shape,
    model_files,
    resolve_source,
)
from cactus_cli.infer.tp import group

BACKENDS = ("auto", "torch", "llama.cpp")


@dataclass(frozen=True)
class LoadPlan:
    """What a load will do, and why. Names are what the user gave; ``files`` what each loads."""

    verifier: str
    draft: str | None
    tokenizer: str | None
    verifier_files: tuple[Source, Source]  # (weights, tokenizer) as the backend reads them
    draft_source: Source | None  # (its files are made when it loads: bench adds drafts to a loaded verifier)
    tokenizer_source: Source | None
    backend: str
    backend_reason: str
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str
    quantize: str  # none, int8, int4, w8a8 (torch); gguf (llama.cpp: the file's own types) or q4_0 (requantized)
    quantize_reason: str
    gate: float | None  # w8a8's quality gate (nats/token), on its first quantization
    tp: int
    tp_load: dict[str, Any] | None  # what every tensor-parallel rank loads
    threads: int | None
    cross_vocab: str

    def describe(self) -> dict[str, Any]:
        return {
            "backend": {"value": self.backend, "reason": self.backend_reason},
            "device": {"value": str(self.device)},
            "dtype": {"value": str(self.dtype).removeprefix("torch."), "reason": self.dtype_reason},
            "quantize": {"value": self.quantize, "reason": self.quantize_reason},
            "tp": {"value": self.tp},
            "threads": {"value": self.threads},
        }


def plan_load(
    verifier: str | None,
    draft: str | None,
    tokenizer: str | None,
    device: str,
    dtype: str,
    reporter=None,
    quantize: str = "none",
    tp: int = 1,
    cross_vocab: str = "auto",
    backend: str = "torch",
    threads: int | None = None,
    compile_mode: str = "auto",
    quality_texts: tuple[str, ...] = (),
) -> LoadPlan:
    """Every choice of a load, resolved now. ``quality_texts``: what a requantized GGUF's quality
    is measured on (the built-in prompts; the calibration text when none are given). Sources are all resolved first, so a missing one
    fails before any file is made; then the verifier's files (assembled or converted once)."""
    if not verifier:
        raise ModelError(
            "no verifier model: pass --verifier (hub id, folder or .gguf) or use a --profile that names one"
        )
    dev = resolve_device(device)
    vsrc = resolve_source(verifier)
    dsrc = resolve_source(draft) if draft is not None else None
    tsrc = resolve_source(tokenizer) if tokenizer else None
    named = [(verifier, vsrc)] + ([(draft, dsrc)] if dsrc is not None else [])
    asked = backend
    backend, backend_why = choose_backend(backend, named, dev, quantize, dtype, compile_mode, tp)
    if asked == "auto" and backend == "torch" and reporter is not None and (problem := _llama_missing(named, dev)):
        reporter.warn(f"running the GGUF on torch (converted once, slower on a CPU): {problem}")
    if reporter is not None:
        reporter.task(f"preparing verifier {verifier}")
    files = model_files(vsrc, backend, reporter)
    tp_load, gate = None, None
    if backend == "llama.cpp":
        layout = gguf_layout.choose(
            Path(files[0].location),
            vsrc.location if vsrc.kind == "embedded" else embedded.gguf_key(files[0].location),
            quantize,
            threads,
            vsrc.kind == "embedded",
            lambda: [
                list(ids) for ids in load_tokenizer(files[1])(list(quality_texts or [CALIBRATION_TEXT]))["input_ids"]
            ],
            reporter,
        )
        files, threads = (Source("gguf", layout.path), files[1]), layout.threads
        method, qwhy = layout.quantize, layout.reason
        dt, why = torch.float32, "llama.cpp: the GGUF's weight types, float32 activations"
    elif tp > 1:
        vocab = len(load_tokenizer(materialize(tsrc, reporter) if tsrc else files[1]))
        tp_load, dt, why = tp_plan(tp, files[0], verifier, dev, dtype, quantize, vocab)
        method, qwhy = "none", "tensor parallel shards run unquantized"
    else:
        method, qwhy, gate = choose_quantize(quantize, dev, dtype, files[0])
        if method != "none":
            dt, why = quantized_dtype(method, dtype, dev)
            why = f"{qwhy}; {why}" if qwhy else why
        else:
            dt, why = resolve_dtype(dtype, dev, mlp_shape(files[0]) if dtype == "auto" and dev.type == "cpu" else None)
    return LoadPlan(
        verifier,
        draft,
        tokenizer,
        files,
        dsrc,
        tsrc,
        backend,
        backend_why,
        dev,
        dt,
        why,
        method,
        qwhy or ("as asked" if quantize == method else ""),
        gate if method == "w8a8" else None,
        tp,
        tp_load,
        threads,
        cross_vocab,
    )


def choose_quantize(name: str, dev: torch.device, dtype: str, vsrc: Source) -> tuple[str, str, float | None]:
    """(method, why, quality gate). ``auto`` on a CPU with bfloat16 activations: w8a8 or int8,
    whichever runs the model's MLP matmul faster here (measured once per machine), where w8a8's
    quality on this model passes: its mean NLL within QUALITY_TOLERANCE of the unquantized model
    on the calibration text, measured at its first quantization (the gate) and kept."""
    method = resolve_quantize(name, dev, dtype)
    shape = mlp_shape(vsrc) if name == "auto" and method == "int8" else None
    if shape is None:  # asked for by name, or not a CPU
        return method, "", None
    best, why = fastest_cpu_quantization(*shape)
    if best != "w8a8":
        return "int8", f"quantize auto: int8, {why}", None
    verdict = quality_verdict(vsrc.location)
    if verdict is None:
        return "w8a8", f"quantize auto: w8a8, {why}", defaults.QUALITY_TOLERANCE
    if verdict > defaults.QUALITY_TOLERANCE:
        return (
            "int8",
            (
                f"quantize auto: int8, w8a8 measured {verdict:+.3f} nats/token on this model "
                f"(more than {defaults.QUALITY_TOLERANCE:g})"
            ),
            None,
        )
    return "w8a8", f"quantize auto: w8a8, {why}; {verdict:+.3f} nats/token on this model", None


def choose_backend(
    asked: str,
    sources: list[tuple[str, Source]],
    dev: torch.device,
    quantize: str,
    dtype: str,
    compile_mode: str,
    tp: int,
) -> tuple[str, str]:
    """(backend, why). ``auto``: llama.cpp for GGUF sources (the embedded pair, .gguf files) on a
    CPU when its bindings import, torch everywhere else (CUDA, hub ids, folders) and wherever a
    torch-only setting was given; that setting with ``llama.cpp`` named is an error. (quantize
    none is not one: llama.cpp does not quantize further either, it runs the GGUF's own types.)"""
    torch_only = [
        flag
        for flag, on in (
            (f"--tp {tp}", tp > 1),
            ("--compile on", compile_mode == "on"),
            (f"--quantize {quantize}", quantize not in ("auto", "none", *gguf_layout.TYPES)),
            (f"--dtype {dtype}", dtype != "auto"),
            (f"--device {dev}", dev.type != "cpu"),
        )
        if on
    ]
    other = next(((name, src) for name, src in sources if src.kind not in GGUF_KINDS), None)
    if asked == "torch":
        if quantize in gguf_layout.TYPES:
            raise ModelError(
                f"--quantize {quantize} requantizes a GGUF for the llama.cpp backend; on torch use int8, int4 or w8a8"
            )
        return "torch", "backend torch (asked for)"
    if quantize in gguf_layout.TYPES and (other is not None or torch_only):
        raise ModelError(
            f"--quantize {quantize} requantizes a GGUF for llama.cpp on a CPU, and "
            + (f"{other[0]!r} is a {other[1].kind}" if other is not None else f"{torch_only[0]} is a torch setting")
        )
    if asked == "llama.cpp":
        if other is not None:
            raise ModelError(
                f"--backend llama.cpp runs GGUF files (embedded models, .gguf), and {other[0]!r} is a "
                f"{other[1].kind}; use --backend torch for it"
            )
        if torch_only:
            raise ModelError(
                f"{torch_only[0]} does not apply to the llama.cpp backend (it runs the GGUF's own "
                "quantization on the CPU); drop it, or use --backend torch"
            )
        if problem := gguf.available():
            raise ModelError(problem)
        return "llama.cpp", "backend llama.cpp (asked for)"
    if other is not None:
        return "torch", f"backend auto: torch ({other[0]} is a {other[1].kind}, not a GGUF file)"
    if torch_only:
        return "torch", f"backend auto: torch ({torch_only[0]} is a torch setting)"
    if problem := gguf.available():
        if quantize in gguf_layout.TYPES:
            raise ModelError(f"--quantize {quantize} needs the llama.cpp backend: {problem}")
        return "torch", f"backend auto: torch, llama.cpp is not available: {problem}"
    return "llama.cpp", "backend auto: llama.cpp (GGUF files on a CPU)"


def _llama_missing(named: list[tuple[str, Source]], dev: torch.device) -> str | None:
    """Why llama.cpp did not run GGUF sources on a CPU, if that was the only reason."""
    if dev.type == "cpu" and all(src.kind in GGUF_KINDS for _, src in named):
        return gguf.available()
    return None


def tp_plan(
    tp: int, vsrc: Source, verifier: str, dev: torch.device, dtype: str, quantize: str, vocab: int
) -> tuple[dict[str, Any], torch.dtype, str]:
    """Check --tp against the verifier and pick the dtype: (what every rank loads, dtype, why).
    No side effects: rank 0 then starts the group, a follower rank serves it (app/runtime.py)."""
    from transformers import AutoConfig

    if quantize not in ("none", "auto"):
        raise ModelError(f"--quantize {quantize} does not combine with --tp yet; use one or the other")
    try:
        config = AutoConfig.from_pretrained(vsrc.location, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - any config transformers cannot read
        first = " ".join(str(err).split())[:300] or type(err).__name__
        raise ModelError(f"could not read the verifier's config from {vsrc.location}: {first}") from None
    group.check_tp(tp, config, dev, verifier)
    if dev.type == "cuda" and dev.index not in (None, 0):
        raise ModelError(
            f"--device {dev} with --tp: rank r runs on cuda:r and the draft beside rank 0 on cuda:0; "
            "use --device cuda (choose the GPUs with CUDA_VISIBLE_DEVICES)"
        )
    if dev.type == "cpu":
        if dtype not in ("auto", "float32"):
            raise ModelError(f"--tp on a CPU reduces over gloo in float32; use --dtype float32 (or auto), not {dtype}")
        dt, why = torch.float32, "tensor parallel over gloo (CPU) reduces in float32"
    else:
        dt, why = resolve_dtype(dtype, dev)
    load = {
        "kind": vsrc.kind,
        "location": vsrc.location,
        "device": str(dev),
        "dtype": str(dt).removeprefix("torch."),
        "vocab": vocab,
    }
    return load, dt, why
