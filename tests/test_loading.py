"""Loading models: sources, tokenizers that belong to another model, hub ids and paths, damaged files."""

from __future__ import annotations

import struct

import pytest

from tests.helpers import assert_one_line_error, invoke, pair_args


def test_truncated_gguf_is_a_one_line_error(tmp_path, tiny):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 10, 5) + b"\x05\x00")  # valid header start, then nothing
    assert_one_line_error(invoke("models", "prepare", gguf), "not a readable GGUF file")
    assert_one_line_error(
        invoke(
            "generate", "hi", "--verifier", gguf, "--tokenizer", tiny["verifier"], "--draft", "none", "--device", "cpu"
        ),
        "not a readable GGUF file",
    )


def test_tokenizer_from_another_model_is_rejected(tiny):
    r = invoke("generate", "hi", *pair_args(tiny), "--tokenizer", tiny["odd_vocab"])
    assert_one_line_error(r, "do not share a vocabulary")


def test_unknown_hub_id_and_mistyped_path_fail_fast(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    r = invoke("generate", "hi", "--verifier", "no-such-org/no-such-model", "--draft", "none")
    assert_one_line_error(r, "no Hugging Face model no-such-org/no-such-model in the local cache")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "verifier").mkdir()
    monkeypatch.chdir(tmp_path)
    r = invoke("generate", "hi", "--verifier", "tiny/verifer", "--draft", "none")
    assert_one_line_error(r, "no folder tiny/verifer (in tiny/: verifier)")


def _broken(tmp_path, tiny, how):
    import json
    import shutil

    folder = tmp_path / how
    shutil.copytree(tiny["verifier"], folder)
    weights = folder / "model.safetensors"
    config = folder / "config.json"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "pickle":
        weights.unlink()
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 never unpickled")
    elif how == "not-json":
        config.write_text("{ not json")
    elif how == "unknown-architecture":
        doc = json.loads(config.read_text())
        config.write_text(json.dumps({**doc, "model_type": "foo", "architectures": ["FooForCausalLM"]}))
    elif how == "mistyped":
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": "big"}))
    return folder


@pytest.mark.parametrize(
    "how, needle",
    [
        ("truncated", "truncated or corrupt"),
        ("pickle", "pickle checkpoint (pytorch_model.bin)"),
        ("not-json", "config.json is not valid JSON"),
        ("unknown-architecture", "does not know (model_type 'foo'"),
        ("mistyped", "hidden_size"),
    ],
)
def test_a_model_folder_that_does_not_load_is_one_line_naming_it(tmp_path, tiny, how, needle):
    from tests.helpers import assert_one_line_error, invoke

    folder = _broken(tmp_path, tiny, how)
    r = invoke("generate", "hi", "--verifier", folder, "--draft", "ngram", "--device", "cpu", "-n", "2")
    assert_one_line_error(r, needle)
    assert str(folder) in r.output


def test_a_load_reads_each_tokenizer_and_the_cost_store_once(tiny, monkeypatch):
    """The plan compares vocabularies, the backend sizes the vocabulary, the loader hands the
    tokenizer on, the plan and the engine both read the cost store: each file is read once per load,
    and read again by the next load (nothing outlives one)."""
    from collections import Counter
    from pathlib import Path

    import transformers

    from cactus_cli.api import Session
    from cactus_cli.core.paths import cache_dir

    Session.load(None, verifier=tiny["verifier"], draft=tiny["draft"], device="cpu", quantize="none").text(
        "the cat sat", max_tokens=8
    )  # the first run saves what steps cost: the next load has a store to read
    reads: Counter = Counter()
    real_tok, real_read = transformers.AutoTokenizer.from_pretrained.__func__, Path.read_text

    def tokenizer(cls, name, *a, **k):
        reads[str(name)] += 1
        return real_tok(cls, name, *a, **k)

    def read_text(self, *a, **k):
        if self.parent == cache_dir() / "costs":
            reads[self.name] += 1
        return real_read(self, *a, **k)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(tokenizer))
    monkeypatch.setattr(Path, "read_text", read_text)
    for loads in (1, 2):
        Session.load(None, verifier=tiny["verifier"], draft=tiny["draft"], device="cpu", quantize="none")
        assert reads[tiny["verifier"]] == reads[tiny["draft"]] == loads, reads
        stores = [n for n in reads if n.endswith(".json") and "-" not in n]  # (the pair's store, not a choice's)
        assert stores and all(reads[n] == loads for n in stores), reads
