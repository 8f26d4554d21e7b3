"""Tiny model pairs built in-process (random weights from small Llama/Qwen2 configs) and a tiny
word-level tokenizer, saved to temp folders so the real loading path runs. User directories
are isolated through CACTUS_HOME."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

WORDS = (
    "the a cat dog sat on mat ran fast slow and then it was very happy sad big small red blue green "
    "tree house car road sun moon star sky sea fish bird sang flew swam ate drank slept woke up down "
    "left right one two three four five six seven eight nine ten"
).split()
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def make_tokenizer(folder: Path, extra_words: tuple[str, ...] = (), chat_template: bool = True):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + list(WORDS) + list(extra_words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def make_model(
    folder: Path,
    family: str,
    seed: int,
    vocab: int,
    layers: int = 2,
    max_pos: int = 512,
    noise: float = 0.0,
    hidden: int = 64,
    heads: int = 4,
) -> Path:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=max_pos,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        initializer_range=0.3,  # peaky logits: no near-ties to flip argmax between cached and full passes
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():
        if noise:  # a perturbed copy: agrees with the original often, not always
            gen = torch.Generator().manual_seed(seed + 1000)
            for prm in model.parameters():
                prm.add_(noise * prm.std() * torch.randn(prm.shape, generator=gen))
        model.lm_head.weight[2].zero_()  # EOS logit pinned to 0, so random models rarely stop at once
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    return folder


def make_byte_pair(root: Path, max_pos: int = 512, chat_template: str | None = None) -> dict[str, str]:
    """A tiny pair over a byte-level BPE tokenizer (trained here on JSON-like text): every character
    is a token, so a JSON grammar can be kept. {"verifier": folder, "draft": folder}."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [json.dumps({"animal": a, "n": n}) for a in ("cat", "dog", "bird") for n in range(10)] * 20
    tok.train_from_iterator(texts + ["the cat sat on the mat and the dog ran fast"] * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    out = {}
    for name, seed, noise in (("verifier", 10, 0.0), ("draft", 10, 0.05)):
        make_model(root / name, "llama", seed, len(fast), max_pos=max_pos, noise=noise)
        fast.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, str]:
    """Folders: verifier (Llama), draft (Qwen2, other weights: disagrees often), draft_close (the
    verifier with noise: agrees often), draft_padded (more output rows than tokens, like Qwen pairs),
    odd_vocab (a different tokenizer), short_context (16 positions)."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    vocab = len(SPECIALS) + len(WORDS)
    for name, family, seed, rows in (
        ("verifier", "llama", 0, vocab),
        ("draft", "qwen2", 1, vocab),
        ("draft_padded", "qwen2", 2, vocab + 12),
    ):
        folder = root / name
        make_model(folder, family, seed, rows)
        make_tokenizer(folder)
        out[name] = str(folder)
    close = root / "draft_close"
    make_model(close, "llama", 0, vocab, noise=0.03)
    make_tokenizer(close)
    out["draft_close"] = str(close)
    odd = root / "odd_vocab"
    make_model(odd, "qwen2", 3, vocab + 2)
    make_tokenizer(odd, extra_words=("zebra", "yak"))
    out["odd_vocab"] = str(odd)
    short = root / "short_context"
    make_model(short, "llama", 0, vocab, max_pos=16)
    make_tokenizer(short)
    out["short_context"] = str(short)
    return out


@pytest.fixture(scope="session", autouse=True)
def session_home(tmp_path_factory):
    """Module- and session-scoped fixtures run before the per-test home below is set: they
    write (cost and quantization caches) here, never in the user's ~/.cache/cactus."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CACTUS_HOME", str(tmp_path_factory.mktemp("session_home")))
        yield


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CACTUS_HOME", str(tmp_path / "cactus_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "cactus_home"


