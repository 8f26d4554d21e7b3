"""Cactus inside vLLM: the plugin (plugin.py, vLLM's ``vllm.general_plugins`` entry point) and the one
transform it applies, the target rows of the rejection step (rows.py). Imports only core/ and torch,
so vLLM's processes load no more of cactus than that."""
