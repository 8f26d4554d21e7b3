"""What a model name refers to and what a loaded model is: ``Source`` (hub id, local folder, .gguf
file, embedded model), resolved without loading anything; the files each backend loads from it
(a safetensors folder for torch, the GGUF itself for llama.cpp); ``LoadedModel`` and
``ModelPair``, the records every runner and command reads; and tokenizer loading."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cactus_cli.core.errors import ModelError
from cactus_cli.core.once import once
from cactus_cli.infer.load import embedded
from cactus_cli.infer.load.vocab import CrossVocab


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
    tp: int = 1  # tensor-parallel ranks the model is sharded over (infer/backends/torch/group.py)
    quantize_note: str = ""  # what the quantization ran ("int4 weights (15 layers, 1 in int8 ...)", a GGUF's types)
    backend: str = "torch"  # what runs it (backends/): torch (a transformers model), llama.cpp (a GGUFModel)
    threads: int | None = None  # CPU threads of its backend's own (llama.cpp), None: torch's


@dataclass
class ModelPair:
    verifier: LoadedModel
    draft: LoadedModel | None
    tokenizer: Any
    vocab_size: int  # len(tokenizer): logits are cut to this many columns
    dtype_reason: str = ""  # why this dtype (``--dtype auto`` measures on a CPU)
    cross: CrossVocab | None = None  # a draft with its own tokenizer (draft/cross.py), else None
    backend_reason: str = ""  # why the verifier runs on its backend (backends.choose)
    plan: Any = None  # the LoadPlan it was loaded from (plan.py), for --json


def eos_ids(pair: ModelPair) -> set[int]:
    ids: set[int] = set()
    for source in (pair.tokenizer, getattr(pair.verifier.model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


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
            raise ModelError(
                f"{name} is a folder but not a model folder (it has no config.json); "
                "give a folder saved by transformers, a .gguf file or a hub id"
            )
        _check_folder(path, name)
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
            f"download the model first (`huggingface-cli download {name}`)"
        )
    return Source("hub", name)


PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")  # pickle checkpoints: never unpickled


def _check_folder(path: Path, name: str) -> None:
    """A model folder's config.json must be a JSON object, and its weights safetensors: a pickle
    checkpoint (pytorch_model.bin) can run code when loaded, so it is refused, not loaded."""
    config = path / "config.json"
    if config.is_file():
        try:
            doc = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
            where = f" (line {err.lineno}: {err.msg})" if isinstance(err, json.JSONDecodeError) else ""
            raise ModelError(f"model folder {name}: config.json is not valid JSON{where}; fix or replace it") from None
        if not isinstance(doc, dict):
            raise ModelError(f"model folder {name}: config.json is not a JSON object; fix or replace it")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.safetensors.index.json")):
        pickles = sorted(p.name for pattern in PICKLE_WEIGHTS for p in path.glob(pattern))
        if pickles:
            raise ModelError(
                f"model folder {name}: its weights are a pickle checkpoint ({pickles[0]}), which cactus does not "
                "load (unpickling can run code); convert it to safetensors, e.g. load it once in a trusted "
                "Python and call model.save_pretrained(folder, safe_serialization=True)"
            )


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
    """What torch loads: embedded models and .gguf files are converted once to a cached
    safetensors folder; everything else is loaded as it is."""
    if src.kind == "embedded":
        return Source("folder", str(embedded.prepare_embedded(src.location, reporter)))
    if src.kind == "gguf":
        return Source("folder", str(embedded.prepare_gguf(src.location, reporter)))
    return src


GGUF_KINDS = ("embedded", "gguf")  # the sources llama.cpp can run


def _from_pretrained(loader, src: Source, what: str, **kwargs):
    """Call a transformers from_pretrained, turning 'not found / offline' into one clear line."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its warnings are not for our users; failures are one line below
    location = src.location
    if what != "tokenizer":
        kwargs["use_safetensors"] = True  # never a pickle checkpoint (a hub cache may hold one)
    try:
        if src.kind == "hub":
            kwargs["local_files_only"] = True  # hub ids come from the local cache: no network round trips
        return loader.from_pretrained(location, **kwargs)
    except Exception as err:  # noqa: BLE001 - a folder that does not load, whatever the library raises
        # the whole message on one line (transformers' first line often ends in a colon)
        first = " ".join(str(err).split())[:400] or type(err).__name__
        if not isinstance(err, (OSError, ValueError)):
            first = f"{type(err).__name__}: {first}"
        if "does not recognize this architecture" in first or "Unrecognized model" in first:
            import transformers

            first = (
                f"config.json names an architecture transformers {transformers.__version__} does not know "
                f"({_model_type(location)}); use a supported model or a newer transformers"
            )
        elif "safetensors" in type(err).__module__ or "deserializ" in first:
            first = f"its safetensors weights are truncated or corrupt ({first})"
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


def _model_type(location: str) -> str:
    try:
        doc = json.loads((Path(location) / "config.json").read_text(encoding="utf-8"))
        return f"model_type {doc.get('model_type')!r}, architectures {doc.get('architectures')}"
    except (OSError, ValueError, AttributeError):
        return "unreadable config.json"


def load_tokenizer(src: Source):
    """``src``'s tokenizer; read once per load (``core.once``: the plan compares vocabularies, the
    backend sizes the vocabulary, the loader hands it to the engine: one read)."""
    from transformers import AutoTokenizer

    return once(("tokenizer", src), lambda: corrected(_from_pretrained(AutoTokenizer, src, "tokenizer")))


# Qwen2's and Qwen2.5's chat templates (the embedded pair's among them) show the tool-call format inside
# a string, where Jinja's braces are not special, as {{"name": <function-name>, ...}}: rendered with
# tools, the example is not JSON, and models write their calls the same broken way. (Ollama ships
# these templates corrected; Qwen3's is right.)
_DOUBLED_EXAMPLE = re.compile(r'\{\{(\\?"name\\?": <function-name>, \\?"arguments\\?": <args-json-object>)\}\}')


def corrected(tok: Any) -> Any:
    """``tok`` with a chat template known to be broken corrected (any other template as it is)."""
    templates = fixed = getattr(tok, "chat_template", None)
    if isinstance(templates, str):
        fixed = _DOUBLED_EXAMPLE.sub(r"{\1}", templates)
    elif isinstance(templates, dict):  # (named templates: "default", "tool_use")
        fixed = {name: _DOUBLED_EXAMPLE.sub(r"{\1}", t) for name, t in templates.items()}
    if fixed != templates:
        tok.chat_template = fixed
    return tok
