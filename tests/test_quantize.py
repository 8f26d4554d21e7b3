"""Weight-only quantization (quantize.py): round-trip error bounds, the packed kernels against
the dequantized weights, a quantized pair's greedy speculative output against its own verifier,
the on-disk cache, and the quality report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import cactus_cli.infer.backends.torch.quant.quantize as qz
from cactus_cli.cli.main import app
from cactus_cli.infer.backends.torch.quant import quantize
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.pair.loader import load_pair
from tests.helpers import invoke, quantize_tiny
from tests.test_embedded import fake_model  # noqa: F401 (a fixture: fake embedded parts)
from tests.test_engine import GREEDY, prompt_ids, run

cli = CliRunner()


@pytest.mark.parametrize("shape", [(64, 32), (256, 128), (96, 1536)])
def test_int8_round_trip_is_within_half_a_step_per_channel(shape):
    torch.manual_seed(shape[0])
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3  # channels of very different ranges
    q, scales = qz.quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (shape[0],)
    err = (qz.dequantize_int8(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-6).all()
    assert (q.abs() <= 127).all()
    assert (q.abs().amax(1) == 127).all()  # each channel's largest weight uses the full range


def test_int8_quantizes_in_chunks_as_it_would_whole_and_leaves_the_weight_alone(monkeypatch):
    """Rows are quantized a chunk at a time (a first start's peak memory): the same bytes as the
    whole-tensor formula, chunk boundaries falling mid-way included, and a float32 weight (whose
    ``.float()`` is itself) is not changed in place."""
    import cactus_cli.infer.backends.torch.quant.qlayers as ql

    monkeypatch.setattr(ql, "CHUNK", 3 * 40 + 7)  # 3 rows of 40 per chunk: 100 rows -> 34 chunks, the last short
    w = torch.randn(100, 40, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 5, 100)[:, None]
    kept = w.clone()
    want_scales = (w.abs().amax(1) / 127).clamp(min=1e-10)
    want_q = torch.round(w / want_scales[:, None]).clamp(-127, 127).to(torch.int8)
    q, scales = qz.quantize_int8(w)
    assert torch.equal(q, want_q) and torch.equal(scales, want_scales)
    assert torch.equal(w, kept)


@pytest.mark.parametrize("shape", [(64, 32), (256, 128), (96, 1536)])
def test_int4_round_trip_is_within_half_a_step_per_group(shape):
    torch.manual_seed(shape[1])
    w = torch.randn(shape) + torch.linspace(-2, 2, shape[1])  # groups with offsets: asymmetric ranges
    q, scales, mins = qz.quantize_int4(w)
    assert q.min() >= 0 and q.max() <= 15
    err = (qz.dequantize_int4(q, scales, mins) - w).abs().reshape(shape[0], -1, qz.INT4_GROUP)
    assert (err <= scales[..., None] / 2 + 1e-6).all()
    # the group's extremes are represented exactly (up to float rounding)
    g = w.reshape(shape[0], -1, qz.INT4_GROUP)
    torch.testing.assert_close(mins, g.amin(-1))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_packed_kernels_compute_the_dequantized_matmul(method):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 96, bias=True)
    w = lin.weight.detach()
    if method == "int8":
        q, s = qz.quantize_int8(w)
        layer, deq = qz.Int8Linear(q, s, lin.bias.detach(), torch.bfloat16), qz.dequantize_int8(q, s)
    else:
        q, s, m = qz.quantize_int4(w)
        layer = qz.Int4Linear(q, s, m, lin.bias.detach(), torch.bfloat16, torch.device("cpu"))
        deq = qz.dequantize_int4(q, s, m)
    for rows in (1, 5):
        x = torch.randn(2, rows, 128).to(torch.bfloat16)
        want = x.float() @ deq.t() + lin.bias.detach()
        got = layer(x).float()
        assert got.shape == (2, rows, 96)
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)  # bfloat16 activations and scales


def test_w8a8_matches_the_dequantized_matmul_and_rows_never_see_each_other():
    """Per-row activation scales: a row's output is bit-identical whatever else is in the call
    (a token verified among drafts gets the logits it gets alone), and close to the dequantized
    weights times the activations (7-bit activations per row, int8 weights per channel)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 96, bias=True)
    q, s = qz.quantize_int8(lin.weight.detach())
    layer = qz.Int8DynamicLinear(q, s, lin.bias.detach(), torch.bfloat16)
    x = torch.randn(6, 128).to(torch.bfloat16)
    x[3] *= 40  # a loud row: with one scale per call it would coarsen every other row's quantization
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(6)])
    assert torch.equal(together, alone)
    want = x.float() @ qz.dequantize_int8(q, s).t() + lin.bias.detach()
    err = (together.float() - want).norm(dim=1) / want.norm(dim=1)
    assert err.max() < 0.03, err
    assert qz.w8a8_problem(torch.device("cpu")) is None
    assert "runs on a CPU" in qz.w8a8_problem(torch.device("cuda"))


