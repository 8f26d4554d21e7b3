"""The torch backend, all of it: the backend (backend.py: transformers models on the device and
dtype load/devices.py picks), its runners behind infer/runner.py's ``Runner`` (eager.py:
``CachedLM``, eager calls over a dynamic KV cache; compiled.py: ``CompiledLM``, a static cache and
fixed-shape compiled steps, CUDA graphs on CUDA; sharded.py: ``ShardedRunner``, rank 0's
tensor-parallel shard announcing every call to the other ranks), the tensor-parallel process
group (group.py) and its quantized weights (quant/)."""
