"""How `cactus serve` answers (app/serve/http_api.py's routes hand each request here): the answer whole or
streamed as server-sent events, its text with the tool calls it makes taken out (app/serve/tools.py), each
token's log-probabilities, usage and what the speculation bought; errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from fastapi.sse import format_sse_event

from cactus_cli.app.serve.serving import Busy, Finished, Server
from cactus_cli.app.serve.tools import Calls
from cactus_cli.core.errors import CactusError
from cactus_cli.infer.decode.request import Request as GenRequest


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, param: str | None, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def usage(prompt_tokens: int, finished: Finished) -> dict[str, Any]:
    out = finished.stats.num_output_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": out,
        "total_tokens": prompt_tokens + out,
        "prompt_tokens_details": {"cached_tokens": finished.stats.reused_prefix_tokens},
    }


class Answer:
    """One answer as it is sent: its text (the tool calls it makes taken out of it, where the
    request declared tools) and each token's log-probabilities, chunk by chunk."""

    def __init__(self, tokenizer: Any, chat: bool, calls: Calls | None, logprobs: int | None):
        self.tok, self.chat, self.calls, self.logprobs = tokenizer, chat, calls, logprobs
        self.text: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []
        self.entries: list[tuple[int, float, tuple]] = []
        self.offset = 0  # (completions' text_offset)
        self.space = ""  # (tools declared) whitespace held back: an answer that makes calls ends without it

    def add(self, ev: Any) -> tuple[str, list[dict[str, Any]], list]:
        """An event's text to show, the calls it completed and its tokens' log-probabilities."""
        if self.calls is None:
            return self._keep(ev.text, [], self._logprobs(ev))
        text, calls = self.calls.feed(ev.text)
        return self._keep(self._unspaced(text), calls, self._logprobs(ev))

    def close(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest of the answer: streamed and whole, the same text (the whitespace around calls
        left out, as the newline the template puts before each call)."""
        if self.calls is None:
            return "", []
        text, calls = self.calls.close()
        text = self._unspaced(text)
        if not (calls or self.tool_calls):
            text, self.space = text + self.space, ""
        self._keep(text, calls, [])
        return text, calls

    def _unspaced(self, text: str) -> str:
        """``text`` after the whitespace held back, less its own trailing whitespace (held back
        until more text follows it)."""
        text = self.space + text
        kept = text.rstrip()
        self.space = text[len(kept) :]
        return kept

    @property
    def done(self) -> bool:
        """parallel_tool_calls false and its one call made: the answer can end."""
        return self.calls is not None and self.calls.done

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.tool_calls else reason

    def _keep(self, text: str, calls: list, entries: list) -> tuple[str, list, list]:
        self.text.append(text)
        self.tool_calls += calls
        self.entries += entries
        return text, calls, entries

    def _logprobs(self, ev: Any) -> list[tuple[int, float, tuple]]:
        """One entry per emitted token, the end token included: usage counts it (as vLLM does, which
        gives it its entry too), so the entries and ``completion_tokens`` agree."""
        if self.logprobs is None:
            return []
        return [(token, lp, top) for token, (lp, top) in zip(ev.emitted, ev.logprobs)]

    def logprob_block(self, entries: list) -> dict[str, Any] | None:
        """OpenAI's logprobs object for ``entries``: chat's ``content`` list, or completions'
        tokens, token_logprobs, top_logprobs and text_offset."""
        if self.logprobs is None:
            return None
        if self.chat:
            return {"content": [self._entry(t, lp, top) for t, lp, top in entries]}
        tokens = [self.tok.decode([t]) for t, _, _ in entries]
        offsets = []
        for piece in tokens:
            offsets.append(self.offset)
            self.offset += len(piece)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{self.tok.decode([i]): v for i, v in top} for _, _, top in entries],
            "text_offset": offsets,
        }

    def _entry(self, token: int, lp: float, top: tuple) -> dict[str, Any]:
        text = self.tok.decode([token])
        return {
            "token": text,
            "logprob": lp,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (alt := self.tok.decode([i])), "logprob": v, "bytes": list(alt.encode("utf-8"))}
                for i, v in top
            ],
        }

    def message(self, finish: str) -> dict[str, Any]:
        """The whole answer's choice."""
        text = "".join(self.text)
        logprobs = self.logprob_block(self.entries)
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tool_calls:
            message["content"] = text or None
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.tool_calls]
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reason(finish)}

    def chunk(self, text: str, calls: list, entries: list, finish: str | None, first: bool) -> dict[str, Any]:
        """A streamed chunk's choice."""
        logprobs = self.logprob_block(entries) if entries else None
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or not calls:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