def test_stacked_layers_give_each_layer_its_own_output_bit_for_bit():
    """q/k/v (and gate/up) stacked into one w8a8 matmul: each slice equals its own layer exactly,
    in any call order; another input, or the same tensor changed in place, is computed afresh;
    nothing is held once every slice has taken its output."""
    torch.manual_seed(1)
    lins = [torch.nn.Linear(64, n, bias=b) for n, b in ((64, True), (32, False), (32, True))]
    parts = [(*qz.quantize_int8(lin.weight.detach()), lin.bias) for lin in lins]
    layers = [qz.Int8DynamicLinear(q, s, None if b is None else b.detach(), torch.bfloat16) for q, s, b in parts]
    shared = qz.SharedInput(parts)
    slices = [qz.SharedInputSlice(shared, i) for i in range(3)]
    x = (torch.randn(5, 64) * torch.linspace(0.1, 30, 64)).to(torch.bfloat16)
    for order in ((0, 1, 2), (2, 0, 1)):
        for i in order:
            assert torch.equal(slices[i](x), layers[i](x))
        assert shared._outputs == [] and shared._input is None
    y = torch.randn(5, 64).to(torch.bfloat16)
    assert torch.equal(slices[0](x), layers[0](x)) and torch.equal(slices[1](y), layers[1](y))  # another input
    x.mul_(2)  # the same tensor, new values: not the stale outputs
    assert torch.equal(slices[2](x), layers[2](x))
    assert sum(1 for m in torch.nn.ModuleList(slices).modules() if isinstance(m, qz.Int8DynamicLinear)) == 1


@pytest.fixture(scope="module")
def quantized_pairs(tiny):
    return {
        m: load_pair(tiny["verifier"], tiny["draft_close"], None, "cpu", dtype="auto", quantize=m)
        for m in ("int8", "int4", "w8a8")
    }


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
@pytest.mark.parametrize("k", [1, 4])
def test_quantized_pair_greedy_speculative_equals_its_verifier_alone(quantized_pairs, method, k):
    pair = quantized_pairs[method]
    assert pair.verifier.dtype == torch.bfloat16 and pair.verifier.quantize == method
    head = pair.verifier.model.lm_head  # int8 weight-only under int8 and int4; int8 x int8 under w8a8
    assert isinstance(head, qz.Int8DynamicLinear if method == "w8a8" else qz.Int8Linear)
    if method == "w8a8":  # int8 x int8 everywhere; q/k/v and gate/up as one matmul each
        layer = pair.verifier.model.model.layers[0]
        assert all(isinstance(m, qz.Int8DynamicLinear) for m in (layer.self_attn.o_proj, layer.mlp.down_proj))
        assert all(
            isinstance(m, qz.SharedInputSlice)
            for m in (
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.mlp.gate_proj,
                layer.mlp.up_proj,
            )
        )
        assert layer.self_attn.q_proj.shared is layer.self_attn.v_proj.shared
    ids = prompt_ids(pair)
    n = 40
    alone, _, _ = run(
        SpeculativeEngine(pair),
        ids,
        GenerationParams(sampling=GREEDY, num_draft_tokens=0, max_tokens=n, ignore_eos=True),
    )
    spec, stats, _ = run(
        SpeculativeEngine(pair),
        ids,
        GenerationParams(sampling=GREEDY, num_draft_tokens=k, max_tokens=n, ignore_eos=True),
    )
    assert spec == alone
    assert 0 < stats.draft_acceptance_rate < 1


