"""Loading: pick the backend (torch or llama.cpp) for the sources (sources.py), then load with
transformers on the device and dtype devices.py picks (quantized by quant/quantize.py, or as this
rank's tensor-parallel shard) or load the GGUF on llama.cpp, and check that draft and verifier
share a tokenizer (and that llama.cpp's vocabulary gives the tokenizer's ids). Loading never
starts or serves a tensor-parallel group: ``tp_load_spec`` only says what every rank loads;
app/runtime.py starts the group (or, on a follower rank, serves it)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from cactus_cli.core.errors import ModelError
from cactus_cli.infer import gguf
from cactus_cli.infer.devices import (
    resolve_device,
)
from cactus_cli.infer.plan import LoadPlan, plan_load, tp_plan
from cactus_cli.infer.quant.quantize import (
    QualityGateFailed,
    quantize_model,
)
from cactus_cli.infer.quant.smooth import CALIBRATION_TEXT
from cactus_cli.infer.sources import (
    LoadedModel,
    ModelPair,
    Source,
    _from_pretrained,
    load_tokenizer,
    materialize,
    model_files,
    resolve_source,
)
from cactus_cli.infer.tp import group
from cactus_cli.infer.vocab import CrossVocab


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
    a w8a8 that costs more than that many nats/token on ``calibration`` becomes int8);
    ``tp`` > 1 loads this rank's shard (every rank of the group calls this together)."""
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


def load_shard(load: dict) -> tuple[LoadedModel, int]:
    """A tensor-parallel follower's verifier shard, loaded as rank 0 loads its own."""
    src = Source(load["kind"], load["location"])
    lm = load_model(
        load["location"],
        src,
        torch.device(load["device"]),
        getattr(torch, load["dtype"]),
        "verifier",
        tp=group.rank_and_world()[1],
    )
    return lm, int(load["vocab"])


def _draft_tokenizer(tok: Any, dsrc: Source | None, cross_vocab: str, draft: str) -> Any:
    """The draft's own tokenizer when its vocabulary differs from ``tok`` (it drafts across
    vocabularies), else None. With --tokenizer (``dsrc`` None) both use that one."""
    dtok = load_tokenizer(dsrc) if dsrc is not None else None
    if dtok is not None and dtok.get_vocab() == tok.get_vocab():
        dtok = None
    if dtok is None and cross_vocab != "auto":
        raise ModelError(
            f"--cross-vocab {cross_vocab}: draft {draft!r} shares the verifier's vocabulary; "
            "drop --cross-vocab (it applies to a draft with another tokenizer)"
        )
    return dtok


def _own_tokenizer(src: Source | None):
    """The tokenizer a model folder ships, or None (a bare converted model, a hub id without one)."""
    if src is None or src.kind != "folder":
        return None
    folder = Path(src.location)
    if not any(
        (folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    ):
        return None
    try:
        return load_tokenizer(src)
    except ModelError:
        return None


def check_same_vocab(verifier_tok, draft_tok, verifier: str, draft: str, what: str | None = None) -> None:
    """Draft and verifier must map every token string to the same id."""
    v, d = verifier_tok.get_vocab(), draft_tok.get_vocab()
    if v == d:
        return
    only_v = sorted(set(v) - set(d), key=v.get)[:3]
    only_d = sorted(set(d) - set(v), key=d.get)[:3]
    moved = [t for t in v if t in d and v[t] != d[t]][:3]
    detail = (
        f"{len(v)} vs {len(d)} tokens"
        + (f"; only in {'the model' if what else 'verifier'}: {only_v}" if only_v else "")
        + (f"; only in {'--tokenizer' if what else 'draft'}: {only_d}" if only_d else "")
        + (f"; different ids for: {moved}" if moved else "")
    )
    if what is not None:
        raise ModelError(f"{what} do not share a vocabulary ({detail}); use the tokenizer that belongs to the models")
    raise ModelError(
        f"draft {draft!r} and verifier {verifier!r} do not share a tokenizer ({detail}); "
        "speculative decoding needs one vocabulary: pick a draft from the verifier's model family"
    )


PROBE_TEXT = "def add(a, b):\n    return a + b  # sum: ünïcödé, 数字 42\n\tdone!"


def load_gguf(name: str, src: Source, tokenizer: Any, role: str, threads: int, reporter=None) -> LoadedModel:
    """A GGUF file on llama.cpp, after checking that its vocabulary gives the same ids as
    ``tokenizer`` (the engine's) on a probe text in the chat template, special tokens included."""
    t0 = time.perf_counter()
    if reporter is not None:
        reporter.task(f"loading the {role} {name} on llama.cpp")
    model = gguf.GGUFModel.load(src.location, threads)
    text = PROBE_TEXT
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROBE_TEXT}], add_generation_prompt=True, tokenize=False
        )
    ours, theirs = list(tokenizer(text, add_special_tokens=False)["input_ids"]), model.tokenize(text)
    if ours != theirs:
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise ModelError(
            f"{role} {name}: llama.cpp's vocabulary and the tokenizer give different token ids for the same "
            f"text (first at token {at}: {ours[at : at + 3]} vs {theirs[at : at + 3]}); use the tokenizer "
            "made from this GGUF (no --tokenizer), or --backend torch"
        )
    return LoadedModel(
        model,
        name,
        src.location,
        torch.device("cpu"),
        torch.float32,
        model.n_ctx_train,
        model.n_vocab,
        time.perf_counter() - t0,
        "gguf",
        1,
        model.description,
        backend="llama.cpp",
    )


