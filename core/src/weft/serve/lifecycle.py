"""uvicorn as Weft runs it: a graceful shutdown that keeps the listener up, and slow-client timeouts.

:class:`GracefulServer`: on SIGINT or SIGTERM (or :meth:`GracefulServer.request_shutdown`)
the server stops admitting requests: new ones, on the still-open listener, get
503 with ``Retry-After`` and ``/health`` answers 503. Requests in flight, from
their arrival on (:class:`InFlightRequests`: still sending their body or being
tokenized, or in the engine), may finish for ``server.shutdown_timeout``
seconds; each one still running then ends (a stream with an OpenAI-shaped error
event and ``[DONE]``, any other with a 503), and the responses get
:data:`FLUSH_SECONDS` to go out. Only then does uvicorn close the listener and
the process exit, with status 0. A second signal ends the wait at once.
uvicorn's own handling (close the listener first, cancel what is left, re-raise
the signal) is not used.

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
from collections.abc import Callable
from types import FrameType
from typing import Any

import h11
import msgspec
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from weft.engine.api.async_engine import AsyncEngine
from weft.serve.app import error_response
from weft.serve.body import HTTPError

logger = logging.getLogger("weft.serve")

FLUSH_SECONDS = 1.0
"""After a drain, how long the handlers get to write their last events before the listener closes."""
KEEP_ALIVE_SECONDS = 15
"""How long an idle keep-alive connection stays open (uvicorn's ``timeout_keep_alive``). Longer than the idle
expiry of the usual client pools (httpx, under the ``openai`` client: 5 s), so that the server does not close a
connection at the moment a client reuses it (that client would see a connection error); shorter than
``server.header_timeout``'s default, so an idle connection ends quietly rather than with a 408."""


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
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        self.transport.close()


class _Served(msgspec.Struct):
    """One API call's progress, as :class:`InFlightRequests` sees it."""

    responding: bool = False
    """Its response has started (a stream's headers went out)."""
    cut: bool = False
    """The end of a drain cancelled its handler."""


class InFlightRequests:
    """ASGI middleware: the API calls (POST requests) being served, from their arrival to their response's end
    (GETs are quick answers, and a drain does not wait for them).

    Each request's arrival is stamped on it (``request.state.arrival``, ``time.monotonic()``): its
    ``server.request_timeout`` counts from there, and a drain admits the requests that arrived before it
    began. A POST that arrives while the engine refuses requests (draining, or its core died) gets its
    503 at once. :meth:`cut` ends the requests a drain left running.
    """

    def __init__(self, app: Any, engine: AsyncEngine, failed: Callable[[str], None] = lambda reason: None) -> None:
        self.app = app
        self.engine = engine
        self.failed = failed
        """Told ``"shutdown"`` for each request :meth:`cut` answers."""
        self._running: dict[asyncio.Task, _Served] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        arrival = time.monotonic()
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival"] = arrival
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        refusal = self.engine.refusal(arrival)
        if refusal is not None:
            await error_response(HTTPError(503, refusal, headers={"Retry-After": "5"}))(scope, receive, send)
            return
        served = _Served()
        task = asyncio.current_task()
        assert task is not None

        async def watched(message: dict[str, Any]) -> None:
            served.responding = served.responding or message["type"] == "http.response.start"
            await send(message)

        self._running[task] = served
        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            if not served.cut:
                raise
            task.uncancel()
            self.failed("shutdown")
            if served.responding:  # a stream that outlived the flush: end its body where it is
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            request_id = scope["state"].get("request_id")
            response = error_response(
                HTTPError(
                    503,
                    f"the server is shutting down{f' (request {request_id})' if request_id else ''}; retry later",
                    headers={"Retry-After": "5", **({"X-Request-Id": request_id} if request_id else {})},
                )
            )
            await response(scope, receive, send)
        finally:
            del self._running[task]

    def busy(self) -> bool:
        """Whether any API call is being served."""
        return bool(self._running)

    def cut(self, responding: bool) -> int:
        """Cancel the handlers still running that have not started a response (``responding``: also those that
        have); each is answered 503 (a started response is ended as it is). Returns how many."""
        cut = [
            (task, served)
            for task, served in self._running.items()
            if not served.cut and (responding or not served.responding)
        ]
        for task, served in cut:
            served.cut = True
            task.cancel()
        return len(cut)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose shutdown drains the engine and the HTTP requests first (see the module docstring)."""

    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float, in_flight: InFlightRequests
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.in_flight = in_flight
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_started: float | None = None
        """When the first signal came (``time.monotonic()``); the log's times count from it."""
        self.on_drain: Callable[[], None] | None = None
        """Called when the drain begins and when it is hurried (the first of several API processes passes it
        on to the others, :mod:`weft.entrypoints.api_servers`)."""
        self.ignores_sigint = False
        """SIGINT does nothing (an API process beyond the first: the first passes the terminal's Ctrl-C on)."""

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it would close the listener at once and re-raise the signal at exit.
        if sig == signal.SIGINT and self.ignores_sigint:
            return
        name = signal.Signals(sig).name
        if self._drain_started is None:
            key = "Ctrl-C" if sig == signal.SIGINT else name
            logger.warning(
                "%s: waiting up to %g s (server.shutdown_timeout) for the requests in flight to finish; "
                "new ones get 503. %s again stops at once",
                name,
                self.shutdown_timeout,
                key,
            )
        else:
            logger.warning("%s again: stopping now, %.1f s into the wait", name, time.monotonic() - self._drain_started)
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """Start the graceful shutdown (from any thread, or a signal handler); a second call hurries it."""
        if self._drain_started is None:
            self._drain_started = time.monotonic()
        if self._loop is None or self._loop.is_closed():
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self.on_drain is not None:
            self.on_drain()
        if self._draining:
            self.engine.hurry()
            return
        self._draining = True
        asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.engine.drain(self.shutdown_timeout, busy=self.in_flight.busy)
            unanswered = self.in_flight.cut(responding=False)
            if unanswered:
                logger.warning(
                    "shutdown: %d requests not yet in the engine after %.1f s; answered 503",
                    unanswered,
                    time.monotonic() - (self._drain_started or time.monotonic()),
                )
            deadline = time.monotonic() + FLUSH_SECONDS
            while self.in_flight.busy() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            unfinished = self.in_flight.cut(responding=True)
            if unfinished:
                logger.warning("shutdown: %d responses still going out after %g s; cut", unfinished, FLUSH_SECONDS)
            deadline = time.monotonic() + FLUSH_SECONDS
            while self.in_flight.busy() and time.monotonic() < deadline:  # the cut handlers answer at once
                await asyncio.sleep(0.01)
        finally:
            self.should_exit = True


def uvicorn_config(app: Any, host: str, port: int, header_timeout: float, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for a Weft app: the timed h11 protocol, a short final wait (the drain came first)."""
    protocol = type("WeftH11Protocol", (TimedH11Protocol,), {"header_timeout": header_timeout})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol,
        timeout_graceful_shutdown=int(FLUSH_SECONDS) + 1,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