def test_smoothing_leaves_the_function_unchanged_and_is_cached(tiny, isolated_home):
    """SmoothQuant moves activation range into the weights: the unquantized model computes the
    same logits after it (to float rounding); a w8a8 start from the cache applies the cached
    factors and gives the same logits as the first start."""
    from transformers import AutoModelForCausalLM

    from cactus_cli.infer.backends.torch.quant import smooth

    model = AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 12, 7, 30, 11]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        found = smooth.groups(model)
        assert len(found) == 3 * len(model.model.layers)  # attention input, MLP input, down_proj input
        factors = smooth.factors(model, found, ids[0].tolist())
        assert all(
            (s > 0).all() and s.shape == (model.get_submodule(g.readers[0]).in_features,)
            for g, s in zip(found, factors.values())
        )
        smooth.apply(model, found, factors)
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-4, atol=1e-4)
    first = load_pair(tiny["verifier"], None, None, "cpu", dtype="auto", quantize="w8a8")
    again = load_pair(tiny["verifier"], None, None, "cpu", dtype="auto", quantize="w8a8")  # from the cache
    with torch.no_grad():
        assert torch.equal(first.verifier.model(input_ids=ids).logits, again.verifier.model(input_ids=ids).logits)


@pytest.mark.parametrize("cached", [False, True], ids=["first-start", "from-cache"])
def test_layer_by_layer_gives_the_whole_model_numbers(tiny, isolated_home, monkeypatch, cached):
    """A first w8a8 start smooths, quantizes and gates one decoder layer at a time (layerwise.py,
    for memory): the same factors, quantized model and gate NLLs as the whole-model forwards, and
    while layer i is calibrated no later layer has run yet (nothing beyond it is read)."""
    from transformers import AutoModelForCausalLM

    from cactus_cli.infer.backends.torch.quant import layerwise

    calibration = [5, 9, 12, 7, 30, 11, 8, 14] * 4
    ids = torch.tensor([[3, 17, 4, 25, 9]])

    def start(whole: bool):
        model = AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.bfloat16).eval()
        seen = []
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(lambda m, a, i=i: seen.append(i))
        if cached:  # a cache written by the other path first: its factors are applied, not measured
            qz.quantize_model(
                AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.bfloat16).eval(),
                "w8a8",
                tiny["verifier"],
                calibration=calibration,
            )
        with monkeypatch.context() as m:
            if whole:
                m.setattr(layerwise, "decoder_layers", lambda model, found: None)
            text = qz.quantize_model(model, "w8a8", tiny["verifier"], calibration=calibration, gate=10.0)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        path = qz.cache_file(qz.weights_key(tiny["verifier"]), "w8a8")
        for f in [path, qz.verdict_path(tiny["verifier"])]:
            f.unlink()
        return text, logits, seen, len(model.model.layers)

    whole_text, whole_logits, _, _ = start(whole=True)
    text, logits, seen, n = start(whole=False)
    assert torch.equal(logits, whole_logits)
    assert text == whole_text and "nats/token on the calibration text" in text  # the gate's delta, to 3 places
    # layer by layer: each as loaded then as quantized (the relays' pass runs none), then the check's forward
    assert seen == [i for i in range(n) for _ in (0, 1)] + list(range(n))


