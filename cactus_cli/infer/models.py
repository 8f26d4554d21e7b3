"""Model sources and loading: resolve a name (hub id, local folder, .gguf file, embedded pair),
load it with transformers on the device and dtype devices.py picks (quantized by quantize.py,
or as this rank's tensor-parallel shard), and check that draft and verifier share a tokenizer.
Loading never starts or serves a tensor-parallel group: ``tp_load_spec`` only says what every
rank loads; app/runtime.py starts the group (or, on a follower rank, serves it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cactus_cli.core import defaults
from cactus_cli.core.errors import ModelError
from cactus_cli.infer import embedded
from cactus_cli.infer.devices import (
    fastest_cpu_quantization,
    quantized_dtype,
    resolve_device,
    resolve_dtype,
    resolve_quantize,
)
from cactus_cli.infer.quantize import QualityGateFailed, quality_verdict, quantize_model
from cactus_cli.infer.smooth import CALIBRATION_TEXT
from cactus_cli.infer.tp import group
from cactus_cli.infer.vocab import CrossVocab


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel, in eval mode
    source: str  # what the user named
    path: str  # what was loaded
    device: torch.device
    dtype: torch.dtype
    context_length: int  # max positions the model supports
    logits_width: int  # rows of the output embedding (may exceed the tokenizer: padded rows)
    load_seconds: float = 0.0
    quantize: str = "none"  # weight-only quantization of the Linear layers: none, int8, int4
    tp: int = 1  # tensor-parallel ranks the model is sharded over (distributed.py)
    quantize_note: str = ""  # what the quantization ran ("int4 weights (15 layers, 1 in int8 ...)")


@dataclass
class ModelPair:
    verifier: LoadedModel
    draft: LoadedModel | None
    tokenizer: Any
    vocab_size: int  # len(tokenizer): logits are cut to this many columns
    dtype_reason: str = ""  # why this dtype (``--dtype auto`` measures on a CPU)
    cross: CrossVocab | None = None  # a draft with its own tokenizer (draft/cross.py), else None


def mlp_shape(src: "Source") -> tuple[int, int] | None:
    """(hidden, intermediate) sizes from a model's config, for the dtype probe; None if unknown."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(src.location, local_files_only=True)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        hidden = int(cfg.hidden_size)
        inter = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
        return hidden, inter
    except Exception:  # any unreadable config: fall back to the CPU flags
        return None


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    kind: str  # "folder", "gguf", "hub", "embedded"
    location: str  # folder path, gguf file path, hub id, or embedded model name


def resolve_source(name: str) -> Source:
    """Decide what ``name`` refers to, without loading it. Missing files are errors here."""
    if name.startswith("embedded:"):
        return Source("embedded", embedded.get(name.split(":", 1)[1]).name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in ("config.json", "tokenizer_config.json", "tokenizer.json")):
            raise ModelError(f"{name} is a folder but not a model folder (it has no config.json); "
                             "give a folder saved by transformers, a .gguf file or a hub id")
        return Source("folder", str(path))
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"model file {name} does not exist")
        return Source("gguf", str(path))
    if path.exists():
        raise ModelError(f"{name} is neither a model folder nor a .gguf file")
    looks_like_path = name.startswith((".", "/", "~")) or os.sep in name.strip("/").split("/", 1)[-1]
    if looks_like_path or name.count("/") > 1:
        raise ModelError(f"model folder {name} does not exist")
    if not hub_cached(name):
        # fail at once, naming both readings, instead of retrying the network for a minute
        first = Path(name.split("/", 1)[0])
        try:
            listing = ", ".join(sorted(p.name for p in first.iterdir())[:6]) or "nothing"
            as_path = f"no folder {name} (in {first}/: {listing})"
        except OSError:  # no such folder, or an unreadable one
            as_path = f"no folder {name} here"
        raise ModelError(
            f"{name!r}: {as_path}, and no Hugging Face model {name} in the local cache; fix the path, or "
            f"download the model first (`huggingface-cli download {name}`)")
    return Source("hub", name)


