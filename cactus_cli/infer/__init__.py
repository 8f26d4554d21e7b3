"""Layer 2: models and decoding, imported in one direction, bottom to top (tests/test_layout.py:
INFER_ORDER): load/ (what a model is, its files, devices), runner.py (the Runner interface), draft/
and kpolicy/ (drafters; choosing k), backends/ (base.py, one folder a backend: torch/, llama_cpp/,
vllm/, and registry.py), pair/ (choosing and loading a pair), decode/ (the engine, slots, grammar,
text)."""
