"""One engine per variant of a bench or eval grid (backend, quantize, compiled, draft model or
lookup, cross-vocabulary method), loading each model once and sharing it between the variants
that use it."""

from __future__ import annotations

import dataclasses
from typing import Any

from cactus_cli.app import runtime
from cactus_cli.app.config.parsing import parse_draft
from cactus_cli.app.config.settings import Settings
from cactus_cli.app.grid.sweep import longest_prompt
from cactus_cli.app.prompts import Prompt
from cactus_cli.core.errors import ModelError
from cactus_cli.core.once import one_load
from cactus_cli.infer.backends.registry import backend_of
from cactus_cli.infer.decode.engine import SpeculativeEngine
from cactus_cli.infer.load.vocab import CrossVocab
from cactus_cli.infer.pair.loader import load_plan
from cactus_cli.infer.pair.plan import plan_load


def load_engines(
    settings: Settings,
    prompts: list[Prompt],
    reporter,
    *,
    quantizes: list[str],
    compiles: list[str],
    drafts: list[str],
    ks: list[int | str],
    crosses: list[str] = ("auto",),
    backends: list[str] = ("torch",),
    sequences: int = 1,
) -> tuple[dict[tuple[str, str, bool, str, str], SpeculativeEngine], list]:
    """An engine per variant (backend, quantize, compiled, draft, and for a draft with another
    vocabulary each method in ``crosses``), the verifier in memory once per backend and
    quantization and each draft model once beside it (a same-family and a cross-family draft, by
    string and by intersection, compare on one verifier), each engine prepared (compiled, costs
    probed) for the longest prompt; and the prompts encoded. The quantize and compile lists
    apply to torch (llama.cpp runs the GGUF as it is). A compiled engine that fell back to eager
    (the warning says why) is not a second variant. ``sequences``: slots per engine (bench
    --concurrency)."""
    models = list(dict.fromkeys(m for m in (parse_draft(d)[1] for d in drafts) if m))
    loading = dataclasses.replace(settings, cross_vocab="auto")  # (decided per method below, on the map built once)
    engines: list[tuple[tuple[str, str], SpeculativeEngine]] = []
    for backend, quantize, modes in _backend_runs(settings, backends, quantizes, compiles):
        pairs: dict[tuple[str | None, str], Any] = {}
        for mode in modes:
            if not pairs:  # the verifier (and the first draft model), then each other draft model beside it
                first = runtime.load_engine(
                    dataclasses.replace(loading, draft=models[0] if models else drafts[0]),
                    reporter,
                    compile_mode=mode,
                    pair=None,
                    quantize=quantize,
                    backend=backend,
                ).pair
                loaded = {None: dataclasses.replace(first, draft=None, cross=None)}
                if models:
                    loaded[models[0]] = first
                for m in models[1:]:
                    request = runtime.load_request(loading, quantize=quantize, backend=backend, compile=mode)
                    with one_load():
                        plan = plan_load(dataclasses.replace(request, draft=m), reporter)
                        loaded[m] = load_plan(plan, reporter, verifier=loaded[None])
                pairs = _cross_as_asked(loaded, list(crosses))
            for draft in drafts:
                model = parse_draft(draft)[1]
                for (m, cross), own in pairs.items():
                    if m == model:
                        engines.append(
                            (
                                (draft, cross),
                                runtime.load_engine(
                                    dataclasses.replace(settings, draft=draft),
                                    reporter,
                                    compile_mode=mode,
                                    pair=own,
                                    quantize=quantize,
                                    backend=backend,
                                    sequences=sequences,
                                ),
                            )
                        )
    encoded = runtime.encode_prompts(engines[0][1], prompts, settings.chat_template)
    longest = longest_prompt(
        engines[0][1].pair.tokenizer, encoded, settings.max_tokens
    )  # (a multi-turn question's last turn)
    for _, e in engines:  # every slot's room now: a context grown mid-row replays every cached sequence
        for slot in range(len(e.slots)):  # (a compiled engine has one)
            runtime.prepare(e, settings, reporter, longest, ks, slot=slot, probe=slot == 0)
    ready: dict[tuple[str, str, bool, str, str], SpeculativeEngine] = {}
    for (draft, cross), e in engines:
        ready.setdefault((e.pair.verifier.backend, e.pair.verifier.quantize, e.compiled, draft, cross), e)
    return ready, encoded


def _backend_runs(
    settings: Settings, backends: list[str], quantizes: list[str], compiles: list[str]
) -> list[tuple[str, str, list[str]]]:
    """(backend, quantize, compile modes) per verifier to load. With several backends, the
    quantize and compile lists apply to the backends that take them (backends/: a backend runs
    only its own quantizations, compiles only if it can); with one backend, a value it cannot
    take is an error (backends.choose says so)."""
    if len(backends) == 1:
        return [(backends[0], q, compiles) for q in quantizes]
    runs = []
    for name in backends:
        b = backend_of(name) if name != "auto" else None
        qs = [q for q in quantizes if b is None or q in ("auto", "none", *b.quantizations)] or ["auto"]
        runs += [(name, q, compiles if b is None or b.compiles else ["auto"]) for q in qs]
    return runs


def _cross_as_asked(loaded: dict[str | None, Any], methods: list[str]) -> dict[tuple[str | None, str], Any]:
    """Each loaded pair under (draft model, method): a draft whose vocabulary differs once per
    --cross-vocab method (its token map built once at load, the method decided again; ``auto``
    resolves to one of the others and is not run twice), any other with method "". A method
    asked for when no draft model has another vocabulary is an error, as with one draft."""
    pairs: dict[tuple[str | None, str], Any] = {}
    for m, p in loaded.items():
        if m is None or p.cross is None:
            pairs[(m, "")] = p
            continue
        for method in methods:
            cross = CrossVocab.choose(p.cross.tokenizer, p.cross.vmap, p.cross.rows, method, m, p.verifier.source)
            pairs.setdefault((m, cross.method), dataclasses.replace(p, cross=cross))
    if methods != ["auto"] and all(cross == "" for _, cross in pairs):
        raise ModelError(
            f"--cross-vocab {','.join(methods)}: every --draft model shares the verifier's vocabulary; "
            "drop --cross-vocab (it applies to a draft with another tokenizer)"
        )
    return pairs