def test_quantized_weights_are_cached_and_reused(tiny, monkeypatch, isolated_home):
    calls = []
    real = qz.quantize_int8

    def counting(w):
        calls.append(w.shape)
        return real(w)

    monkeypatch.setattr(qz, "quantize_int8", counting)
    first = load_pair(tiny["verifier"], None, None, "cpu", dtype="auto", quantize="int8")
    n_layers = len(calls)
    assert n_layers == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    files = list((isolated_home / "quantized").glob("int8-*.safetensors"))
    assert len(files) == 1 and not list((isolated_home / "quantized").glob(".*tmp"))
    second = load_pair(tiny["verifier"], None, None, "cpu", dtype="auto", quantize="int8")
    assert len(calls) == n_layers  # nothing quantized again
    ids = torch.tensor([prompt_ids(first)])
    with torch.no_grad():
        torch.testing.assert_close(first.verifier.model(ids).logits, second.verifier.model(ids).logits, atol=0, rtol=0)
    files[0].write_bytes(b"not a safetensors file")  # a damaged cache is rebuilt, not trusted
    load_pair(tiny["verifier"], None, None, "cpu", dtype="auto", quantize="int8")
    assert len(calls) == 2 * n_layers
    monkeypatch.setattr(qz, "FORMAT", qz.FORMAT + 1)  # a new cache format (or torch) replaces the old file
    load_pair(tiny["verifier"], None, None, "cpu", dtype="auto", quantize="int8")
    assert len(calls) == 3 * n_layers
    assert [f.name for f in (isolated_home / "quantized").glob("int8-*")] != [files[0].name]
    assert len(list((isolated_home / "quantized").glob("int8-*"))) == 1


def test_quantize_needs_bfloat16_activations_on_cpu(tiny):
    r = cli.invoke(
        app,
        [
            "generate",
            "hi",
            "--verifier",
            tiny["verifier"],
            "--draft",
            "none",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--quantize",
            "int8",
        ],
    )
    assert r.exit_code == 2
    assert r.stderr.strip() == (
        "error: --quantize int8 runs on bfloat16 activations; use --dtype bfloat16 (or auto), "
        "or --quantize none to run in float32"
    )
    r = cli.invoke(app, ["generate", "hi", "--verifier", tiny["verifier"], "--quantize", "int3"])
    assert r.exit_code == 2 and "--quantize must be one of auto, none, q4_0, int8, int4" in r.stderr


