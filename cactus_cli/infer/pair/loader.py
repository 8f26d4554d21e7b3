"""Loading: ``load_plan`` loads what a LoadPlan (plan.py) says, in one pass, through the plan's
backend (backends/): the shared tokenizer (checked against every model's own), the verifier (or,
on a tensor-parallel follower rank, its shard: ``load_shard``), and the draft beside it with the
cross-vocabulary map its plan asks for. Loading never starts or serves a tensor-parallel group:
the plan only says what every rank loads; app/runtime.py starts the group (or, on a follower
rank, serves it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from cactus_cli.core.errors import ModelError
from cactus_cli.core.once import one_load
from cactus_cli.infer.backends import registry
from cactus_cli.infer.backends.torch import group
from cactus_cli.infer.load.sources import LoadedModel, ModelPair, Source, load_tokenizer, materialize
from cactus_cli.infer.load.vocab import CrossVocab
from cactus_cli.infer.pair.plan import LoadPlan, LoadRequest, plan_load


def load_pair(
    verifier: str | None,
    draft: str | None = None,
    tokenizer: str | None = None,
    device: str = "auto",
    *,
    dtype: str = "auto",
    reporter=None,
    **request: Any,
) -> ModelPair:
    """Plan and load in one call (tests, benchmarks): a LoadRequest of these and ``request``'s
    keywords (quantize=..., backend=..., threads=...)."""
    req = LoadRequest(verifier=verifier, draft=draft, tokenizer=tokenizer, device=device, dtype=dtype, **request)
    with one_load():
        return load_plan(plan_load(req, reporter), reporter)


def load_plan(plan: LoadPlan, reporter=None, verifier: ModelPair | None = None) -> ModelPair:
    """The pair ``plan`` describes, loaded in one pass; with ``verifier`` (a pair already loaded
    from the same plan's verifier: bench puts several drafts on one verifier) only the draft."""
    backend = registry.backend_of(plan.backend)
    if verifier is None:
        if reporter is not None:
            reporter.task(f"loading verifier {plan.verifier}")
        tok = load_tokenizer(
            materialize(plan.tokenizer_source, reporter) if plan.tokenizer_source else plan.verifier_files[1]
        )
        if plan.tokenizer_source is not None:  # the shared-vocabulary check holds whatever the tokenizer's source
            for src, name in (
                (plan.verifier_files[1], plan.verifier),
                (plan.draft_files and plan.draft_files[1], plan.draft),
            ):
                own = _own_tokenizer(src)
                if own is not None:
                    what = f"--tokenizer {plan.request.tokenizer!r} and model {name!r}"
                    check_same_vocab(own, tok, name, plan.request.tokenizer, what=what)
        if plan.tp > 1:
            if reporter is not None:
                reporter.task(f"starting {plan.tp} tensor-parallel ranks")
            group.start(plan.tp, plan.device, plan.tp_load)
        vm = backend.load(plan.verifier, plan.verifier_files[0], plan, tok, "verifier", reporter)
        _check_rows(vm, "verifier", len(tok))
        verifier = ModelPair(
            vm, None, tok, len(tok), backend.dtype_reason(plan, vm), backend_reason=plan.backend_reason, plan=plan
        )
    if plan.draft is None:
        return verifier
    if reporter is not None:
        reporter.task(f"loading draft {plan.draft}")
    vm, tok = verifier.verifier, verifier.tokenizer
    dsrc, dtoksrc = plan.draft_files
    dtok = load_tokenizer(dtoksrc) if plan.cross_vocab != "none" else None
    draft_plan = dataclasses.replace(plan.draft_plan(), quantize=vm.quantize if plan.tp == 1 else "none")
    dm = backend.load(plan.draft, dsrc, draft_plan, dtok or tok, "draft", reporter)
    cross = None
    if dtok is not None:
        method = plan.cross_vocab
        cross = CrossVocab.build(dtok, tok, dm.logits_width, vm.logits_width, method, plan.draft, vm.source)
    else:
        _check_rows(dm, "draft", verifier.vocab_size)
    return dataclasses.replace(verifier, draft=dm, cross=cross, plan=plan)


def load_shard(load: dict[str, Any]) -> tuple[LoadedModel, int]:
    """A tensor-parallel follower's verifier shard, loaded by the backend rank 0 loads its own
    with, from what rank 0's plan says every rank loads (``LoadPlan.tp_load``)."""
    request = LoadRequest(verifier=load["location"], device=load["device"], dtype=load["dtype"], backend="torch")
    plan = LoadPlan(
        request=request,
        verifier_files=(Source(load["kind"], load["location"]),) * 2,
        draft_source=None,
        draft_files=None,
        tokenizer_source=None,
        backend="torch",
        backend_reason="a tensor-parallel follower",
        device=torch.device(load["device"]),
        dtype=getattr(torch, load["dtype"]),
        dtype_reason="as rank 0",
        quantize="none",
        quantize_reason="tensor parallel shards run unquantized",
        gate=None,
        fallback=None,
        threads=None,
        threads_reason="",
        tp=group.rank_and_world()[1],
        tp_load=load,
        cross_vocab="none",
        cross_reason="",
        compiled=False,
        compile_reason="",
    )
    lm = registry.backend_of(plan.backend).load(load["location"], plan.verifier_files[0], plan, None, "verifier")
    return lm, int(load["vocab"])


def _own_tokenizer(src: Source | None):
    """The tokenizer a model folder ships, or None (a bare converted model, a hub id without one)."""
    if src is None or src.kind != "folder":
        return None
    folder = Path(src.location)
    if not any(
        (folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    ):
        return None
    try:
        return load_tokenizer(src)
    except ModelError:
        return None


def check_same_vocab(verifier_tok, draft_tok, verifier: str, draft: str, what: str | None = None) -> None:
    """Draft and verifier must map every token string to the same id."""
    v, d = verifier_tok.get_vocab(), draft_tok.get_vocab()
    if v == d:
        return
    only_v = sorted(set(v) - set(d), key=v.get)[:3]
    only_d = sorted(set(d) - set(v), key=d.get)[:3]
    moved = [t for t in v if t in d and v[t] != d[t]][:3]
    detail = (
        f"{len(v)} vs {len(d)} tokens"
        + (f"; only in {'the model' if what else 'verifier'}: {only_v}" if only_v else "")
        + (f"; only in {'--tokenizer' if what else 'draft'}: {only_d}" if only_d else "")
        + (f"; different ids for: {moved}" if moved else "")
    )
    if what is not None:
        raise ModelError(f"{what} do not share a vocabulary ({detail}); use the tokenizer that belongs to the models")
    raise ModelError(
        f"draft {draft!r} and verifier {verifier!r} do not share a tokenizer ({detail}); "
        "speculative decoding needs one vocabulary: pick a draft from the verifier's model family"
    )


def _check_rows(lm: LoadedModel, role: str, vocab: int) -> None:
    """Padded output rows are a few hundred at most (Qwen2.5: 271); far fewer tokens than rows
    means the tokenizer belongs to another model."""
    if not lm.logits_width - max(1024, lm.logits_width // 100) <= vocab <= lm.logits_width:
        raise ModelError(
            f"{role} {lm.source!r} has {lm.logits_width} output rows but the tokenizer has {vocab} "
            "tokens; the tokenizer does not belong to this model"
        )