async def _next(inbox: asyncio.Queue) -> Any:
    item = await inbox.get()
    if isinstance(item, Busy):
        raise ApiError(503, str(item), None, "server_error")
    if isinstance(item, CactusError):
        raise ApiError(400, str(item), getattr(item, "param", None))
    if isinstance(item, Exception):
        raise ApiError(500, f"generation failed: {type(item).__name__}: {item}", None, "server_error")
    return item


async def whole(
    server: Server, req: GenRequest, inbox: asyncio.Queue, head: dict, answer: Answer, n_prompt: int, request: Request
):
    """Wait for the whole answer; a client that leaves meanwhile cancels the request."""
    try:
        while True:
            try:
                item = await asyncio.wait_for(_next(inbox), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)  # (nobody reads it: the client has gone)
                continue
            if isinstance(item, Finished):
                break
            answer.add(item)
            if answer.done:
                req.cancel()  # (its one call is made: the rest is not needed)
    finally:
        req.cancel()  # (a no-op once the request is done)
    answer.close()
    return {
        **head,
        "object": "chat.completion" if answer.chat else "text_completion",
        "choices": [answer.message(_reason(item, answer))],
        "usage": usage(n_prompt, item),
        "speculative": server.speculative(req.params, item.stats),
    }


def _reason(finished: Finished, answer: Answer) -> str:
    """finish_reason: ``tool_calls`` where the answer made calls (its end may be the cancel that
    followed its one call), else the request's."""
    return answer.finish_reason("stop" if answer.done else finished.finish_reason)


async def stream(
    server: Server,
    req: GenRequest,
    inbox: asyncio.Queue,
    head: dict,
    answer: Answer,
    n_prompt: int,
    include_usage: bool,
):
    """One chunk per verification step's text (a tool call: one chunk when it is complete); the
    last carries the finish reason and what the speculation bought; ``data: [DONE]`` ends it. A
    client that leaves cancels the request (Starlette cancels this generator, and ``finally`` says so
    to the worker)."""
    kind = "chat.completion.chunk" if answer.chat else "text_completion"
    first = True
    try:
        while True:
            try:
                item = await _next(inbox)
            except ApiError as err:
                yield format_sse_event(data_str=json.dumps(error_body(err.message, err.param, err.kind)))
                break
            if isinstance(item, Finished):
                text, calls = answer.close()
                if text or calls:
                    chunk = {**head, "object": kind, "choices": [answer.chunk(text, calls, [], None, first)]}
                    yield format_sse_event(data_str=json.dumps(chunk))
                    first = False
                end = answer.chunk("", [], [], _reason(item, answer), first)
                last = {**head, "object": kind, "choices": [end]}
                last["speculative"] = server.speculative(req.params, item.stats)
                yield format_sse_event(data_str=json.dumps(last))
                if include_usage:  # (stream_options.include_usage: one more chunk, no choices)
                    tail = {**head, "object": kind, "choices": [], "usage": usage(n_prompt, item)}
                    yield format_sse_event(data_str=json.dumps(tail))
                break
            text, calls, entries = answer.add(item)
            if answer.done:
                req.cancel()
            if text or calls or entries:
                chunk = {**head, "object": kind, "choices": [answer.chunk(text, calls, entries, None, first)]}
                yield format_sse_event(data_str=json.dumps(chunk))
                first = False
        yield format_sse_event(data_str="[DONE]")
    finally:
        req.cancel()  # (a no-op once the request is done)