def tp_load_spec(
    verifier: str, tokenizer: str | None, device: str, dtype: str, quantize: str, tp: int
) -> dict[str, Any]:
    """What a follower rank loads (the verifier's shard), found the way rank 0 finds it."""
    vsrc = materialize(resolve_source(verifier))
    tok = load_tokenizer(materialize(resolve_source(tokenizer)) if tokenizer else vsrc)
    return tp_plan(tp, vsrc, verifier, resolve_device(device), dtype, quantize, len(tok))[0]


def load_pair(
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
) -> ModelPair:
    """Load verifier, optional draft and the shared tokenizer (the verifier's unless ``tokenizer``
    names another source), as ``plan_load`` decides. A draft with another vocabulary drafts
    across vocabularies by ``cross_vocab`` (auto, string, intersection: draft/cross.py)."""
    return load_plan(
        plan_load(
            verifier,
            draft,
            tokenizer,
            device,
            dtype,
            reporter,
            quantize,
            tp,
            cross_vocab,
            backend,
            threads,
            compile_mode,
            quality_texts,
        ),
        reporter,
    )


def load_plan(plan: LoadPlan, reporter=None) -> ModelPair:
    """The pair ``plan`` describes, loaded in one pass."""
    vsrc, vtok = plan.verifier_files
    tsrc = plan.tokenizer_source
    if reporter is not None:
        reporter.task(f"loading verifier {plan.verifier}")
    tok = load_tokenizer(materialize(tsrc, reporter) if tsrc else vtok)
    if tsrc is not None:  # the shared-vocabulary check holds whatever the tokenizer's source
        dtok = model_files(plan.draft_source, plan.backend, reporter)[1] if plan.draft_source else None
        for src, name in ((vtok, plan.verifier), (dtok, plan.draft)):
            own = _own_tokenizer(src)
            if own is not None:
                check_same_vocab(
                    own, tok, name, plan.tokenizer, what=f"--tokenizer {plan.tokenizer!r} and model {name!r}"
                )
    if plan.backend == "llama.cpp":
        vm = load_gguf(plan.verifier, vsrc, tok, "verifier", plan.threads or gguf.default_threads(), reporter)
        why = f"llama.cpp: the GGUF's own weight types ({vm.quantize_note}), float32 activations"
    else:
        if plan.tp > 1:
            if reporter is not None:
                reporter.task(f"starting {plan.tp} tensor-parallel ranks")
            group.start(plan.tp, plan.device, plan.tp_load)
        calibration = list(tok(CALIBRATION_TEXT)["input_ids"]) if plan.quantize == "w8a8" else None  # (smooth.py)
        vm = load_model(
            plan.verifier,
            vsrc,
            plan.device,
            plan.dtype,
            "verifier",
            plan.quantize,
            reporter,
            plan.tp,
            calibration,
            plan.gate,
        )
        why = plan.dtype_reason
    _check_rows(vm, "verifier", len(tok))
    pair = ModelPair(vm, None, tok, len(tok), why, backend_reason=plan.backend_reason, plan=plan)
    if plan.draft is None:
        return pair
    if reporter is not None:
        reporter.task(f"loading draft {plan.draft}")
    return with_draft(pair, plan.draft, reporter, plan.cross_vocab, own_tokenizer=tsrc is None)


def with_draft(
    pair: ModelPair, draft: str, reporter=None, cross_vocab: str = "auto", own_tokenizer: bool = True
) -> ModelPair:
    """``pair`` with a draft model (bench compares several on one verifier in memory), on the
    verifier's backend: on llama.cpp beside it, or on torch on the verifier's device (rank 0's
    under --tp, where acceptance is decided) in its dtype and quantization (int8 if the
    verifier's w8a8 failed its quality gate). With ``own_tokenizer`` a draft whose vocabulary
    differs drafts across vocabularies by ``cross_vocab``."""
    vm, tok = pair.verifier, pair.tokenizer
    dsrc, dtoksrc = model_files(resolve_source(draft), vm.backend, reporter)
    dtok = _draft_tokenizer(tok, dtoksrc if own_tokenizer else None, cross_vocab, draft)
    if vm.backend == "llama.cpp":
        dm = load_gguf(draft, dsrc, dtok or tok, "draft", vm.model.threads, reporter)
    else:
        quantize = vm.quantize if vm.tp == 1 else "none"
        calibration = list((dtok or tok)(CALIBRATION_TEXT)["input_ids"]) if quantize == "w8a8" else None
        dm = load_model(draft, dsrc, vm.device, vm.dtype, "draft", quantize, reporter, 1, calibration)
    cross = None
    if dtok is not None:
        cross = CrossVocab.build(dtok, tok, dm.logits_width, vm.logits_width, cross_vocab, draft, vm.source)
    else:
        _check_rows(dm, "draft", pair.vocab_size)
    return dataclasses.replace(pair, draft=dm, cross=cross)


def _check_rows(lm: LoadedModel, role: str, vocab: int) -> None:
    """Padded output rows are a few hundred at most (Qwen2.5: 271); far fewer tokens than rows
    means the tokenizer belongs to another model."""
    if not lm.logits_width - max(1024, lm.logits_width // 100) <= vocab <= lm.logits_width:
        raise ModelError(
            f"{role} {lm.source!r} has {lm.logits_width} output rows but the tokenizer has {vocab} "
            "tokens; the tokenizer does not belong to this model"
        )
