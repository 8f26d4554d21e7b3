"""From resolved Settings to a ready engine: load the pair (or, on a tensor-parallel follower
rank under torchrun, serve rank 0 instead), build generation parameters, encode prompts. Shared
by every command and the lm-eval adapter, so they all behave the same."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from cactus_cli.app import follower
from cactus_cli.app.prompts import builtin_prompts
from cactus_cli.app.settings import Settings, draft_limit, parse_draft
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.events import NGRAM, SUFFIX
from cactus_cli.core.fileio import check_output_file
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.infer.costs import CostStore, cost_key
from cactus_cli.infer.draft import History, Lookup
from cactus_cli.infer.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.models import load_pair, tp_load_spec
from cactus_cli.infer.runners.compiled import compile_problem
from cactus_cli.infer.sources import ModelPair
from cactus_cli.infer.tp import group


def load_engine(
    settings: Settings,
    reporter=None,
    compile_mode: str | None = None,
    pair: ModelPair | None = None,
    quantize: str | None = None,
    backend: str | None = None,
) -> SpeculativeEngine:
    """Load the pair (or take ``pair``, already loaded) and build the engine, compiled or not
    (``compile_mode``, ``quantize`` and ``backend`` override the settings': bench times several).
    A rank > 0 of a torchrun tensor-parallel group never returns: it serves rank 0, then exits."""
    kind, model = parse_draft(settings.draft)
    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)  # (llama.cpp takes them at load)
    if pair is None and settings.tp > 1 and group.is_follower():
        follower.serve(
            tp_load_spec(
                settings.verifier,
                settings.tokenizer,
                settings.device,
                settings.dtype,
                quantize or settings.quantize,
                settings.tp,
            )
        )
        raise SystemExit(0)
    mode = compile_mode or settings.compile
    if pair is None:
        pair = load_pair(
            settings.verifier,
            model,
            settings.tokenizer,
            settings.device,
            settings.dtype,
            reporter,
            quantize or settings.quantize,
            settings.tp,
            settings.cross_vocab,
            backend or settings.backend,
            settings.threads,
            mode,
            tuple(p.prompt for p in builtin_prompts(None)),  # (a requantized verifier's quality is measured on them)
        )
    compiled, note = resolve_compile(mode, pair)
    if note and reporter is not None:
        reporter.warn(note)
    engine = SpeculativeEngine(pair, lookup(kind, settings, pair, reporter), compiled)
    for line in engine.costs.notes if reporter is not None else ():
        reporter.warn(line)
    return engine


def lookup(kind: str | None, settings: Settings, pair: ModelPair, reporter=None) -> Lookup | None:
    """The model-free drafting a draft value asks for; the suffix drafter's remembered history is
    loaded here (a file that cannot serve is one warning and an empty history)."""
    if kind == NGRAM:
        return Lookup(NGRAM, settings.ngram_max, settings.ngram_min)
    if kind != SUFFIX:
        return None
    history = None
    if settings.remember:
        path = check_output_file(settings.remember, "--remember")
        history, note = History.load(path, tokenizer_fingerprint(pair.tokenizer), pair.vocab_size)
        if reporter is not None:
            if note:
                reporter.warn(note)
            history.on_error = history.on_note = reporter.warn
    return Lookup(SUFFIX, history=history)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Names the vocabulary token ids belong to (a saved history is refused by another one)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]
    return f"{len(vocab)} tokens, sha256 {digest}"


CHAT_CONTEXT = 4096  # tokens a chat's llama.cpp context holds from the start
PROMPT_ALLOWANCE = 512  # tokens of prompt a compiled engine is sized for before it sees the prompt (chat)


def prepare(
    engine: SpeculativeEngine,
    settings: Settings,
    reporter=None,
    prompt_tokens: int = PROMPT_ALLOWANCE,
    k_values: list[int | str] | None = None,
    whole_context: bool = False,
) -> None:
    """Before anything is timed: compile the steps the run will take (a compiled engine), and
    when -k auto will run (``k_values`` lists the k a command will use) on a pair never timed on
    this machine, seed the cost model with a short probe. ``whole_context`` (chat): on CUDA the
    static caches are sized once for the whole context window (bounded by free memory), since
    growing one later re-records every graph of both models; on llama.cpp the context starts at
    CHAT_CONTEXT tokens (growing one replays the conversation)."""
    if whole_context and engine.compiled and engine.pair.verifier.device.type == "cuda":
        prompt_tokens = engine.context_length - settings.max_tokens
    elif whole_context and engine.pair.verifier.backend == "llama.cpp":
        prompt_tokens = max(prompt_tokens, CHAT_CONTEXT - settings.max_tokens)
    ks = k_values if k_values is not None else [settings.num_draft_tokens]
    report = reporter.task if reporter is not None else None
    widths = {w for k in ks for w in engine.step_widths(settings.max_draft_tokens if k == "auto" else int(k))}
    if engine.drafter is not None and k_values is not None:
        widths.add(1)  # bench and calibrate also time the verifier alone
    engine.prepare(prompt_tokens + settings.max_tokens + 1, widths, report)
    if engine.compile_note and reporter is not None:
        reporter.warn(engine.compile_note)
    if engine.drafter is not None and "auto" in ks and not engine.costs.costs.knows(engine.cost_source):
        if reporter is not None:
            reporter.task("measuring step costs on this machine (once per pair, device and dtype)")
        engine.probe_costs(settings.max_draft_tokens)


def resolve_compile(mode: str, pair: ModelPair) -> tuple[bool, str | None]:
    """``--compile`` to on/off, and a warning line when "on" cannot be honoured. auto: on for
    CUDA; on a CPU only where earlier runs of this pair measured the compiled verifier faster
    (compiling there costs a minute and pays only when a forward is overhead-bound)."""
    if mode == "off" or pair.verifier.backend == "llama.cpp":  # (--compile on chose torch)
        return False, None
    if pair.verifier.tp > 1:
        return False, ("--compile on does not combine with --tp yet; running eagerly" if mode == "on" else None)
    device = pair.verifier.device
    problem = compile_problem(device)
    if mode == "on":
        return (False, f"--compile on: {problem}; running eagerly") if problem else (True, None)
    if problem or device.type != "cuda" and not _measured_faster(pair):
        return False, None
    return True, None


def _measured_faster(pair: ModelPair) -> bool:
    """Both cost caches exist and the compiled verifier's one-token step was >= 10% faster."""
    t = []
    for compiled in (False, True):
        costs = CostStore.read(cost_key(pair, compiled)).costs
        if not costs.verify:
            return False
        t.append(costs.t_v(1))
    return t[1] < 0.9 * t[0]


def generation_params(settings: Settings, ignore_eos: bool = False) -> GenerationParams:
    """The engine's parameters for ``settings`` (copy with ``dataclasses.replace`` to vary them)."""
    return GenerationParams(
        sampling=SamplingParams(float(settings.temperature), int(settings.top_k), float(settings.top_p)),
        rule=settings.rule,
        rule_kwargs=settings.rule_kwargs(),
        num_draft_tokens=draft_limit(settings) if settings.draft else 0,
        adaptive_k=settings.num_draft_tokens == "auto",
        max_tokens=settings.max_tokens,
        stop=tuple(settings.stop),
        ignore_eos=ignore_eos,
        seed=int(settings.seed or 0),
    )


def encode(tokenizer: Any, messages: list[dict[str, str]] | str, use_template: bool | None) -> list[int]:
    """Token ids for a plain prompt or a chat. ``use_template`` None: use the chat template
    when the tokenizer has one; True without one is an error."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_template and not has_template:
        raise ConfigError("--chat-template: this tokenizer has no chat template; use --no-chat-template")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if (use_template is None and has_template) or use_template:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    text = "\n\n".join(m["content"] for m in messages if m["role"] != "system")
    return list(tokenizer(text)["input_ids"])


def encode_prompts(engine: SpeculativeEngine, prompts: list, use_template: bool | None) -> list[tuple[Any, list[int]]]:
    """Encode a prompt set as each prompt asks to be given (``Prompt.protocol``: a code task with
    a chat template starts the reply too), checking now (before a long run) that each fits."""
    tok = engine.pair.tokenizer
    chat = bool(use_template) or (use_template is None and bool(getattr(tok, "chat_template", None)))
    out = []
    for p in prompts:
        p = p.protocol(chat)
        ids = encode(tok, p.prompt, use_template) + (
            list(tok(p.reply, add_special_tokens=False)["input_ids"]) if p.reply else []
        )
        if len(ids) >= engine.context_length:
            where = f"{p.where}: " if p.where else ""
            raise ConfigError(
                f"{where}prompt {p.id!r} is {len(ids)} tokens but the context window is "
                f"{engine.context_length}; shorten it"
            )
        out.append((p, ids))
    return out