def hub_cached(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds a config or tokenizer of ``repo_id`` (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for filename in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        try:
            if isinstance(try_to_load_from_cache(repo_id, filename), str):
                return True
        except Exception:  # an invalid repo id: not cached
            return False
    return False


def materialize(src: Source, reporter=None) -> Source:
    """Embedded models and .gguf files are converted once to a cached safetensors folder;
    everything else is loaded as it is."""
    if src.kind == "embedded":
        return Source("folder", str(embedded.prepare_embedded(src.location, reporter)))
    if src.kind == "gguf":
        return Source("folder", str(embedded.prepare_gguf(src.location, reporter)))
    return src


def _from_pretrained(loader, src: Source, what: str, **kwargs):
    """Call a transformers from_pretrained, turning 'not found / offline' into one clear line."""
    location = src.location
    try:
        if src.kind == "hub":
            kwargs["local_files_only"] = True  # hub ids come from the local cache: no network round trips
        return loader.from_pretrained(location, **kwargs)
    except (OSError, ValueError) as err:
        # the whole message on one line (transformers' first line often ends in a colon)
        first = " ".join(str(err).split())[:400] or type(err).__name__
        if src.kind == "hub":
            offline = os.environ.get("HF_HUB_OFFLINE") == "1"
            hint = (
                "HF_HUB_OFFLINE=1 is set, so only the local Hugging Face cache was searched"
                if offline
                else "it is not in the local Hugging Face cache and the hub could not be reached"
            )
            raise ModelError(
                f"could not load {what} {src.location!r} from the Hugging Face hub: {hint}; "
                f"download it with `huggingface-cli download {src.location}` or pass a local folder ({first})"
            ) from None
        raise ModelError(f"could not load {what} from {src.location}: {first}") from None


def load_tokenizer(src: Source):
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, src, "tokenizer")


def load_model(name: str, src: Source, device: torch.device, dtype: torch.dtype, role: str = "model",
               quantize: str = "none", reporter=None, tp: int = 1, calibration: list[int] | None = None,
               gate: float | None = None) -> LoadedModel:
    """Load ``src`` (already materialized: a folder or a hub id); ``name`` is what the user called
    it. ``quantize`` int8 / int4 / w8a8 replaces every Linear by its quantized version (``gate``:
    a w8a8 that costs more than that many nats/token on ``calibration`` becomes int8);
    ``tp`` > 1 loads this rank's shard (every rank of the group calls this together)."""
    import time

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress display says what is loading
    hf_logging.set_verbosity_error()
    t0 = time.perf_counter()
    if tp > 1:
        from transformers import DistributedConfig

        model = _from_pretrained(AutoModelForCausalLM, src, f"{role} model", dtype=dtype,
                                 distributed_config=DistributedConfig(tp_plan="auto"))
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
    return LoadedModel(model, name, src.location, device, dtype, ctx, width, time.perf_counter() - t0, quantize, tp,
                       note)


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
    lm = load_model(load["location"], src, torch.device(load["device"]), getattr(torch, load["dtype"]), "verifier",
                    tp=group.rank_and_world()[1])
    return lm, int(load["vocab"])


def _draft_tokenizer(tok: Any, dsrc: Source | None, cross_vocab: str, draft: str) -> Any:
    """The draft's own tokenizer when its vocabulary differs from ``tok`` (it drafts across
    vocabularies), else None. With --tokenizer (``dsrc`` None) both use that one."""
    dtok = load_tokenizer(dsrc) if dsrc is not None else None
    if dtok is not None and dtok.get_vocab() == tok.get_vocab():
        dtok = None
    if dtok is None and cross_vocab != "auto":
        raise ModelError(f"--cross-vocab {cross_vocab}: draft {draft!r} shares the verifier's vocabulary; "
                         "drop --cross-vocab (it applies to a draft with another tokenizer)")
    return dtok


def _own_tokenizer(src: Source | None):
    """The tokenizer a model folder ships, or None (a bare converted model, a hub id without one)."""
    if src is None or src.kind != "folder":
        return None
    folder = Path(src.location)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
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
        return "int8", (f"quantize auto: int8, w8a8 measured {verdict:+.3f} nats/token on this model "
                        f"(more than {defaults.QUALITY_TOLERANCE:g})"), None
    return "w8a8", f"quantize auto: w8a8, {why}; {verdict:+.3f} nats/token on this model", None


def tp_plan(tp: int, vsrc: Source, verifier: str, dev: torch.device, dtype: str, quantize: str,
            vocab: int) -> tuple[dict[str, Any], torch.dtype, str]:
    """Check --tp against the verifier and pick the dtype: (what every rank loads, dtype, why).
    No side effects: rank 0 then starts the group, a follower rank serves it (app/runtime.py)."""
    from transformers import AutoConfig

    if quantize not in ("none", "auto"):
        raise ModelError(f"--quantize {quantize} does not combine with --tp yet; use one or the other")
    try:
        config = AutoConfig.from_pretrained(vsrc.location, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelError(f"could not read the verifier's config from {vsrc.location}: {err}") from None
    group.check_tp(tp, config, dev, verifier)
    if dev.type == "cuda" and dev.index not in (None, 0):
        raise ModelError(f"--device {dev} with --tp: rank r runs on cuda:r and the draft beside rank 0 on cuda:0; "
                         "use --device cuda (choose the GPUs with CUDA_VISIBLE_DEVICES)")
    if dev.type == "cpu":
        if dtype not in ("auto", "float32"):
            raise ModelError(f"--tp on a CPU reduces over gloo in float32; use --dtype float32 (or auto), not {dtype}")
        dt, why = torch.float32, "tensor parallel over gloo (CPU) reduces in float32"
    else:
        dt, why = resolve_dtype(dtype, dev)
    load = {"kind": vsrc.kind, "location": vsrc.location, "device": str(dev), "dtype": str(dt).removeprefix("torch."),
            "vocab": vocab}
    return load, dt, why


def tp_load_spec(verifier: str, tokenizer: str | None, device: str, dtype: str, quantize: str, tp: int) -> dict[str, Any]:
    """What a follower rank loads (the verifier's shard), found the way rank 0 finds it."""
    vsrc = materialize(resolve_source(verifier))
    tok = load_tokenizer(materialize(resolve_source(tokenizer)) if tokenizer else vsrc)
    return tp_plan(tp, vsrc, verifier, resolve_device(device), dtype, quantize, len(tok))[0]


def load_pair(verifier: str | None, draft: str | None, tokenizer: str | None, device: str, dtype: str,
              reporter=None, quantize: str = "none", tp: int = 1, cross_vocab: str = "auto") -> ModelPair:
    """Load verifier, optional draft and the shared tokenizer (the verifier's unless ``tokenizer``
    names another source). A draft with another vocabulary drafts across vocabularies by
    ``cross_vocab`` (auto, string, intersection: draft/cross.py). Sources are all resolved
    first, so a missing one fails before any load."""
    if not verifier:
        raise ModelError("no verifier model: pass --verifier (hub id, folder or .gguf) or use a --profile that names one")
    dev = resolve_device(device)
    vsrc = resolve_source(verifier)
    dsrc = resolve_source(draft) if draft is not None else None
    tsrc = resolve_source(tokenizer) if tokenizer else None
    if reporter is not None:
        reporter.task(f"loading verifier {verifier}")
    vsrc = materialize(vsrc, reporter)
    tok = load_tokenizer(materialize(tsrc, reporter) if tsrc else vsrc)
    if tsrc is not None:  # the shared-vocabulary check holds whatever the tokenizer's source
        for src, name in ((vsrc, verifier), (materialize(dsrc, reporter) if dsrc else None, draft)):
            own = _own_tokenizer(src)
            if own is not None:
                check_same_vocab(own, tok, name, tokenizer, what=f"--tokenizer {tokenizer!r} and model {name!r}")
    if tp > 1:
        load, dt, why = tp_plan(tp, vsrc, verifier, dev, dtype, quantize, len(tok))
        if reporter is not None:
            reporter.task(f"starting {tp} tensor-parallel ranks")
        group.start(tp, dev, load)
        quantize, gate = "none", None
    else:
        quantize, qwhy, gate = choose_quantize(quantize, dev, dtype, vsrc)
        if quantize != "none":
            dt, why = quantized_dtype(quantize, dtype, dev)
            why = f"{qwhy}; {why}" if qwhy else why
        else:
            dt, why = resolve_dtype(dtype, dev, mlp_shape(vsrc) if dtype == "auto" and dev.type == "cpu" else None)
    calibration = list(tok(CALIBRATION_TEXT)["input_ids"]) if quantize == "w8a8" else None  # (smooth.py)
    vm = load_model(verifier, vsrc, dev, dt, "verifier", quantize, reporter, tp, calibration,
                    gate if quantize == "w8a8" else None)
    _check_rows(vm, "verifier", len(tok))
    pair = ModelPair(vm, None, tok, len(tok), why)
    if draft is None:
        return pair
    if reporter is not None:
        reporter.task(f"loading draft {draft}")
    return with_draft(pair, draft, reporter, cross_vocab, own_tokenizer=tsrc is None)


def with_draft(pair: ModelPair, draft: str, reporter=None, cross_vocab: str = "auto",
               own_tokenizer: bool = True) -> ModelPair:
    """``pair`` with a draft model (bench compares several on one verifier in memory): on the
    verifier's device (rank 0's under --tp, where acceptance is decided), in its dtype and
    quantization (int8 if the verifier's w8a8 failed its quality gate). With ``own_tokenizer``
    a draft whose vocabulary differs drafts across vocabularies by ``cross_vocab``."""
    vm, tok = pair.verifier, pair.tokenizer
    dsrc = materialize(resolve_source(draft), reporter)
    dtok = _draft_tokenizer(tok, dsrc if own_tokenizer else None, cross_vocab, draft)
    quantize = vm.quantize if vm.tp == 1 else "none"
    calibration = list((dtok or tok)(CALIBRATION_TEXT)["input_ids"]) if quantize == "w8a8" else None
    dm = load_model(draft, dsrc, vm.device, vm.dtype, "draft", quantize, reporter, 1, calibration)
    cross = None
    if dtok is not None:
        cross = CrossVocab.build(dtok, tok, dm.logits_width, vm.logits_width, cross_vocab, draft, vm.source)
    else:
        _check_rows(dm, "draft", pair.vocab_size)
    return ModelPair(vm, dm, tok, pair.vocab_size, pair.dtype_reason, cross)


def _check_rows(lm: LoadedModel, role: str, vocab: int) -> None:
    """Padded output rows are a few hundred at most (Qwen2.5: 271); far fewer tokens than rows
    means the tokenizer belongs to another model."""
    if not lm.logits_width - max(1024, lm.logits_width // 100) <= vocab <= lm.logits_width:
        raise ModelError(f"{role} {lm.source!r} has {lm.logits_width} output rows but the tokenizer has {vocab} "
                         "tokens; the tokenizer does not belong to this model")