def test_quantize_auto_on_cpu_is_measured_and_says_why(tiny):
    r = cli.invoke(
        app,
        [
            "generate",
            "the cat",
            "--verifier",
            tiny["verifier"],
            "--draft",
            tiny["draft_close"],
            "--device",
            "cpu",
            "--quantize",
            "auto",
            "-n",
            "4",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["settings"]["dtype_resolved"] == "bfloat16"
    reason = doc["settings"]["dtype_reason"]
    assert reason.startswith("quantize auto: ") and "measured" in reason, reason
    picked = reason.split(",")[0].removeprefix("quantize auto: ")
    assert picked in ("int8", "w8a8") and doc["settings"]["quantized"]["verifier"].startswith(picked)
    r = cli.invoke(
        app,
        [
            "generate",
            "the cat",
            "--verifier",
            tiny["verifier"],
            "--draft",
            "none",
            "--device",
            "cpu",
            "--quantize",
            "int8",
            "-n",
            "2",
            "--json",
        ],
    )
    assert json.loads(r.stdout)["settings"]["dtype_reason"] == "int8 weights run on bfloat16 activations"


def test_quantize_auto_gates_w8a8_on_its_measured_quality(tiny, isolated_home, monkeypatch):
    from cactus_cli.core import defaults
    from cactus_cli.infer.backends.torch import backend as torch_backend
    from cactus_cli.infer.load.sources import Source

    cpu = torch.device("cpu")
    monkeypatch.setattr(
        torch_backend, "fastest_cpu_quantization", lambda hidden, inter: ("w8a8", "measured w8a8 3x faster")
    )
    src = Source("folder", tiny["verifier"])
    assert torch_backend.choose_quantize("auto", cpu, "auto", src) == (
        "w8a8",
        "quantize auto: w8a8, measured w8a8 3x faster",
        defaults.QUALITY_TOLERANCE,
    )
    assert torch_backend.choose_quantize("int8", cpu, "auto", src) == ("int8", "", None)  # asked for by name: no probe
    calibration = [5, 9, 12, 7, 30, 11, 8, 14] * 4
    # a gate no model passes: w8a8 is measured, kept, and the model loaded again in int8
    lm = torch_backend.load_model(
        tiny["verifier"], src, cpu, torch.bfloat16, "verifier", "w8a8", None, 1, calibration, -1.0
    )
    assert lm.quantize == "int8" and isinstance(lm.model.model.layers[0].self_attn.q_proj, qz.Int8Linear)
    verdict = qz.quality_verdict(tiny["verifier"])
    assert verdict is not None and abs(verdict) < 1.0
    # measured again from the cached w8a8 tensors: the same verdict (the reference is the model as loaded)
    lm = torch_backend.load_model(
        tiny["verifier"], src, cpu, torch.bfloat16, "verifier", "w8a8", None, 1, calibration, 10.0
    )
    assert lm.quantize == "w8a8" and qz.quality_verdict(tiny["verifier"]) == pytest.approx(verdict, abs=1e-3)
    monkeypatch.setattr(defaults, "QUALITY_TOLERANCE", verdict - 1e-6)  # measured worse than the tolerance
    method, why, gate = torch_backend.choose_quantize("auto", cpu, "auto", src)
    assert (method, gate) == ("int8", None) and "more than" in why
    monkeypatch.setattr(defaults, "QUALITY_TOLERANCE", verdict + 1e-6)  # within it: w8a8, no gate again
    method, why, gate = torch_backend.choose_quantize("auto", cpu, "auto", src)
    assert (method, gate) == ("w8a8", None) and "nats/token on this model" in why


def test_models_quality_reports_nll_and_agreement(tiny):
    r = cli.invoke(
        app, ["models", "quality", "--verifier", tiny["verifier"], "--device", "cpu", "--limit", "6", "--json"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = {row["quantize"]: row for row in doc["results"]}
    assert list(rows) == ["none", "int8", "int4"]
    assert rows["none"]["nll_vs_reference"] == 0 and rows["none"]["greedy_agreement"] == 1
    assert rows["int8"]["tokens"] == rows["none"]["tokens"] > 20
    # int8 barely moves a model; int4 moves it more (random weights, so only loose bounds)
    assert abs(rows["int8"]["nll_vs_reference"]) < 0.05 and rows["int8"]["greedy_agreement"] > 0.9
    assert abs(rows["int8"]["nll_vs_reference"]) <= abs(rows["int4"]["nll_vs_reference"]) + 1e-3
    assert rows["int4"]["weight_gb"] < rows["int8"]["weight_gb"] < rows["none"]["weight_gb"]
    bad = cli.invoke(app, ["models", "quality", "--verifier", tiny["verifier"], "--quantize", "none"])
    assert bad.exit_code == 2 and "the unquantized model is always the reference" in bad.stderr


def test_bench_times_quantizations_side_by_side(tiny):
    r = cli.invoke(
        app,
        [
            "bench",
            "--verifier",
            tiny["verifier"],
            "--draft",
            tiny["draft_close"],
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
            "--compile",
            "off",
            "--quantize",
            "none,int8",
            "--rules",
            "sps",
            "-k",
            "2",
            "-t",
            "0",
            "--limit",
            "2",
            "-n",
            "8",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["results"]
    assert [(row["config"], row["quantize"]) for row in rows] == [
        ("verifier alone · none", "none"),
        ("sps k=2 · none", "none"),
        ("verifier alone · int8", "int8"),
        ("sps k=2 · int8", "int8"),
    ]


def test_quantize_auto_yields_to_an_explicit_float32(tiny):
    # the default profile says quantize: auto; asking for float32 runs unquantized, no error
    r = cli.invoke(
        app,
        [
            "generate",
            "the cat",
            "--verifier",
            tiny["verifier"],
            "--draft",
            "none",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "-n",
            "2",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["settings"]["dtype_resolved"] == "float32"


def test_a_damaged_quantized_cache_is_rebuilt_with_one_line(tiny, capsys):
    from safetensors.torch import load_file, save_file

    model, _ = quantize_tiny(tiny)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    path = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8")
    good = load_file(str(path))
    damages = {
        "missing": lambda t: {k: v for k, v in t.items() if k != "lm_head.scales"},
        "flipped": lambda t: {**t, "model.layers.0.mlp.up_proj.q": t["model.layers.0.mlp.up_proj.q"] ^ 1},
        "cut head": lambda t: {**t, "lm_head.q": t["lm_head.q"][:10]},
    }
    for what, damage in damages.items():
        # written with the good file's checksum: what a flipped byte on disk looks like
        save_file(damage(good), str(path), metadata={"sha256": quantize.checksum(good)})
        capsys.readouterr()
        model2, _ = quantize_tiny(tiny)
        assert "damaged" in capsys.readouterr().err, what  # a line that stays on stderr
        state = model2.state_dict()
        assert all(torch.equal(state[k], reference[k]) for k in reference), what
        assert quantize.checksum(load_file(str(path))) == quantize.checksum(good)  # the file was replaced


def test_int4_says_what_ran(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.bfloat16)
    lines = []
    text = quantize.quantize_model(model, "int4", tiny["verifier"], report=lines.append)
    assert "in int8" in text and text in lines  # said once, and kept for --json


def test_models_quality_cuts_texts_longer_than_the_context(tiny, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": " ".join(["the cat sat on the mat"] * 10)}) + "\n")
    r = invoke(
        "models",
        "quality",
        "--verifier",
        tiny["short_context"],
        "--device",
        "cpu",
        "--quantize",
        "int8",
        "--prompts",
        prompts,
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert "scored on their first 16 tokens" in " ".join(r.output.split())


def test_stale_temp_files_of_dead_writers_are_removed(tiny):
    folder = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8").parent
    folder.mkdir(parents=True, exist_ok=True)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    stale = folder / f".int8-abc.safetensors.{dead}.x1y2.tmp"
    live = folder / f".int8-abc.safetensors.{os.getpid()}.x1y2.tmp"
    stale.write_bytes(b"0" * 1000)
    live.write_bytes(b"0" * 1000)
    quantize_tiny(tiny)
    assert not stale.exists() and live.exists()  # a live writer's file is its own business
    live.unlink()


def test_the_quantized_cache_streams_tensor_by_tensor_in_the_safetensors_format(tmp_path):
    from safetensors.torch import load_file, save_file

    from cactus_cli.infer.backends.torch.quant.qcache import CacheReader, CacheWriter, checksum

    tensors = {
        "a.q": torch.randint(-127, 127, (5, 8), dtype=torch.int8),
        "a.scales": torch.rand(5),
        "b.q": torch.randint(0, 255, (3, 4), dtype=torch.uint8),
        "s": torch.rand(8),
    }
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    path = tmp_path / "int8-x-y.safetensors"
    w = CacheWriter(path, specs)
    for k in ("s", "b.q", "a.q", "a.scales"):  # in the order they are computed, not the file's
        w.add(k, tensors[k])
    assert w.finish()
    loaded = load_file(str(path))  # what safetensors itself reads
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    r = CacheReader(path, {k: s for k, (_, s) in specs.items()})
    assert all(torch.equal(r[k], v) for k, v in tensors.items()) and "a.q" in r and "zz" not in r
    old = tmp_path / "old.safetensors"  # a cache written by earlier versions (safetensors' save_file)
    save_file(tensors, str(old), metadata={"sha256": checksum(tensors)})
    assert torch.equal(CacheReader(old, {"a.q": (5, 8)})["a.q"], tensors["a.q"])
    with pytest.raises(ValueError, match="wrong shape"):
        CacheReader(path, {"a.q": (8, 5)})
    with pytest.raises(ValueError, match="missing"):
        CacheReader(path, {"c.q": (1,)})
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        CacheReader(path, {})
    path.write_bytes(bytes(data[:20]))
    with pytest.raises(ValueError):
        CacheReader(path, {})
    bad = tmp_path / "int8-x-z.safetensors"
    w = CacheWriter(bad, specs)
    w.add("a.q", tensors["a.q"].float())  # not what was announced: nothing is cached
    for k in ("s", "b.q", "a.scales"):
        w.add(k, tensors[k])
    assert not w.finish() and not bad.exists() and not list(tmp_path.glob(".*.tmp"))


@pytest.fixture
def fake_model_cache(fake_model):  # noqa: F811
    return fake_model[0]


def _temp_files(folder):
    return sorted(p.name for p in folder.glob(".*.tmp")) if folder.is_dir() else []


def test_an_interrupted_first_quantization_removes_its_partial_cache(tiny, monkeypatch):
    from cactus_cli.infer.backends.torch.quant import quantize
    from tests.helpers import quantize_tiny

    folder = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8").parent
    real, calls = quantize.quantize_int8, []

    def interrupted(w):
        calls.append(1)
        if len(calls) == 3:  # a few layers in: the partial file exists
            assert _temp_files(folder)
            raise KeyboardInterrupt
        return real(w)

    monkeypatch.setattr(quantize, "quantize_int8", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_tiny(tiny)
    assert _temp_files(folder) == [] and not list(folder.glob("*.safetensors"))


SIGTERM_DURING_QUANTIZATION = """
import sys, time
from cactus_cli.core.signals import treat_sigterm_as_sigint
from cactus_cli.infer.backends.torch.quant import quantize
import torch
from transformers import AutoModelForCausalLM
treat_sigterm_as_sigint()
real, calls = quantize.quantize_int8, []
def slow(w):
    calls.append(1)
    if len(calls) == 2:
        print("writing", flush=True)
        time.sleep(60)
    return real(w)
quantize.quantize_int8 = slow
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
try:
    quantize.quantize_model(model, "int8", sys.argv[1])
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_sigterm_during_the_first_quantization_leaves_no_partial_cache(tiny, isolated_home):
    import signal
    import subprocess
    import sys

    from cactus_cli.infer.backends.torch.quant import quantize

    folder = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8").parent
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_DURING_QUANTIZATION, tiny["verifier"]],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, CACTUS_HOME=str(isolated_home)),
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert _temp_files(folder)  # the partial file is there while it writes
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
    assert _temp_files(folder) == []


def test_a_damaged_quantized_cache_is_said_in_a_line_that_stays(tiny):
    from cactus_cli.infer.backends.torch.quant import quantize
    from tests.helpers import invoke

    args = ["generate", "the cat", "--verifier", tiny["verifier"], "--draft", "none", "--device", "cpu"]
    args += ["--quantize", "int8", "-n", "2", "--plain"]
    assert invoke(*args).exit_code == 0
    path = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8")
    path.write_bytes(path.read_bytes()[:100])
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    assert f"warning: the quantized cache {path} is damaged (" in " ".join(r.stderr.split())


def test_every_rebuilt_cache_says_why(tiny, fake_model_cache, capsys):
    from cactus_cli.infer.backends.torch.quant import quantize
    from cactus_cli.infer.load import devices, embedded

    def said() -> str:
        return " ".join(capsys.readouterr().err.split())

    verdict = quantize.verdict_path(tiny["verifier"])
    assert quantize.quality_verdict(tiny["verifier"]) is None and said() == ""  # not measured yet: nothing to say
    verdict.parent.mkdir(parents=True, exist_ok=True)
    verdict.write_text('{"nll_delta": "x"}')
    assert quantize.quality_verdict(tiny["verifier"]) is None
    assert f"warning: the w8a8 quality verdict {verdict} is unreadable; measuring" in said()

    devices.timed_once("t-", [1], ("a",), lambda name, watch: 0.5)
    assert said() == ""  # measured the first time
    (path,) = (devices.cache_path({}, "").parent).glob("t-*.json")
    path.write_text("not json")
    devices.timed_once("t-", [1], ("a",), lambda name, watch: 0.5)
    assert f"warning: the timing cache {path} is unreadable; measuring again" in said()

    (embedded.models_dir() / "fake").mkdir(parents=True)  # a conversion that never finished
    embedded.prepare_embedded("fake")
    assert "fake is an incomplete conversion (no cactus-conversion.json); making it again" in said()
    (embedded.models_dir() / "fake.gguf").write_bytes(b"short")
    embedded.embedded_gguf("fake")
    assert f"fake.gguf is 5 bytes, not {fake_model_cache.size}; assembling it again" in said()
