"""Loading, decided up front and done in one pass: what a model name refers to (sources), the load plan
(plan), the loader (loader), the embedded pair and its GGUF files (embedded), devices and dtypes
(devices), two vocabularies side by side (vocab). llama.cpp's own GGUF loading: backends/llama_cpp/."""