# Under CI (CI=true, as .ci/run and a fresh clone run the suite) a skip hides a missing install step:
# it fails instead, unless it is for something CI cannot have (these reasons, nothing else).
SKIPS_ALLOWED_IN_CI = ("needs a CUDA GPU",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail")):
        return
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
    if not any(allowed in reason for allowed in SKIPS_ALLOWED_IN_CI):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI ({reason}): what the test needs must come with the README's test command"


# ---------------------------------------------------------------------- vLLM (test_vllm.py, test_vllm_cli.py)


@pytest.fixture(scope="session")
def tiny_vllm_pair(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama verifier and a close draft (the verifier with noise) that vLLM's CPU attention
    takes: head_dim 64 (it refuses 16)."""
    root = tmp_path_factory.mktemp("tiny_vllm")
    vocab = len(SPECIALS) + len(WORDS)
    out = {}
    for name, noise in (("verifier", 0.0), ("draft", 0.05)):
        folder = root / name
        make_model(folder, "llama", 0, vocab, noise=noise, hidden=128, heads=2)
        make_tokenizer(folder)
        out[name] = str(folder)
    return out


@pytest.fixture(scope="session")
def llm(tiny_vllm_pair):
    """One vLLM engine for the session (test_vllm.py and test_vllm_cli.py; a start takes ~60 s on 2
    cores): in this process, so the plugin loaded here is the one its worker runs."""
    pytest.importorskip("vllm", reason="vLLM is not installed (the vllm extra)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        engine = LLM(
            model=tiny_vllm_pair["verifier"],
            speculative_config={"method": "draft_model", "model": tiny_vllm_pair["draft"], "num_speculative_tokens": 4},
            max_model_len=256,
            dtype="float32",
            enforce_eager=True,
            disable_log_stats=False,
            per_request_spec_decode_metrics="detailed",  # (what cactus's --backend vllm reads)
            seed=0,
            gpu_memory_utilization=0.1,
            enable_prefix_caching=False,  # (a cached prefix changes the steps, so a seed's draws, between calls)
        )
    yield engine  # (the variables above were read when it started: no other test sees them)


# ---------------------------------------------------------------------- several workers (pytest-xdist)
# The README's test command runs one worker per core (pyproject's addopts: -n auto --dist loadgroup).
# A module is one unit of work, so its module fixtures are built once; the vLLM files are one unit (one
# engine start); each test of FIRST[0] runs alone, but those that run on every core as the README's command
# does (fixture readme_cores) run one after another in one unit, so they spin against at most one pinned
# worker, never against each other. FIRST: slow units (pytest --durations on 2 cores; the
# embedded pair's tests take 30 to 170 s each), handed out before the rest, so no worker is left with a
# long one at the end.
SHARED_UNITS = {"test_vllm_cli": "test_vllm"}
FIRST = (
    "test_smoke_embedded",
    "test_tp",
    "test_llama_cpp",
    "test_grammar",
    "test_vllm",
    "test_eval_code",
    "test_lm_eval",
)


def unit_of(item) -> tuple[str, str]:
    """(the unit a test runs in, the module that names it)."""
    module = item.module.__name__.rpartition(".")[2]
    module = SHARED_UNITS.get(module, module)
    if module != FIRST[0]:
        return module, module
    return (module + "[every core]" if "readme_cores" in item.fixturenames else item.nodeid), module


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(unit_of(item)[0]))
    order = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: order.get(unit_of(item)[1], len(FIRST)))  # (stable: the rest as collected)


def pytest_configure(config):
    """Each worker its own share of the cores (gw0 the first, gw1 the second, ...), for torch's
    threads, llama.cpp's (its default is the affinity mask) and the subprocesses it starts: two
    workers each running a thread per core spin against each other (OpenMP and ggml wait busily),
    slower than one worker alone. ``CACTUS_TESTS_CPUS`` keeps the whole set, for a subprocess that
    must run as the README's commands run (test_smoke_embedded: the user's cost and plan caches are
    keyed by thread count, so a pinned run would measure everything again)."""
    workers, worker = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), os.environ.get("PYTEST_XDIST_WORKER")
    if workers > 1 and worker and hasattr(os, "sched_setaffinity"):
        cpus, i = sorted(os.sched_getaffinity(0)), int(worker.removeprefix("gw"))
        os.environ["CACTUS_TESTS_CPUS"] = ",".join(map(str, cpus))
        mine = set(cpus[i::workers]) or {cpus[i % len(cpus)]}
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))
