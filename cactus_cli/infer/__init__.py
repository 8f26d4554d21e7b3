"""Layer 2: models and decoding. Folders: load/ (plan and load a pair), decode/ (the engine, slots,
grammar, text), kpolicy/ (choosing k), runners/, backends/, draft/, quant/, tp/, vllm/ (the vLLM plugin)."""
