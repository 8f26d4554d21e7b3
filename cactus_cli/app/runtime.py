"""From resolved Settings to a ready engine: load the pair (or, on a tensor-parallel follower
rank under torchrun, serve rank 0 instead), build generation parameters, encode prompts. Shared
by every command and the lm-eval adapter, so they all behave the same."""

from __future__ import annotations

import dataclasses
from typing import Any

from cactus_cli.app import follower
from cactus_cli.app.config.parsing import parse_draft
from cactus_cli.app.config.settings import Settings, draft_limit
from cactus_cli.app.prompts import builtin_prompts
from cactus_cli.core.conditions import taken
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.once import one_load
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer import draft
from cactus_cli.infer.backends.registry import backend_of
from cactus_cli.infer.backends.torch import group
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.draft import Free
from cactus_cli.infer.load.devices import device_name
from cactus_cli.infer.load.sources import ModelPair
from cactus_cli.infer.pair.loader import load_plan
from cactus_cli.infer.pair.plan import LoadRequest, plan_load, with_compile


def load_request(settings: Settings, **overrides: Any) -> LoadRequest:
    """The one load request ``settings`` make (``overrides``, where not None, replace a runtime
    setting: bench times several backends, quantizations and compile modes)."""
    request = LoadRequest(
        verifier=settings.verifier,
        draft=parse_draft(settings.draft)[1],
        tokenizer=settings.tokenizer,
        device=settings.device,
        dtype=settings.dtype,
        quantize=settings.quantize,
        tp=settings.tp,
        cross_vocab=settings.cross_vocab,
        backend=settings.backend,
        threads=settings.threads,
        compile=settings.compile,
        quality_texts=tuple(p.prompt for p in builtin_prompts(None)),  # (a requantized verifier's quality)
    )
    return dataclasses.replace(request, **{k: v for k, v in overrides.items() if v is not None})


def load_engine(
    settings: Settings,
    reporter=None,
    *,
    compile_mode: str | None = None,
    pair: ModelPair | None = None,
    quantize: str | None = None,
    backend: str | None = None,
    sequences: int = 1,
) -> SpeculativeEngine:
    """Load the pair (or take ``pair``, already loaded) and build the engine, compiled or not
    (``compile_mode``, ``quantize`` and ``backend`` override the settings': bench times several),
    with ``sequences`` slots (serve and bench --concurrency step several requests together).
    A rank > 0 of a torchrun tensor-parallel group never returns: it serves rank 0, then exits."""
    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)  # (llama.cpp takes them at load)
    request = load_request(settings, compile=compile_mode, quantize=quantize, backend=backend, sequences=sequences)
    if pair is None and settings.tp > 1 and group.is_follower():
        follower.serve(plan_load(request).tp_load)
        raise SystemExit(0)
    with one_load():  # each tokenizer and cost file read once, by the plan and the engine alike
        if pair is None:
            pair = load_plan(plan_load(request, reporter), reporter)
        plan = pair.plan
        mode = compile_mode if compile_mode is not None else plan.request.compile
        if (mode, sequences) != (plan.request.compile, plan.request.sequences):  # (bench: a pair loaded once)
            plan = with_compile(plan, mode, sequences)  # (compiled too, or in an engine of several slots)
            pair = dataclasses.replace(pair, plan=plan)
        if plan.request.compile == "on" and not plan.compiled and reporter is not None:
            reporter.warn(plan.compile_reason)
        engine = SpeculativeEngine(
            pair, free_drafting(parse_draft(settings.draft)[0], settings, pair, reporter), plan.compiled, sequences
        )
    for line in engine.costs.notes if reporter is not None else ():
        reporter.warn(line)
    if (moved := calibrated_elsewhere(settings, pair)) and reporter is not None:
        reporter.warn(moved)
    return engine


def calibrated_elsewhere(settings: Settings, pair: ModelPair) -> str | None:
    """A fixed k that `cactus calibrate --save` timed on another machine, in one line (None: it
    was timed here, or the profile was not calibrated, or k is chosen per step)."""
    machine = (settings.calibration or {}).get("machine")
    if not machine or settings.num_draft_tokens == "auto":
        return None
    here = device_name(pair.verifier.device)
    if machine == here:
        return None
    return (
        f"this profile's k = {settings.num_draft_tokens} was calibrated on {machine}, not on this {here}; "
        "run `cactus calibrate --save` here, or use -k auto"
    )


def free_drafting(kind: str | None, settings: Settings, pair: ModelPair, reporter=None) -> Free | None:
    """The model-free drafting a draft value asks for (draft/__init__.KINDS), with its parameters
    (``settings.draft_params``); its state (the suffix trees' remembered history) loaded now, a problem one warning."""
    if kind is None:
        return None
    warn = reporter.warn if reporter is not None else (lambda line: None)
    return draft.free_drafting(kind, settings.draft_params, pair.tokenizer, pair.vocab_size, warn)


CHAT_CONTEXT = 4096  # tokens a chat's llama.cpp context holds from the start
PROMPT_ALLOWANCE = 512  # tokens of prompt a compiled engine is sized for before it sees the prompt (chat)


