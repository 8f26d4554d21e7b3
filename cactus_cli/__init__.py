"""cactus: speculative decoding with the Cactus acceptance rule."""

__version__ = "0.1.0"
