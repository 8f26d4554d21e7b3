"""The connection guard of `cactus serve`: uvicorn's HTTP protocol with a header timeout, the
request body's guard (its size as received, its framing, its time) and its JSON's (no lone
surrogate, no deep nesting): what any request must pass, beside app/serve/http_api.py, which shapes
requests and answers. Nothing here needs the serve extra (the CLI imports it at its start)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

HEADER_TIMEOUT = 30.0  # seconds a connection may take to send a request's headers before it is closed
MAX_BODY_BYTES = 8 * 1024 * 1024  # a request larger than this is refused (413) before it is parsed
BODY_TIMEOUT = 60.0  # seconds a request's body may take to arrive in full after its headers (then 408)
MAX_DEPTH = 64  # JSON nested deeper than this in a request is refused (chat templates' tojson recurses)
NAMED = 8  # levels of a path an error names (deeper ones: "...")


def guarded_http():
    """uvicorn's h11 protocol with a header timeout: a connection that opens and sends nothing, or
    part of a request's headers, is closed after HEADER_TIMEOUT seconds instead of held forever
    (each one holds a file descriptor; slowloris). A request whose headers arrived is not timed."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _waiting(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(HEADER_TIMEOUT, self._timed_out)

        def _timed_out(self) -> None:
            self._header_timer = None
            if self._waiting() and not self.transport.is_closing():
                self.transport.close()

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self._waiting() and self.conn.their_state is not h11.MUST_CLOSE:
                self._arm()  # (between requests on a kept-alive connection too, once bytes arrive)
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11


class BodyGuard:
    """ASGI middleware: a request's whole body, read before the app sees it, or one clear error and
    the connection closed: 411 for a POST without Content-Length, 400 for Transfer-Encoding sent
    with Content-Length (RFC 9112: the framing is in doubt), 413 once more than MAX_BODY_BYTES
    arrive (counted as received, whatever the headers said), 408 when it has not all arrived
    BODY_TIMEOUT seconds after the headers (a body that stalls held its socket for good)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if b"content-length" in headers and b"transfer-encoding" in headers:
            return await _refuse(send, 400, "send a body with Content-Length or Transfer-Encoding, not both")
        length = headers.get(b"content-length", b"")
        if scope["method"] == "POST" and not length:  # (a body of unknown length could be any size)
            return await _refuse(send, 411, "a request body needs a Content-Length header")
        if length and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return await _refuse(send, 413, _over())
        body, more = bytearray(), True
        deadline = asyncio.get_running_loop().time() + BODY_TIMEOUT
        while more:
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                return await _refuse(send, 408, f"the body did not arrive within {BODY_TIMEOUT:g} s of the headers")
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > MAX_BODY_BYTES:
                return await _refuse(send, 413, _over())
        read = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replay() -> dict[str, Any]:  # the body once, then what the connection says (a disconnect)
            return read.pop() if read else await receive()

        return await self.app(scope, replay, send)


def _over() -> str:
    limit = f"{MAX_BODY_BYTES >> 20} MiB" if MAX_BODY_BYTES >= 1 << 20 else f"{MAX_BODY_BYTES}-byte"
    return f"the body is over the {limit} limit"


async def _refuse(send: Any, status: int, message: str) -> None:
    """One error in OpenAI's shape, and the connection closed (what is left of the body is not read)."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}  # (OpenAI's shape)
    body = json.dumps({"error": error}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": [*head, (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def json_problem(doc: Any) -> tuple[str | None, str] | None:
    """What no model can take in a request's JSON, as (top-level field, message naming the place):
    a lone surrogate ("\\ud800": valid JSON, but no text a tokenizer or a chat template takes) in
    any string or key, or nesting deeper than MAX_DEPTH (templates and the tool-call reader
    recurse). A tool call's arguments, JSON in a string, are looked into too. None: fine."""
    stack: list[tuple[Any, str, int]] = [(doc, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        field = where.split(".")[0].split("[")[0]
        if depth > MAX_DEPTH:
            return field, f"{where}: nested deeper than {MAX_DEPTH} levels; send flatter JSON"
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and (bad := _lone_surrogate(key)):
                    return (
                        field or None,
                        f"{where or 'the body'}: a key holds an unpaired surrogate ({bad}); send valid Unicode",
                    )
                stack.append((item, _path(where, f".{key}" if where else str(key), depth), depth + 1))
        elif isinstance(value, list):
            nested = ((i, item) for i, item in enumerate(value) if isinstance(item, (dict, list, str)))
            stack.extend((item, _path(where, f"[{i}]", depth), depth + 1) for i, item in nested)
        elif isinstance(value, str):
            if bad := _lone_surrogate(value):
                return field, f"{where}: the text holds an unpaired surrogate ({bad}); send valid Unicode"
            if where.startswith("messages[") and where.endswith(".function.arguments"):
                try:
                    stack.append((json.loads(value), where, depth))
                except RecursionError:
                    return field, f"{where}: nested deeper than {MAX_DEPTH} levels; send flatter JSON"
                except ValueError:
                    pass  # (not JSON: the tool-call reader says so)
    return None


def _path(where: str, step: str, depth: int) -> str:
    return where + step if depth < NAMED else where if where.endswith("...") else where + "..."


def _lone_surrogate(text: str) -> str | None:
    """The first lone surrogate in ``text``, escaped as JSON writes it (None: valid Unicode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"\\u{ord(text[err.start]):04x}"
    return None
