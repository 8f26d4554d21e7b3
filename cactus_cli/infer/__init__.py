"""Layer 2: models and decoding: loading, runners, drafters, the k policy, the engine, quantization, tensor parallelism."""
