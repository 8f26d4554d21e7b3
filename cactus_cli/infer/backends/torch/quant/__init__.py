"""Quantized weights for the torch backend: the methods and their plan (quantize.py), the quantized
layers (qlayers.py: int8 / int4 weight-only, w8a8), the on-disk cache of quantized weights
(qcache.py), SmoothQuant's migration before w8a8 (smooth.py) and the layer-by-layer quality gate
(layerwise.py). llama.cpp runs a GGUF's own types instead."""
