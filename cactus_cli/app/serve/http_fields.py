"""Request fields other servers take (vLLM's, llama-server's, OpenAI's newer ones), beside the
ones app/serve/http_api.py validates. Each is honoured, ignored where it cannot change the answer
(and named in the ``x-cactus-ignored`` response header and the ``cactus.serve`` log), or refused
by name where honouring it is not possible yet (never a silent change of the answer):

- ``min_p``, ``logit_bias``: per-row transforms of the logits (core/sampling.py), applied to the
  verifier's q that every rule targets, so speculation stays exact;
- ``continue_final_message`` / ``add_generation_prompt`` (vLLM's): a final assistant message is
  continued (prefill; llama-server does it by default, and so does cactus), ``chat_template_kwargs``
  and ``reasoning_effort`` reach the chat template where it reads them;
- ``store``, ``metadata``, ``service_tier``, ``prediction``, ``cache_prompt``: ignored;
- ``repetition_penalty`` (and nonzero ``presence_penalty``, ``frequency_penalty``): refused."""

from __future__ import annotations

import inspect
import logging
import re
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from cactus_cli.app.serve.http_answer import ApiError
from cactus_cli.app.serve.serving import FieldError

log = logging.getLogger("cactus.serve")
IGNORED = ("store", "metadata", "service_tier", "prediction", "cache_prompt", "reasoning_effort")
PENALTY = (
    "a penalty over the tokens generated so far is not supported yet (under speculation it would have to "
    "count each drafted token before the position it scores); leave it out"
)
MAX_BIAS = 100.0  # OpenAI's range for a logit_bias value: -100 to 100


