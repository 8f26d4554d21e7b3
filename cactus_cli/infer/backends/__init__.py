"""What runs a model, one folder per backend holding all of it: torch/ (transformers models, its
runners, the --tp group, quantized weights), llama_cpp/ (GGUF files on llama.cpp's kernels, its
runner, the GGUF layout), vllm/ (vLLM's own engine and cactus's plugin inside it). base.py is the
``Backend`` interface every one implements; registry.py (``BACKENDS``, ``backend_of``, ``choose``)
is the only module that imports them all. The backends never import one another, and this file
imports nothing, so vLLM's processes, which load backends/vllm/plugin.py, load no other backend."""
