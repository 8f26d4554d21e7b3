"""The HTTP face of `cactus serve` (an interface, but no terminal: it lives beside what it
serves, app/serve/serving.py): OpenAI's /v1/models, /v1/completions and /v1/chat/completions
(streamed as server-sent events or whole), /health and /metrics, on FastAPI and uvicorn (the
`serve` extra). Requests are validated by pydantic models; every error is OpenAI's error shape
with the field it is about. What runs the requests is app/serve/serving.py; how an answer is sent,
app/serve/http_answer.py."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from cactus_cli.app.serve.http_answer import Answer, ApiError, error_body, whole
from cactus_cli.app.serve.http_answer import stream as answer_stream
from cactus_cli.app.serve.http_fields import (
    ChatFields,
    OtherFields,
    chat_render,
    ignored_header,
    renamed,
    sampling_fields,
    with_headers,
)
from cactus_cli.app.serve.http_guard import BodyGuard, json_problem
from cactus_cli.app.serve.serving import Busy, FieldError, Server
from cactus_cli.app.serve.tools import Calls, Tools, parse_tools, supports_tools, template_messages
from cactus_cli.core.errors import CactusError, ConfigError
from cactus_cli.infer.decode.grammar import Grammar

MAX_TOP_LOGPROBS = 20  # OpenAI's cap
UNSUPPORTED = {  # OpenAI fields cactus cannot honour, and what it does instead (a 400, never a silent ignore)
    "functions": "the deprecated function calls are not supported; use tools",
    "function_call": "the deprecated function calls are not supported; use tools and tool_choice",
    "best_of": "best_of is not supported (one sample per request)",
    "echo": "echo is not supported",
    "suffix": "suffix (insertion) is not supported",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # (keys a client adds to a message, as OpenAI's API ignores them)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None  # (None: an assistant message that only calls tools)
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message makes tool calls")
        return self

    def template(self) -> dict[str, Any]:
        """The message as the chat template takes it (a developer message is a system one)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        """The content as text (a list of parts: their text parts; any other part is refused)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    400, f"messages: only text content parts are supported, not {part.get('type')!r}", "messages"
                )
            parts.append(part["text"])
        return "".join(parts)


class _Common(OtherFields):
    """The fields both endpoints take: OpenAI's that cactus honours, then cactus's own (other
    servers' fields: http_fields.py)."""

    # strict: true is not 1, "yes" is not true and "3" is not 3 (OpenAI refuses them too); a float
    # field still takes an integer
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    # what clients send as defaults (null, [], {"type": "text"}) is taken; anything more: UNSUPPORTED
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    # cactus's own, per request
    rule: str | None = None
    delta: float | None = None
    num_draft_tokens: int | Literal["auto"] | None = None
    top_k: int | None = Field(None, ge=0)
    draft: str | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("cactus generates one choice per request; use n = 1")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be 0 to {MAX_TOP_LOGPROBS}")
        return v

    def wants_logprobs(self) -> int | None:
        """How many alternatives each token's log-probability comes with (None: no logprobs).
        Chat: ``logprobs: true`` and ``top_logprobs``; completions: ``logprobs: N``."""
        if isinstance(self.logprobs, bool) or self.logprobs is None:
            if self.top_logprobs and not self.logprobs:
                raise ApiError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
            return (self.top_logprobs or 0) if self.logprobs else None
        if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs: must be 0 to {MAX_TOP_LOGPROBS}", "logprobs")
        return self.logprobs

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty stop strings")
        return v

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if (problem := json_problem(data)) is not None:  # (first: nothing below may meet either)
            raise ApiError(400, problem[1], problem[0])
        if isinstance(data, dict):
            for key, why in UNSUPPORTED.items():
                if data.get(key) not in (None, [], {}) and not _default(key, data.get(key)):
                    raise ApiError(400, f"{key}: {why}", key)
        return data

    def grammar(self) -> Grammar | None:
        """What ``response_format`` asks the answer to be: text (None), any JSON object, or JSON
        valid against a schema (``strict`` or not: the answer always keeps the schema)."""
        fmt = self.response_format
        if fmt is None or fmt == {"type": "text"}:
            return None
        kind = fmt.get("type")
        if kind == "json_object":
            return Grammar.json_schema()
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ApiError(
                    400, "response_format: json_schema needs an object with a name and a schema", "response_format"
                )
            schema = spec.get("schema", {"type": "object"})
            if not isinstance(schema, dict) or not isinstance(spec.get("strict", False), (bool, type(None))):
                raise ApiError(
                    400,
                    "response_format: json_schema.schema must be a JSON object, strict a boolean",
                    "response_format",
                )
            return Grammar.json_schema(schema)
        raise ApiError(400, "response_format: type must be text, json_object or json_schema", "response_format")

    def overrides(self) -> dict[str, Any]:
        """The request's settings as Settings keys (what it did not give stays the server's)."""
        given = {
            "max_tokens": self.max_completion_tokens or self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "rule": self.rule,
            "delta": self.delta,
            "num_draft_tokens": self.num_draft_tokens,
            "draft": self.draft,
        }
        return {k: v for k, v in given.items() if v is not None}


class ChatRequest(ChatFields, _Common):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Common):
    prompt: str | list[int]

    @model_validator(mode="after")
    def _no_tools(self) -> CompletionRequest:
        for key in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(self, key) not in (None, [], "none"):
                raise ApiError(400, f"{key}: /v1/completions takes no tools; use /v1/chat/completions", key)
        return self

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: str | list[int]) -> str | list[int]:
        if not v:
            raise ValueError("the prompt is empty")
        return v


