"""The vLLM backend, all of it: the backend (backend.py), generate's and bench's requests handed to
vLLM's offline engine (offline.py), and cactus inside vLLM: the plugin (plugin.py, vLLM's
``vllm.general_plugins`` entry point), the one transform it applies, the target rows of the
rejection step (rows.py), and the start-up hook of vLLM's child processes (site/). The plugin
imports only core/ and torch (backends/__init__.py imports nothing), so vLLM's processes load no
more of cactus than that."""
