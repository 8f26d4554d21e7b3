"""The llama.cpp backend, all of it: the backend (backend.py), the runner over one GGUF model's
cache (runner.py), the bindings and a loaded GGUF model (gguf.py), and the weight types and
threads chosen by measurement (gguf_layout.py)."""
