"""The connection guard of `cactus serve`: uvicorn's HTTP protocol with a header timeout (a
transport concern, beside app/serve/http_api.py, which shapes requests and answers)."""

from __future__ import annotations

import asyncio

HEADER_TIMEOUT = 30.0  # seconds a connection may take to send a request's headers before it is closed


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