class OtherFields(BaseModel):
    """The fields both endpoints take from other servers."""

    model_config = ConfigDict(extra="forbid", strict=True)

    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    cache_prompt: bool | None = None  # (llama-server's: cactus reuses a cached prefix whatever it says)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v:
            raise ValueError(f"{PENALTY} (or 0)")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, v: float | None) -> float | None:
        if v is not None and v != 1:
            raise ValueError(f"{PENALTY} (or 1)")
        return v

    @field_validator("prediction")
    @classmethod
    def _prediction(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and (v.get("type") != "content" or not isinstance(v.get("content"), (str, list))):
            raise ValueError('a prediction is {"type": "content", "content": text or text parts}')
        return v


class ChatFields(BaseModel):
    """The fields /v1/chat/completions takes from other servers."""

    model_config = ConfigDict(extra="forbid", strict=True)

    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    modalities: list[str] | None = None

    @field_validator("modalities")
    @classmethod
    def _text(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise ValueError('cactus answers in text only: ["text"] or leave it out')
        return v


def ignored_header(body: BaseModel, render: dict[str, Any] | None = None) -> dict[str, str]:
    """The response header naming the fields ``body`` gave that cactus took without acting on them
    (``reasoning_effort`` only where ``render``, the chat's, did not pass it to the template); none:
    no header. Logged at info level too."""
    taken = (render or {}).get("template_kwargs", {})
    names = [key for key in IGNORED if getattr(body, key, None) is not None and key not in taken]
    if not names:
        return {}
    log.info("request fields ignored (they do not change the answer): %s", ", ".join(names))
    return {"x-cactus-ignored": ", ".join(names)}


def with_headers(answer: Any, headers: dict[str, str]) -> Any:
    """A whole answer (a dict, or the Response for a client that left) with ``headers``."""
    return JSONResponse(answer, headers=headers) if headers and isinstance(answer, dict) else answer


def sampling_fields(body: OtherFields, vocab_size: int) -> dict[str, Any]:
    """``min_p`` and ``logit_bias`` as SamplingParams keys (what the request left out: nothing)."""
    out: dict[str, Any] = {}
    if body.min_p:
        out["min_p"] = float(body.min_p)
    bias = getattr(body, "logit_bias", None)
    if bias:
        pairs: dict[int, float] = {}
        for key, value in bias.items():
            if not re.fullmatch(r"[0-9]{1,9}", key) or int(key) >= vocab_size:
                raise ApiError(400, f"logit_bias: {key[:20]!r} is not a token id (0 to {vocab_size - 1})", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_BIAS <= value <= MAX_BIAS:
                raise ApiError(400, f"logit_bias: the bias of {key} must be a number from -100 to 100", "logit_bias")
            pairs[int(key)] = float(value)
        out["logit_bias"] = tuple(sorted(pairs.items()))
    return out


def renamed(err: FieldError | ApiError, body: Any) -> tuple[str, str | None]:
    """An error's message and field, named as the client sent it (``max_completion_tokens`` is
    what the settings call ``max_tokens``)."""
    message, param = str(getattr(err, "message", err)), getattr(err, "param", None)
    if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        return re.sub(r"\bmax_tokens\b", "max_completion_tokens", message), "max_completion_tokens"
    return message, param


def _template_source(tokenizer: Any) -> str:
    source = getattr(tokenizer, "chat_template", None) or ""
    return " ".join(source.values()) if isinstance(source, dict) else str(source)


def _reserved(tokenizer: Any) -> set[str]:
    """Names a chat_template_kwargs key may not take: apply_chat_template's own parameters (the
    request's own fields say those) and the special tokens it passes the template."""
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    return own | set(getattr(tokenizer, "special_tokens_map", {}) or {}) | {"messages", "tools", "documents"}


def template_kwargs(body: ChatFields, tokenizer: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` checked (a flat object of JSON values, each key one the chat
    template reads: a key it never reads would be a silent no-op), with ``reasoning_effort`` where
    the template reads it (gpt-oss's does)."""
    source = _template_source(tokenizer)
    given = body.chat_template_kwargs or {}
    reserved = _reserved(tokenizer)
    for key, value in given.items():
        where = f"chat_template_kwargs.{key}"
        if not re.fullmatch(r"[A-Za-z_]\w*", key) or key in reserved:
            raise ApiError(400, f"{where}: not a template variable a request may set", "chat_template_kwargs")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise ApiError(400, f"{where}: values must be strings, numbers, booleans or null", "chat_template_kwargs")
        if not re.search(rf"\b{key}\b", source):
            raise ApiError(400, f"{where}: this model's chat template does not read {key!r}", "chat_template_kwargs")
    out = dict(given)
    if body.reasoning_effort is not None and re.search(r"\breasoning_effort\b", source):
        out.setdefault("reasoning_effort", body.reasoning_effort)
    return out


def chat_render(body: ChatFields, messages: list[dict[str, Any]], forced: bool, tokenizer: Any) -> dict[str, Any]:
    """How the chat template renders ``messages`` (runtime.encode's keywords). A final assistant
    message with text and no tool calls is continued (its text is the answer's start: the answer
    holds only what follows), as llama-server does, unless the request says otherwise
    (``continue_final_message``, ``add_generation_prompt``: vLLM's fields) or ``forced`` (a
    tool_choice that forces a call starts a new answer)."""
    last = messages[-1]
    prefill = last["role"] == "assistant" and bool(last.get("content")) and not last.get("tool_calls")
    cont, gen = body.continue_final_message, body.add_generation_prompt
    if cont and gen:
        raise ApiError(
            400,
            "continue_final_message: continuing the final message opens no new turn; "
            "leave add_generation_prompt out or false",
            "continue_final_message",
        )
    if cont and not prefill:
        raise ApiError(
            400,
            "continue_final_message: the last message must be an assistant's, with text and no tool calls",
            "continue_final_message",
        )
    if cont and forced:
        raise ApiError(
            400,
            "continue_final_message: a tool_choice that forces a call starts a new answer; send one or the other",
            "continue_final_message",
        )
    if cont is None:
        cont = prefill and not forced and gen is None
    kwargs = template_kwargs(body, tokenizer)
    return {"continue_final": cont, "generation_prompt": (not cont) if gen is None else gen, "template_kwargs": kwargs}
