"""uvicorn as Weft runs it: a graceful shutdown that keeps the listener up, and slow-client timeouts.

:class:`GracefulServer`: on SIGINT or SIGTERM (or :meth:`GracefulServer.request_shutdown`)
the engine stops admitting requests: new ones, on the still-open listener, get
503 with ``Retry-After`` and ``/health`` answers 503. Requests in flight may
finish for ``server.shutdown_timeout`` seconds; each one still running then ends
(a stream with an OpenAI-shaped error event and ``[DONE]``, a plain request with
a 503). Only then does uvicorn close the listener and the process exit, with
status 0. A second signal ends the wait at once. uvicorn's own handling (close
the listener first, cancel what is left, re-raise the signal) is not used.

:class:`TimedH11Protocol`: a connection that has not sent a request's complete
headers ``server.header_timeout`` seconds after it opened (or after its previous
response) gets a 408 and is closed. Slow bodies are :mod:`weft.serve.body`'s
``server.body_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from weft.engine.async_engine import AsyncEngine

logger = logging.getLogger("weft.serve")

FLUSH_SECONDS = 1.0
"""After a drain, how long the handlers get to write their last events before the listener closes."""


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers."""

    header_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        handle = getattr(self, "_header_deadline", None)
        if handle is not None:
            handle.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is still going out (a pipelined request waits for it)
        body = f"request headers not received within {self.header_timeout:g} s (server.header_timeout)\n".encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode() + body
        )
        self.transport.close()


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose shutdown drains the engine first (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it would close the listener at once and re-raise the signal at exit.
        logger.info("received %s: draining (new requests get 503 for up to %g s)", signal.Signals(sig).name,
                    self.shutdown_timeout)
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """Start the graceful shutdown (from any thread, or a signal handler); a second call hurries it."""
        if self._loop is None or self._loop.is_closed():
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._draining:
            self.engine.hurry()
            return
        self._draining = True
        asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.engine.drain(self.shutdown_timeout)
            deadline = time.monotonic() + FLUSH_SECONDS
            while self._responses_in_flight() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            self.should_exit = True

    def _responses_in_flight(self) -> bool:
        return any(getattr(connection, "cycle", None) is not None and not connection.cycle.response_complete
                   for connection in self.server_state.connections)


def uvicorn_config(app: Any, host: str, port: int, header_timeout: float, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for a Weft app: the timed h11 protocol, a short final wait (the drain came first)."""
    protocol = type("WeftH11Protocol", (TimedH11Protocol,), {"header_timeout": header_timeout})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          timeout_graceful_shutdown=int(FLUSH_SECONDS) + 1)
