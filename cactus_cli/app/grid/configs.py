"""What a grid measures: one ``BenchConfig`` per row (the verifier alone, each rule x delta x k, HF
assisted generation) for every engine variant, built once by ``build_grid`` for bench, eval and
calibrate; sweep.py runs them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cactus_cli.app.config.settings import check_each
from cactus_cli.core.acceptance import RULES, resolve_params
from cactus_cli.core.errors import ConfigError
from cactus_cli.infer.backends.registry import FALLBACK, backend_of


@dataclass(frozen=True)
class BenchConfig:
    kind: str  # "autoregressive", "speculative", "hf-assisted"
    rule: str | None = None
    k: int = 0  # k_max when adaptive
    rule_kwargs: dict[str, Any] = field(default_factory=dict)
    adaptive: bool = False  # -k auto
    compiled: bool = False  # which engine runs it: bench --compile off,on times both side by side
    quantize: str = "none"  # ... and --quantize none,int8 (a GGUF on llama.cpp: "gguf")
    draft: str = ""  # ... and --draft ngram,suffix,MODEL (bench and eval take a list)
    cross: str = ""  # ... and --cross-vocab string,intersection (a draft with another vocabulary; "" otherwise)
    tag: str = ""  # names the engine in the label when a grid has more than one
    backend: str = FALLBACK  # ... and --backend torch,llama.cpp
    concurrency: int = 1  # requests submitted together, stepped in one batch (bench --concurrency)

    @property
    def variant(self) -> tuple[str, str, bool, str, str]:
        return self.backend, self.quantize, self.compiled, self.draft, self.cross

    @property
    def k_label(self) -> str:
        return "auto" if self.adaptive else str(self.k)

    @property
    def label(self) -> str:
        at_once = f" · {self.concurrency} at once" if self.concurrency > 1 else ""
        return self._label() + at_once + (f" · {self.tag}" if self.tag else "")

    def _label(self) -> str:
        if self.kind == "autoregressive":
            return "verifier alone"
        if self.kind == "hf-assisted":
            return f"HF assisted k={self.k}"
        # show delta always, other parameters only where they differ from the rule's defaults
        defaults = resolve_params(self.rule)
        extra = "".join(
            f" {'δ' if n == 'delta' else n}={v:g}" if isinstance(v, float) else f" {n}={v}"
            for n, v in self.rule_kwargs.items()
            if n == "delta" or v != defaults.get(n)
        )
        return f"{self.rule}{extra} k={self.k_label}"


def build_grid(
    rules: list[str],
    deltas: list[float],
    ks: list[int | str],
    rule_params: dict[str, Any],
    compare_hf: bool,
    k_max: int = 8,
    variants: list[tuple[str, str, bool, str, str]] = ((FALLBACK, "none", False, "", ""),),
    concurrency: list[int] = (1,),
) -> list[BenchConfig]:
    """Per engine variant (backend, quantize, compiled, draft, cross-vocabulary method): the
    baseline (once per backend, quantize and compiled: it drafts nothing), then each rule (x
    delta where it takes one) x k, each at every ``concurrency``; then HF rows (the first variant
    with a draft model, eager). ``auto`` in ``ks`` is the adaptive k (0..k_max)."""
    grid: list[BenchConfig] = []
    several = [len({v[i] for v in variants}) > 1 for i in range(5)]

    def varies(i: int, backend: str) -> bool:  # (quantize and compiled: among one backend's rows)
        return len({v[i] for v in variants if v[0] == backend}) > 1

    def tag(backend: str, quantize: str, compiled: bool, draft: str, cross: str) -> str:
        parts = (
            backend if several[0] else "",
            quantize if varies(1, backend) else "",
            ("compiled" if compiled else "eager") if varies(2, backend) else "",
            draft if several[3] else "",
            cross if several[4] else "",
        )
        return ", ".join(p for p in parts if p)

    baselines = set()
    for backend, quantize, compiled, draft, cross in variants:
        rows = [
            dataclasses.replace(c, concurrency=n)
            for c in _grid(rules, deltas, ks, rule_params, k_max)
            for n in concurrency
        ]
        if (backend, quantize, compiled) in baselines:
            rows = rows[len(concurrency) :]
        baselines.add((backend, quantize, compiled))
        grid += [
            dataclasses.replace(
                c,
                backend=backend,
                quantize=quantize,
                compiled=compiled,
                draft=draft,
                cross=cross,
                tag=tag(backend, quantize, compiled, *(("", "") if c.kind == "autoregressive" else (draft, cross))),
            )
            for c in rows
        ]
    if compare_hf:
        b, q, c, d, x = next((v for v in variants if backend_of(v[0]).transformers), variants[0])
        if not backend_of(b).transformers:
            raise ConfigError(
                "--compare-hf runs transformers' own generate: add a backend that runs transformers models to --backend"
            )
        grid += [
            BenchConfig("hf-assisted", None, k, quantize=q, compiled=c, draft=d, cross=x) for k in ks if k != "auto"
        ]
    rows: dict[str, BenchConfig] = {}
    for c in grid:  # one row per label (the lists were made unique, said then): a row's results and
        rows.setdefault(c.label, c)  # its drafter's memory are keyed by it, never shared with a twin
    return list(rows.values())


def _grid(
    rules: list[str], deltas: list[float], ks: list[int | str], rule_params: dict[str, Any], k_max: int
) -> list[BenchConfig]:
    check_each("num_draft_tokens", ks, "-k")
    check_each("delta", deltas, "--delta")
    grid = [BenchConfig("autoregressive")]
    for rule in rules:
        if rule not in RULES:
            raise ConfigError(f"--rules: unknown rule {rule!r}; choose from {', '.join(RULES)}")
        takes = RULES[rule].param_names()
        own = {n: v for n, v in rule_params.items() if n in takes}
        for delta in deltas if "delta" in takes else [None]:
            kwargs = dict(own, **({"delta": delta} if delta is not None else {}))
            try:
                kwargs = resolve_params(rule, kwargs)
            except ValueError as err:
                raise ConfigError(str(err)) from None
            for k in ks:
                grid.append(
                    BenchConfig("speculative", rule, k_max, kwargs, adaptive=True)
                    if k == "auto"
                    else BenchConfig("speculative", rule, k, kwargs)
                )
    return grid
