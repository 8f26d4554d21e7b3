"""Models with sliding-window attention layers (Gemma 2/3, Mistral-style configs), as verifier
and as draft: their cache keeps only the window, and transformers refuses to crop it once full.
Built here: tiny Gemma 3 models with a 6-token window, so every run below goes far past it."""

from __future__ import annotations

import pytest
import torch

from cactus_cli.infer.backends.torch.eager import CachedLM
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.pair.loader import load_pair
from tests.conftest import SPECIALS, WORDS, make_tokenizer
from tests.test_engine import GREEDY, prompt_ids, run

WINDOW = 6


def make_gemma(folder, seed: int, noise: float = 0.0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(SPECIALS) + len(WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        initializer_range=0.3,
    )
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        if noise:  # a perturbed copy: agrees with the original often, not always
            gen = torch.Generator().manual_seed(seed + 1000)
            for prm in model.parameters():
                prm.add_(noise * prm.std() * torch.randn(prm.shape, generator=gen))
        model.lm_head.weight[2].zero_()
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    make_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    return {"verifier": make_gemma(root / "v", 0), "draft": make_gemma(root / "d", 0, noise=0.05)}


@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_speculation_past_the_window_equals_the_verifier_alone(gemmas, k):
    """Both caches are cropped after rejections long after the window filled: the output must
    still be the verifier's own, token for token (before: transformers raised on the first
    crop past the window)."""
    pair = load_pair(gemmas["verifier"], gemmas["draft"], None, "cpu", dtype="float32")
    ids = prompt_ids(pair)
    alone = GenerationParams(sampling=GREEDY, num_draft_tokens=0, max_tokens=40, ignore_eos=True)
    want, _, _ = run(SpeculativeEngine(pair), ids, alone)
    params = GenerationParams(
        sampling=GREEDY,
        num_draft_tokens=8 if k == "auto" else k,
        adaptive_k=k == "auto",
        max_tokens=40,
        ignore_eos=True,
    )
    got, stats, _ = run(SpeculativeEngine(pair), ids, params)
    assert got == want
    if k != "auto":  # (auto drafts when its costs say so: how often depends on the machine)
        assert 0 < stats.draft_acceptance_rate < 1  # rejections happened, so crops did


def test_a_crop_below_what_the_window_kept_forgets_and_is_fed_again(gemmas):
    """Past the window, a crop further back than the last one cannot be restored: the runner
    forgets its cache (cache_len 0) and a prefill feeds the prompt again; the logits equal a
    fresh runner's."""
    pair = load_pair(gemmas["verifier"], None, None, "cpu", dtype="float32")
    seq = [(5 + 7 * i) % pair.vocab_size for i in range(30)]
    r = CachedLM(pair.verifier, pair.vocab_size)
    r.forward(seq[:20], keep=1)
    r.forward(seq[20:24], keep=4)
    r.crop(22)  # behind the newest tokens, in front of the last cut: kept
    assert r.cache_len == 22
    r.crop(12)  # further back than the window kept
    assert r.cache_len == 0
    kept = r.prefill(seq[:15], seq[:22], reuse=True)  # the prefix reuse of a chat turn
    assert kept == 0 and r.cache_len == 14
    fresh = CachedLM(pair.verifier, pair.vocab_size)
    fresh.forward(seq[:14], keep=1)
    torch.testing.assert_close(r.forward(seq[14:16], keep=2), fresh.forward(seq[14:16], keep=2))
