"""What a connection may cost the front before its request is whole: the HTTP server's limits.

Rules:
- Requests are parsed by h11 (never httptools, which has no bound on a request head), with the head bounded
  by `coordinator.max_header_bytes`: a longer one is answered 400 and the connection closed, whatever it
  held so far, so N slow connections hold at most N x max_header_bytes.
- Every request must arrive whole (head and body) within `coordinator.request_read_timeout_s` of the
  connection opening or of the previous response ending; a connection that is still sending then (a
  slowloris, a client that stalled) is closed. Partial data does not restart the clock, unlike the keep-alive
  timer. The body is bounded separately (`coordinator.max_body_bytes`, coordinator/api.py).
- A client that half-closes after sending (EOF with its request whole, its answer not started) still gets its
  answer, and a client that left still gives its slot back at once: TCP shows both as EOF, so the front
  probes with a 102 (Processing) interim response, which HTTP/1.1 clients read past; a departed client's host
  answers it with a reset, which ends the request even while it is queued or prefilling. An EOF between
  requests, or once an answer is streaming, closes (as uvicorn does).
"""
from __future__ import annotations

import asyncio
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pool.config import Config

_WHOLE = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)
RESET_POLL_S = 0.1


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request to arrive whole (module rules)."""

    read_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in _WHOLE:
            self._disarm()

    def eof_received(self) -> bool | None:
        """The client sent EOF. Between requests (or before one is whole) it has left: close, as uvicorn does.
        With a request whole and its answer not started, it may only have half-closed: keep the connection, send
        a 102 (Processing) probe and watch for the reset a departed client's host answers it with. Once an answer
        has started (a stream), EOF closes: nothing could be sent to probe it without breaking the body."""
        cycle = self.cycle
        if (cycle is None or cycle.response_complete or cycle.response_started or self.transport.is_closing()
                or self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE)):
            return None
        try:
            probe = h11.InformationalResponse(status_code=102, headers=[], reason=b"Processing")
            self.transport.write(self.conn.send(probe))
        except h11.LocalProtocolError:
            return None
        self._watch_reset()
        return True

    def _watch_reset(self) -> None:
        """After an EOF: a reset (the client is gone) aborts the connection, which ends its request (the app
        sees a disconnect); checked every RESET_POLL_S until the answer is complete."""
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or cycle.response_complete:
            return
        sock = self.transport.get_extra_info("socket")
        try:
            failed = sock is None or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
        except OSError:
            failed = True
        if failed:
            self.transport.abort()
            return
        self.loop.call_later(RESET_POLL_S, self._watch_reset)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state not in _WHOLE:
            self._arm()  # the next request on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing() and self.conn.their_state not in _WHOLE:
            self.transport.close()


def server_config(app: Any, cfg: Config, **kw: Any) -> uvicorn.Config:
    """The uvicorn config of the front: h11 with the limits above, from `cfg.coordinator`."""
    c = cfg.coordinator
    protocol = type("FrontProtocol", (BoundedH11Protocol,), {"read_timeout_s": float(c.request_read_timeout_s)})
    return uvicorn.Config(app, http=protocol, h11_max_incomplete_event_size=c.max_header_bytes, **kw)
