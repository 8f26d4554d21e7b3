"""Model runners: every way cactus calls a model, behind one interface (base.py: ``Runner``).

- ``CachedLM`` (eager.py): transformers, eager calls, a dynamic KV cache.
- ``CompiledLM`` (compiled.py): transformers, a static cache and fixed-shape compiled steps (CUDA graphs on CUDA).
- ``ShardedRunner`` (sharded.py): rank 0's tensor-parallel shard, announcing every call to the other ranks.
- ``LlamaCppRunner`` (infer/backends/llama_cpp/runner.py): a GGUF file on llama.cpp's CPU kernels.

A loaded model's backend picks its runner (infer/backends/: ``Backend.runner``).
"""