def prepare(
    engine: SpeculativeEngine,
    settings: Settings,
    reporter=None,
    prompt_tokens: int = PROMPT_ALLOWANCE,
    k_values: list[int | str] | None = None,
    whole_context: bool = False,
    slot: int = 0,
    probe: bool = True,
) -> None:
    """Before anything is timed (``slot``: the engine slot the run will take; ``probe`` False: not
    now, other runs hold the caches): compile the steps the run will take (a compiled engine), and
    when -k auto will run (``k_values`` lists the k a command will use) on a pair never timed on
    this machine, seed the cost model with a short probe. ``whole_context`` (chat): on CUDA the
    static caches are sized once for the whole context window (bounded by free memory), since
    growing one later re-records every graph of both models; on llama.cpp the context starts at
    CHAT_CONTEXT tokens (growing one replays the conversation)."""
    sizing = backend_of(engine.pair.verifier.backend).chat_context(engine.compiled, engine.pair.verifier.device)
    if whole_context and sizing == "whole":
        prompt_tokens = engine.context_length - settings.max_tokens
    elif whole_context and sizing == "chat":
        prompt_tokens = max(prompt_tokens, CHAT_CONTEXT - settings.max_tokens)
    ks = k_values if k_values is not None else [settings.num_draft_tokens]
    report = reporter.task if reporter is not None else None
    widths = {w for k in ks for w in engine.step_widths(settings.max_draft_tokens if k == "auto" else int(k))}
    if engine.has_drafter and k_values is not None:
        widths.add(1)  # bench and calibrate also time the verifier alone
    engine.prepare(prompt_tokens + settings.max_tokens + 1, widths, report, slot=slot)
    if engine.compile_note and reporter is not None:
        reporter.warn(engine.compile_note)
    if probe and "auto" in ks and engine.probe_due():
        if reporter is not None:
            again = engine.costs.costs.knows(engine.cost_source)  # (known, but provisional)
            reporter.task(
                f"measuring step costs on this machine again ({taken(engine.costs.conditions or {})})"
                if again
                else "measuring step costs on this machine (once per pair, device and dtype)"
            )
        engine.probe_costs(settings.max_draft_tokens)


def generation_params(
    settings: Settings, ignore_eos: bool = False, given: dict[str, Any] | None = None
) -> GenerationParams:
    """The engine's parameters for ``settings`` (copy with ``dataclasses.replace`` to vary them);
    ``given``: what a request set of them (a rule parameter its rule does not take is an error)."""
    return GenerationParams(
        sampling=SamplingParams(float(settings.temperature), int(settings.top_k), float(settings.top_p)),
        rule=settings.rule,
        rule_kwargs=settings.rule_kwargs(given),
        num_draft_tokens=draft_limit(settings) if settings.draft else 0,
        adaptive_k=settings.num_draft_tokens == "auto",
        max_tokens=settings.max_tokens,
        stop=tuple(settings.stop),
        ignore_eos=ignore_eos,
        seed=int(settings.seed or 0),
    )


def encode(
    tokenizer: Any,
    messages: list[dict[str, Any]] | str,
    use_template: bool | None,
    tools: list | None = None,
    *,
    continue_final: bool = False,
    generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids for a plain prompt or a chat. ``use_template`` None: use the chat template
    when the tokenizer has one; True without one is an error. ``tools``: rendered by the
    template's tools section (serve's tool calls). ``continue_final``: the last message (an
    assistant's) is left open, so the answer continues its text (transformers'
    ``continue_final_message``; no generation prompt then); ``generation_prompt``: the assistant
    turn is opened after the last message; ``template_kwargs``: more variables for the template."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_template and not has_template:
        raise ConfigError("--chat-template: this tokenizer has no chat template; use --no-chat-template")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if (use_template is None and has_template) or use_template:
        extra = {"tools": tools} if tools else {}
        try:
            ids = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=generation_prompt and not continue_final,
                continue_final_message=continue_final,
                tokenize=True,
                **extra,
                **(template_kwargs or {}),
            )
        except ValueError as err:  # (the template changed the final message's text: it cannot be continued)
            if not continue_final:
                raise
            raise ConfigError(f"the final message cannot be continued: {err}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    text = "\n\n".join(m["content"] for m in messages if m["role"] != "system")
    return list(tokenizer(text)["input_ids"])


def protocol_ids(tok: Any, prompts: list, use_template: bool | None) -> list[tuple[Any, list[int]]]:
    """Each prompt as it asks to be given (``Prompt.protocol``: a code task with a chat template
    starts the reply too) and its token ids."""
    chat = bool(use_template) or (use_template is None and bool(getattr(tok, "chat_template", None)))
    out = []
    for p in prompts:
        p = p.protocol(chat)
        reply = list(tok(p.reply, add_special_tokens=False)["input_ids"]) if p.reply else []
        out.append((p, encode(tok, p.prompt, use_template) + reply))
    return out


def encode_prompts(engine: SpeculativeEngine, prompts: list, use_template: bool | None) -> list[tuple[Any, list[int]]]:
    """Encode a prompt set (``protocol_ids``), checking now (before a long run) that each fits."""
    out = protocol_ids(engine.pair.tokenizer, prompts, use_template)
    for p, ids in out:
        check_fits(engine, p, ids, f"prompt {p.id!r} is {len(ids)} tokens", "shorten it")
    return out


def check_fits(engine: SpeculativeEngine, prompt: Any, ids: list[int], what: str, fix: str) -> None:
    """Refuse ``prompt``'s token ``ids`` where they leave no room in the context window: the error
    says where the prompt comes from (its file and line, if any), then ``what`` and ``fix``."""
    if len(ids) >= engine.context_length:
        where = f"{prompt.where}: " if prompt.where else ""
        raise ConfigError(f"{where}{what} but the context window is {engine.context_length}; {fix}")
