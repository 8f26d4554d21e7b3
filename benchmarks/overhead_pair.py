"""Write a random-weight model pair whose forward time is per-layer overhead, as on a GPU at
batch 1: many layers, tiny width (hidden 64), a word-level tokenizer over the built-in prompts.
On such a pair `--compile on` shows what compiling removes, on any CPU:

    python benchmarks/overhead_pair.py /tmp/overhead
    cactus bench --verifier /tmp/overhead/verifier --draft /tmp/overhead/draft --device cpu \
        --dtype float32 --compile off,on --rules sps -k 4 -t 0 --limit 4 -n 64

The draft is the verifier's embeddings, first layers and head with a little noise, and the
verifier's later layers add only small updates to the residual stream, so the two agree often
enough for speculation to have something to accept (every layer still costs a full forward).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch


def tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from cactus_cli.app.prompts import BUILTIN_PROMPTS

    words = sorted({w for p in BUILTIN_PROMPTS for w in re.findall(r"\w+|[^\w\s]", p.prompt)})
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<pad>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)
    return len(vocab)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, nargs=2, default=(28, 12), metavar=("VERIFIER", "DRAFT"))
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = tokenizer(args.out / "verifier")
    tokenizer(args.out / "draft")
    torch.manual_seed(0)

    def config(layers: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
            tie_word_embeddings=False,
            initializer_range=0.3,
        )

    verifier = LlamaForCausalLM(config(args.layers[0])).eval()
    draft = LlamaForCausalLM(config(args.layers[1])).eval()
    with torch.no_grad():
        verifier.lm_head.weight[2].zero_()  # no early EOS
        for layer in verifier.model.layers[args.layers[1] :]:
            layer.self_attn.o_proj.weight.mul_(0.02)
            layer.mlp.down_proj.weight.mul_(0.02)
        state = {k: v for k, v in verifier.state_dict().items() if k in draft.state_dict()}
        draft.load_state_dict(state)
        for prm in draft.parameters():
            prm.add_(0.02 * prm.std() * torch.randn_like(prm))
    for model, name in ((verifier, "verifier"), (draft, "draft")):
        model.generation_config.eos_token_id = 2
        model.save_pretrained(args.out / name)
    print(
        f"wrote {args.out}/verifier ({args.layers[0]} layers) and {args.out}/draft ({args.layers[1]} layers), "
        f"hidden {args.hidden}, vocabulary {vocab}"
    )


if __name__ == "__main__":
    main()
