"""The bottom of infer/: what a model is and where its files are (sources: a name resolved to its
files, a loaded model, a pair), the embedded pair and its one-time GGUF caches (embedded), what a
device holds and runs fastest (devices), two vocabularies side by side (vocab). It imports core/
alone; choosing and loading a pair through a backend is pair/ (plan, loader), and llama.cpp's own
GGUF loading is backends/llama_cpp/."""
