"""Tiny GGUF files written in-process (the ``gguf`` package): a Qwen2-architecture model with random
weights and a byte-level BPE vocabulary of 256 bytes, a few merges and Qwen's chat tokens, so the
llama.cpp backend's tests load a real GGUF in well under a second, and transformers can read the
same file (its tokenizer, and the torch backend's weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [
    "t h",
    "th e",
    "Ġ t",
    "Ġt h",
    "Ġth e",
    "a t",
    "Ġ c",
    "Ġc at",
    "Ġ s",
    "Ġs at",
    "o n",
    "Ġ on",
    "Ġ m",
    "Ġm at",
    "a n",
    "an d",
    "Ġ an",
    "Ġan d",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokens() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    spelled = dict(zip(bs, (chr(c) for c in cs)))
    return [spelled[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    """(tokens, token types): bytes, merged tokens (normal, 1), then the control tokens (3)."""
    tokens = byte_tokens()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    types = [1] * len(tokens) + [3] * len(SPECIALS)
    return tokens + SPECIALS, types


def write_tiny_gguf(
    path: Path,
    seed: int = 0,
    noise: float = 0.0,
    context: int = 512,
    layers: int = 2,
    architecture: str = "qwen2",
    dtype=np.float32,
    q4_0: bool = False,
) -> Path:
    """A tiny Qwen2 GGUF. ``noise`` perturbs the same weights (a draft that agrees often);
    ``architecture`` other than qwen2 writes a file llama.cpp does not know; ``q4_0``: the layers'
    matmul weights in Q4_0 (what llama.cpp's CPU repack has kernels for)."""
    import gguf

    tokens, types = vocabulary()
    vocab, hidden, ffn, heads, kv_heads = len(tokens), 64, 128, 4, 2
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    jitter = np.random.default_rng(seed + 1000)

    def w(*shape: int, scale: float = 0.3) -> np.ndarray:
        x = rng.standard_normal(shape).astype(np.float32) * scale
        if noise:
            x += noise * x.std() * jitter.standard_normal(shape).astype(np.float32)
        return x.astype(dtype) if len(shape) > 1 else x  # (norms and biases stay float32)

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny-qwen2")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == np.float32 else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    eos = tokens.index("<|im_end|>")
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", w(vocab, hidden))
    if q4_0:
        plain_tensor = writer.add_tensor

        def add_tensor(name: str, x: np.ndarray) -> None:
            if name.endswith(
                (
                    "attn_q.weight",
                    "attn_k.weight",
                    "attn_v.weight",
                    "_output.weight",
                    "ffn_gate.weight",
                    "ffn_up.weight",
                    "ffn_down.weight",
                )
            ):
                qtype = gguf.GGMLQuantizationType.Q4_0
                plain_tensor(name, gguf.quants.quantize(x.astype(np.float32), qtype), raw_dtype=qtype)
            else:
                plain_tensor(name, x)

        writer.add_tensor = add_tensor
    for i in range(layers):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(b + "attn_q.weight", w(hidden, hidden))
        writer.add_tensor(b + "attn_q.bias", w(hidden, scale=0.05))
        writer.add_tensor(b + "attn_k.weight", w(kv_heads * head_dim, hidden))
        writer.add_tensor(b + "attn_k.bias", w(kv_heads * head_dim, scale=0.05))
        writer.add_tensor(b + "attn_v.weight", w(kv_heads * head_dim, hidden))
        writer.add_tensor(b + "attn_v.bias", w(kv_heads * head_dim, scale=0.05))
        writer.add_tensor(b + "attn_output.weight", w(hidden, hidden))
        writer.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(b + "ffn_gate.weight", w(ffn, hidden))
        writer.add_tensor(b + "ffn_up.weight", w(ffn, hidden))
        writer.add_tensor(b + "ffn_down.weight", w(hidden, ffn))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    head = w(vocab, hidden)
    head[eos] = 0  # EOS logit pinned to 0, so random models rarely stop at once
    writer.add_tensor("output.weight", head)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
