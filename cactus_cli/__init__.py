"""cactus: speculative decoding with the Cactus acceptance rule."""

__version__ = "0.1.0"

from cactus_cli.core.companions import hide_broken_companions as _hide

_hide()  # (a CUDA-built torchvision beside the CPU torch would stop every import of transformers)
