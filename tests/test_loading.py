"""Loading models: sources, tokenizers that belong to another model, hub ids and paths, damaged files."""

from __future__ import annotations

import struct

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
