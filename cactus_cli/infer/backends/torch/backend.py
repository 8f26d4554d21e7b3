"""The torch backend: transformers models (hub ids, folders; embedded models and .gguf files
converted once to safetensors) on the device and dtype devices.py picks, quantized by
quant/quantize.py, eager, compiled (compiled.py) or sharded over ranks (--tp), all beside it in
backends/torch/."""

from __future__ import annotations

import time
from typing import Any

import torch

from cactus_cli.core import defaults
from cactus_cli.core.errors import ModelError
from cactus_cli.infer.backends.base import Backend, Decided
from cactus_cli.infer.backends.torch import group
from cactus_cli.infer.backends.torch.compiled import CompiledLM, kv_bytes_per_token
from cactus_cli.infer.backends.torch.eager import CachedLM
from cactus_cli.infer.backends.torch.quant.choice import fastest_cpu_quantization, quantized_dtype
from cactus_cli.infer.backends.torch.quant.quantize import QualityGateFailed, quality_verdict, quantize_model
from cactus_cli.infer.backends.torch.sharded import ShardedRunner
from cactus_cli.infer.load.devices import resolve_dtype, resolve_quantize
from cactus_cli.infer.load.sources import LoadedModel, Source, _from_pretrained, load_tokenizer, materialize, mlp_shape
from cactus_cli.infer.runner import Runner


class TorchBackend(Backend):
    name = "torch"
    summary = "every source, on CUDA too"
    quantizations = ("int8", "int4", "w8a8")
    compiles = True
    tensor_parallel = True
    transformers = True

    def runs(self, src: Source) -> bool:
        return True  # (a GGUF is converted to safetensors once)

    def refuses(self, request: Any, device: torch.device) -> str | None:
        if request.quantize not in ("auto", "none", *self.quantizations):
            return f"--quantize {request.quantize}"
        return None

    def files(self, src: Source, reporter=None) -> tuple[Source, Source]:
        folder = materialize(src, reporter)
        return folder, folder

    def decide(self, request: Any, src: Source, files: tuple[Source, Source], device: torch.device, reporter=None):
        if request.tp > 1:
            vocab = len(load_tokenizer(request.tokenizer_files or files[1]))
            load, dt, why = tp_plan(
                request.tp, files[0], request.verifier, device, request.dtype, request.quantize, vocab
            )
            return Decided(
                files=files,
                dtype=dt,
                dtype_reason=why,
                quantize="none",
                quantize_reason="tensor parallel shards run unquantized",
                tp_load=load,
            )
        method, qwhy, gate = choose_quantize(request.quantize, device, request.dtype, files[0])
        if method != "none":
            dt, why = quantized_dtype(method, request.dtype, device)
            why = f"{qwhy}; {why}" if qwhy else why
        else:
            shape = mlp_shape(files[0]) if request.dtype == "auto" and device.type == "cpu" else None
            dt, why = resolve_dtype(request.dtype, device, shape)
        gate = gate if method == "w8a8" else None
        qwhy = qwhy or ("as asked" if request.quantize == method else "")
        return Decided(
            files=files,
            dtype=dt,
            dtype_reason=why,
            quantize=method,
            quantize_reason=qwhy,
            gate=gate,
            fallback="int8" if gate is not None else None,
            threads=request.threads,
        )

    def load(self, name: str, src: Source, plan: Any, tokenizer: Any, role: str, reporter=None) -> LoadedModel:
        calibration = (
            list(tokenizer(defaults.CALIBRATION_TEXT)["input_ids"]) if plan.quantize == "w8a8" else None
        )  # (smooth.py)
        return load_model(
            name, src, plan.device, plan.dtype, role, plan.quantize, reporter, plan.tp, calibration, plan.gate
        )

    def runner(
        self, lm: LoadedModel, vocab_size: int, compiled: bool, context_length: int, role: str, sequences: int = 1
    ) -> Runner:
        # (a sharded or compiled runner holds one sequence: the engine steps one slot there)
        if lm.tp > 1:  # a sharded verifier: its calls are announced to the other ranks (eager only)
            return ShardedRunner(CachedLM(lm, vocab_size))
        return CompiledLM(lm, vocab_size, context_length, role) if compiled else CachedLM(lm, vocab_size, sequences)

    def kv_bytes_per_token(self, lm: LoadedModel) -> int:
        return kv_bytes_per_token(lm.model.config, lm.dtype)

    def chat_context(self, compiled: bool, device: torch.device) -> str:
        return "whole" if compiled and device.type == "cuda" else "request"


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


def load_model(
    name: str,
    src: Source,
    device: torch.device,
    dtype: torch.dtype,
    role: str = "model",
    quantize: str = "none",
    reporter=None,
    tp: int = 1,
    calibration: list[int] | None = None,
    gate: float | None = None,
) -> LoadedModel:
    """Load ``src`` (already materialized: a folder or a hub id); ``name`` is what the user called
    it. ``quantize`` int8 / int4 / w8a8 replaces every Linear by its quantized version (``gate``:
    a w8a8 that costs more than that many nats/token on ``calibration`` becomes int8, the plan's
    fallback); ``tp`` > 1 loads this rank's shard (every rank of the group calls this together)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress display says what is loading
    hf_logging.set_verbosity_error()
    t0 = time.perf_counter()
    if tp > 1:
        from transformers import DistributedConfig

        model = _from_pretrained(
            AutoModelForCausalLM,
            src,
            f"{role} model",
            dtype=dtype,
            distributed_config=DistributedConfig(tp_plan="auto"),
        )
        device = next(model.parameters()).device
    elif quantize == "none" and device.type == "cuda":
        model = _load_on_gpu(AutoModelForCausalLM, src, role, dtype, device)
    else:
        # quantized: loaded and quantized on the CPU, so only the quantized weights reach the GPU
        model = _from_pretrained(AutoModelForCausalLM, src, f"{role} model", dtype=dtype)
    model.eval()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ctx = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 1 << 30
    width = int(model.get_output_embeddings().weight.shape[0])
    note = ""
    if quantize != "none":
        if reporter is not None:
            reporter.task(f"quantizing the {role} to {quantize}")
        report = reporter.task if reporter is not None else None
        try:
            note = quantize_model(model, quantize, src.location, report, device, calibration, gate)
        except QualityGateFailed as failed:  # (the model was half replaced: load it again)
            if reporter is not None:
                reporter.warn(f"--quantize auto: {failed} (more than {gate:g}); using int8")
            model = _from_pretrained(AutoModelForCausalLM, src, f"{role} model", dtype=dtype).eval()
            quantize = "int8"
            note = quantize_model(model, quantize, src.location, report, device)
    if tp == 1:
        model.to(device)  # (a no-op for what is already there)
    return LoadedModel(
        model, name, src.location, device, dtype, ctx, width, time.perf_counter() - t0, quantize, tp, note
    )


def _load_on_gpu(loader, src: Source, role: str, dtype: torch.dtype, device: torch.device):
    """Weights streamed straight to the GPU (no full copy in host memory first), where this
    transformers takes a device_map; otherwise load, then move."""
    try:
        return _from_pretrained(loader, src, f"{role} model", dtype=dtype, device_map={"": str(device)})
    except (ImportError, TypeError):  # no accelerate / no device_map here: the two-step way
        return _from_pretrained(loader, src, f"{role} model", dtype=dtype).to(device)