def _default(key: str, value: Any) -> bool:
    """A value that asks for nothing beyond plain text (what clients send when they set nothing)."""
    return {"response_format": {"type": "text"}, "best_of": 1, "echo": False}.get(key, ...) == value


def _field_of(err: dict[str, Any]) -> str:
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    return ".".join(loc[:1]) if loc else "body"


def _answer_errors(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours (ApiError) and pydantic's, naming the field."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if err.status == 503 else None
        return JSONResponse(error_body(err.message, err.param, err.kind), err.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        """Starlette's own errors (no such path, a method a route does not take, a body it could
        not parse) in the same shape."""
        detail = err.detail if isinstance(err.detail, str) else "the request could not be handled"
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message = {
            404: f"no such path: {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }
        return JSONResponse(
            error_body(message.get(err.status_code, detail), None, kind), err.status_code, headers=err.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        ours = first.get("ctx", {}).get("error")
        if isinstance(ours, ApiError):
            return await _api_error(request, ours)
        field = _field_of(first)
        if first.get("type") == "json_invalid":
            message, field = "the body is not valid JSON", None
        elif first.get("type") == "extra_forbidden":
            message = f"{field}: unknown field (cactus honours the OpenAI fields it documents, and its own)"
        else:
            message = f"{field}: {first.get('msg', 'invalid')}".replace("Value error, ", "")
        return JSONResponse(error_body(message, field, "invalid_request_error"), 400)


def _guard_requests(app: FastAPI, api_key: str | None) -> None:
    """Before any route: the API key (401), then the body (http_guard.BodyGuard: its size, framing
    and time; read only once the key is right)."""
    app.add_middleware(BodyGuard)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                body = error_body("a valid API key is needed: Authorization: Bearer KEY", None, "authentication_error")
                return JSONResponse(body, 401)
        return await call_next(request)


def build_app(server: Server, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="cactus", docs_url=None, redoc_url=None, openapi_url=None)
    _answer_errors(app)
    _guard_requests(app, api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while serving; 503 once stopping, so a load balancer takes the server out first."""
        if server.stopping.is_set():
            return JSONResponse({"status": "stopping"}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": server.model_id, "object": "model", "created": int(server.started), "owned_by": "cactus"}
        return {"object": "list", "data": [card | {"max_model_len": server.context_length}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        try:
            tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
            messages = template_messages([m.template() for m in body.messages])
        except FieldError as err:
            raise ApiError(400, str(err), err.param) from None
        render = chat_render(body, messages, bool(tools and tools.opening()), server.session.tokenizer)
        if tools is not None and not supports_tools(server.session.tokenizer):
            raise ApiError(
                400,
                "tools: this model's chat template renders no tools in the <tool_call> format cactus reads; "
                "serve a model whose template has a tools section (Qwen2.5, Qwen3, Hermes)",
                "tools",
            )
        return await _serve(body, request, messages, chat=True, tools=tools, render=render)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(body, request, body.prompt, chat=False)

    async def _serve(
        body: _Common, request: Request, prompt: Any, chat: bool, tools: Tools | None = None, render: dict | None = None
    ):
        check_model(body, server)
        logprobs = body.wants_logprobs()
        sampling = sampling_fields(body, server.session.engine.pair.vocab_size)
        grammar = answer_grammar(body, tools, server.session.tokenizer)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        try:
            ids = await loop.run_in_executor(None, _encode, server, prompt, chat, tools, grammar, render)
        except CactusError as err:
            raise ApiError(400, str(err), getattr(err, "param", None) or ("messages" if chat else "prompt")) from None
        label = json.dumps(prompt)[:2000] if server.log is not None else ""
        try:
            req = server.request(
                ids,
                body.overrides(),
                lambda item: loop.call_soon_threadsafe(inbox.put_nowait, item),
                label,
                logprobs,
                grammar,
                sampling,
            )
            server.submit(req)
        except Busy as err:
            raise ApiError(503, str(err), None, "server_error") from None
        except CactusError as err:
            raise ApiError(400, *renamed(err, body)) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "created": int(time.time()), "model": server.model_id}
        answer = Answer(server.session.tokenizer, chat, Calls(tools) if tools is not None else None, logprobs)
        headers = ignored_header(body, render)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = answer_stream(server, req, inbox, head, answer, len(ids), include_usage)
            return StreamingResponse(
                stream, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"}
            )
        return with_headers(await whole(server, req, inbox, head, answer, len(ids), request), headers)

    return app


def answer_grammar(body: _Common, tools: Tools | None, tokenizer: Any) -> Grammar | None:
    """What the answer must match: ``response_format``'s JSON, or a forced tool call's arguments
    (tool_choice required or named: they keep the tool's schema), or anything (None)."""
    grammar = body.grammar()
    if grammar is not None and tools is not None:
        raise ApiError(
            400,
            "response_format: an answer held to JSON cannot also call tools; send one or the other",
            "response_format",
        )
    return tools.grammar(tokenizer) if tools is not None else grammar


def check_model(body: _Common, server: Server) -> None:
    if body.model not in (None, server.model_id):
        raise ApiError(
            404,
            f"model {body.model!r} is not served here; this server serves {server.model_id!r}",
            "model",
            "not_found_error",
        )


def _encode(
    server: Server,
    prompt: Any,
    chat: bool,
    tools: Tools | None = None,
    grammar: Grammar | None = None,
    render: dict[str, Any] | None = None,
) -> list[int]:
    """Chat messages through the session (the chat template, the system prompt, the tools, and
    the answer's forced opening when ``tool_choice`` asks for a call); a completion's text as it
    is (it continues the text), or its token ids. ``grammar`` is checked here too (the first one
    builds the tokenizer's grammar view: ~1.5 s, off the event loop). ``render``: how the chat
    template renders the messages (http_fields.chat_render)."""
    if grammar is not None:
        param = "tools" if tools is not None else "response_format"
        try:
            server.session.engine.grammars.check(grammar)
        except ConfigError as err:
            raise FieldError(param, f"{param}: {err}") from None
    if chat:
        ids = server.session.encode(prompt, list(tools.tools) if tools is not None else None, **(render or {}))
        opening = tools.opening() if tools is not None else ""
        return ids + (list(server.session.tokenizer(opening, add_special_tokens=False)["input_ids"]) if opening else [])
    if isinstance(prompt, list):
        vocab = server.session.engine.pair.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ConfigError(f"prompt: token ids must be in 0..{vocab - 1}")
        return list(prompt)
    return list(server.session.tokenizer(prompt)["input_ids"])
