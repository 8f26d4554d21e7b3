"""What a GPU user meets first, proved on the CPU where a CPU can show it: the
compiled cache edited outside inference mode, CUDA's int4 shape rule, one host sync per step,
one kernel per crop, a cache sized once on CUDA, native-bf16 and compute-capability checks,
quantizing without holding two copies, the tensor-parallel command tensor and GPU placement.
Tests marked ``cuda`` need a GPU and skip without one (benchmarks/gpu_check.py runs them)."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn

from cactus_cli.core.errors import ModelError
from cactus_cli.core.sampling import SamplingParams, sample
from cactus_cli.infer.backends.torch import compiled as runners
from cactus_cli.infer.backends.torch import sharded as distributed
from cactus_cli.infer.backends.torch.compiled import CompiledLM, compile_problem
from cactus_cli.infer.backends.torch.quant import choice, quantize
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.draft import Free
from cactus_cli.infer.load import devices
from cactus_cli.infer.load.sources import Source
from cactus_cli.infer.pair.loader import load_pair
from tests.test_engine import prompt_ids

needs_compiler = pytest.mark.skipif(compile_problem(torch.device("cpu")) is not None, reason="no torch.compile here")
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def pair(tiny):
    return load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="float32")


# --------------------------------------------------------------------------- 1. inference tensors


def _static_runner(pair) -> CompiledLM:
    """A CompiledLM with its static cache allocated and no graphs (crop/reset need none)."""
    r = CompiledLM(pair.verifier, pair.vocab_size, pair.verifier.context_length, "verifier")
    r.reserve(32, ())
    return r


def test_crop_and_reset_work_outside_inference_mode_on_inference_counters(pair):
    # on CUDA each layer's length counter is `.to(device)`'d inside inference mode, so it is an
    # inference tensor; on a CPU `.to(cpu)` is a no-op. Make them so, as CUDA would.
    r = _static_runner(pair)
    with torch.inference_mode():
        for layer in r.cache.layers:
            layer.cumulative_length = layer.cumulative_length.clone()
    assert all(layer.cumulative_length.is_inference() for layer in r.cache.layers)
    ids = prompt_ids(pair)
    r.forward(ids, keep=1)
    assert not torch.is_inference_mode_enabled()
    r.crop(3)  # raised "Inplace update to inference tensor outside InferenceMode" before the fix
    assert r.cache_len == 3 and all(int(layer.cumulative_length) == 3 for layer in r.cache.layers)
    r.reset()
    assert r.cache_len == 0 and all(int(layer.cumulative_length) == 0 for layer in r.cache.layers)


# --------------------------------------------------------------------------- 5. one kernel per crop


def test_a_crop_rewinds_every_layer_in_one_foreach_call(pair, monkeypatch):
    from transformers.cache_utils import StaticLayer

    r = _static_runner(pair)
    r.forward(prompt_ids(pair), keep=1)
    calls = []
    real = torch._foreach_sub_
    monkeypatch.setattr(torch, "_foreach_sub_", lambda ts, n: (calls.append(len(ts)), real(ts, n)))
    monkeypatch.setattr(StaticLayer, "crop", lambda *a: pytest.fail("a per-layer crop ran"), raising=False)  # (5.24+)
    r.crop(2)
    assert calls == [len(r.cache.layers)]


# --------------------------------------------------------------------------- 6. cache sized once


def test_cache_plan_is_exact_on_cuda_and_capped_by_memory():
    assert runners.plan_capacity(700, 4097, cuda=False) == (1024, None)  # CPU: powers of two
    assert runners.plan_capacity(700, 600, cuda=False) == (700, None)
    assert runners.plan_capacity(32769, 40000, cuda=True) == (32769, None)  # CUDA: what the run may reach
    cap, note = runners.plan_capacity(32769, 40000, cuda=True, memory_tokens=20000)
    assert cap == 20000 and "free GPU memory" in note


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer(pair):
    cfg = pair.verifier.model.config  # 2 layers, 2 kv heads, head_dim 16
    assert runners.kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 2 * 2 * 16 * 2


def test_chat_on_cuda_reserves_the_whole_context_once(pair, monkeypatch):
    from cactus_cli.app import runtime
    from cactus_cli.app.config.settings import Settings

    asked = []
    engine = SpeculativeEngine(pair)
    monkeypatch.setattr(engine, "prepare", lambda tokens, widths, report=None, exact=True, slot=0: asked.append(tokens))
    settings = Settings(max_tokens=64)
    runtime.prepare(engine, settings, whole_context=True)  # an eager CPU engine: the usual allowance
    engine.compiled = True  # as it would be on a GPU
    engine.pair = dataclasses.replace(pair, verifier=dataclasses.replace(pair.verifier, device=torch.device("cuda")))
    runtime.prepare(engine, settings, whole_context=True)
    assert asked == [runtime.PROMPT_ALLOWANCE + 64 + 1, engine.context_length + 1]


# --------------------------------------------------------------------------- 4. host syncs per step


class _SyncCounter:
    """Counts the calls that make a host wait for a device: item, tolist, bool/int/float of a
    tensor, cpu(), numpy()."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, **kw):
                self.count += 1
                return _real(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("draft", ["model", "ngram+model"])
def test_a_sampled_step_syncs_the_host_at_most_twice(pair, monkeypatch, draft):
    engine = SpeculativeEngine(
        pair, Free("ngram", {"ngram_max": 3, "ngram_min": 1}) if draft.startswith("ngram") else None
    )
    params = GenerationParams(
        sampling=SamplingParams(temperature=1.0, top_k=0, top_p=1.0),
        rule="cactus",
        rule_kwargs={"delta": 1.0},
        num_draft_tokens=4,
        max_tokens=40,
        ignore_eos=True,
    )
    gen = engine.generate(prompt_ids(pair) * 2, params)
    next(gen)  # the prefill is outside the count
    counter = _SyncCounter(monkeypatch)
    steps, drafted = 0, 0
    for ev in gen:
        steps += 1
        drafted += ev.num_drafted
    monkeypatch.undo()
    assert steps >= 5 and drafted >= 4 * (steps - 2)  # real k = 4 steps ran
    assert counter.count <= 2 * steps, f"{counter.count} host syncs in {steps} steps"


def test_sampling_takes_no_branch_on_device_values(monkeypatch):
    counter = _SyncCounter(monkeypatch)
    dist = torch.tensor([[0.0, 0.0, 0.0], [0.2, 0.3, 0.5], [float("nan")] * 3])  # a row with no usable mass
    fallback = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    out = sample(dist, torch.Generator().manual_seed(0), fallback=fallback)
    uniform_fallback = sample(torch.zeros(2, 5), torch.Generator().manual_seed(0))
    monkeypatch.undo()
    assert counter.count == 0
    assert out[0].item() == 1 and out[2].item() == 2  # bad rows drawn from their fallback
    assert ((uniform_fallback >= 0) & (uniform_fallback < 5)).all()


def test_nan_logits_still_end_the_run_with_one_line(pair, monkeypatch):
    engine = SpeculativeEngine(pair)
    verifier = engine.slots[0].verifier
    real = verifier.forward

    def nan_forward(ids, keep):
        out = real(ids, keep)
        return out if keep == 1 and verifier.cache_len < 12 else out * float("nan")

    monkeypatch.setattr(verifier, "forward", nan_forward)
    params = GenerationParams(sampling=SamplingParams(temperature=0.0), num_draft_tokens=2, max_tokens=8)
    with pytest.raises(ModelError, match="NaN logits"):
        list(engine.generate(prompt_ids(pair), params))
    assert engine.cache_lengths()["verifier"] == 0  # dropped, not left half-updated


# --------------------------------------------------------------------------- 2. int4 on CUDA


def test_int4_shape_rule_on_cuda_needs_k_divisible_by_128():
    def lin(n, k):
        return nn.Linear(k, n, bias=False)

    assert quantize.fits("int4", lin(64, 576), "cpu") and not quantize.fits("int4", lin(64, 576), "cuda")
    assert not quantize.fits("int4", lin(64, 960), "cuda") and quantize.fits("int4", lin(64, 4096), "cuda")
    assert quantize.fits("int8", lin(64, 576), "cuda")


def test_int4_plan_keeps_layers_cuda_cannot_pack_in_int8_and_says_so(pair):
    model = pair.verifier.model  # hidden 64, intermediate 128: only down_proj (K = 128) fits CUDA's int4 packing
    plan = quantize.plan_layers(model, "int4", "cuda")
    assert {name for name, kind in plan.items() if kind == "int4"} == {
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
    }
    assert quantize.plan_layers(model, "int4", "cpu")["model.layers.0.mlp.up_proj"] == "int4"
    text = quantize.describe_plan(plan, "int4", "cuda")
    assert f"{len(plan) - 2} in int8" in text and "CUDA" in text


@cuda
@needs_cuda
def test_int4_cuda_kernel_matches_the_dequantized_reference():
    dev = torch.device("cuda")
    w = torch.randn(256, 4096)
    q, scales, mins = quantize.quantize_int4(w)
    layer = quantize.Int4Linear(q, scales, mins, None, torch.bfloat16, dev)
    x = torch.randn(5, 4096, device=dev, dtype=torch.bfloat16)
    ref = x.float() @ quantize.dequantize_int4(q, scales, mins).to(dev).T
    torch.testing.assert_close(layer(x).float(), ref, atol=0.5, rtol=0.05)


# --------------------------------------------------------------------------- 8. one copy at a time


def test_quantizing_releases_each_layer_as_it_is_replaced(tiny, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.bfloat16)
    originals = [weakref.ref(m) for m in model.modules() if isinstance(m, nn.Linear)]
    alive_at_build = []
    real_init = quantize.Int8Linear.__init__

    def watching_init(self, *args, **kwargs):
        gc.collect()
        alive_at_build.append(sum(r() is not None for r in originals))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(quantize.Int8Linear, "__init__", watching_init)
    quantize.quantize_model(model, "int8", tiny["verifier"])
    n = len(originals)
    # building layer i, the i layers replaced before it are gone: only the rest are alive
    assert alive_at_build == list(range(n, 0, -1))


def test_gpu_loading_path_streams_to_the_device_it_is_given(tiny):
    from transformers import AutoModelForCausalLM

    from cactus_cli.infer.backends.torch import backend as torch_backend

    src = Source("folder", tiny["verifier"])
    model = torch_backend._load_on_gpu(AutoModelForCausalLM, src, "verifier", torch.float32, torch.device("cpu"))
    assert next(model.parameters()).device.type == "cpu"


# --------------------------------------------------------------------------- 7. dtype and capability


def test_cuda_dtype_counts_native_bfloat16_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    dtype, why = devices.resolve_dtype("auto", torch.device("cuda"))
    assert dtype == torch.float16 and "native" in why
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert devices.resolve_dtype("auto", torch.device("cuda"))[0] == torch.bfloat16


def test_int4_on_cuda_needs_compute_capability_8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    with pytest.raises(ModelError, match="compute capability 8.0"):
        choice.quantized_dtype("int4", "auto", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert choice.quantized_dtype("int4", "auto", torch.device("cuda"))[0] == torch.bfloat16


# --------------------------------------------------------------------------- 3. inductor settings


def test_compiling_for_cuda_sets_what_gpt_fast_sets(monkeypatch):
    import torch._inductor.config as cfg

    monkeypatch.setattr(cfg, "coordinate_descent_tuning", False)
    assert runners.tune_inductor("cpu") == {} and cfg.coordinate_descent_tuning is False
    applied = runners.tune_inductor("cuda")
    assert applied["coordinate_descent_tuning"] is True and cfg.coordinate_descent_tuning is True


# --------------------------------------------------------------------------- 9. tensor parallel


@pytest.mark.parametrize("n", [0, 5, 61, 62, 300])
def test_tp_command_tensor_round_trips(n):
    ids = torch.arange(100, 100 + n)
    cmd, rest = distributed.command("forward", 7, ids if n else None)
    assert cmd.shape == (distributed.CMD_SLOTS,) and cmd.dtype == torch.int64
    op, count, arg, inline = distributed.parse_command(cmd)
    got = torch.cat([inline, rest]) if rest is not None else inline
    assert (op, count, arg) == ("forward", n, 7) and got.tolist() == ids.tolist()
    assert distributed.parse_command(distributed.command("crop", 42)[0])[:3] == ("crop", 0, 42)


def test_a_gpu_index_beyond_the_visible_ones_fails_up_front(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ModelError, match=r"only 2 GPUs visible \(cuda:0\.\.cuda:1\)"):
        devices.resolve_device("cuda:2")
    assert devices.resolve_device("cuda:1") == torch.device("cuda", 1)


def test_tp_names_its_gpu_placement(tiny, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ModelError, match="rank r runs on cuda:r and the draft beside rank 0"):
        load_pair(tiny["verifier"], tiny["draft"], None, "cuda:1", dtype="auto", tp=2)


# --------------------------------------------------------------------------- on a GPU


@cuda
@needs_cuda
@needs_compiler
def test_compiled_cuda_greedy_equals_eager_and_crops_outside_inference_mode(tiny):
    pair = load_pair(tiny["verifier"], tiny["draft_close"], None, "cuda", dtype="float32")
    ids = prompt_ids(pair)
    params = GenerationParams(
        sampling=SamplingParams(temperature=0.0), num_draft_tokens=4, max_tokens=24, ignore_eos=True
    )
    eager = [t for ev in SpeculativeEngine(pair).generate(ids, params) for t in ev.emitted]
    engine = SpeculativeEngine(pair, compiled=True)
    engine.prepare(64, {5})
    assert engine.compiled, engine.compile_note
    assert [t for ev in engine.generate(ids, params) for t in ev.emitted] == eager
    engine.slots[0].verifier.crop(3)  # outside inference mode, on inference counters
    engine.reset()
