"""The starlette app: the routes of each API, the exception handlers and the middleware around them.

One module per API builds its responses: :mod:`weft.serve.chat` (Chat Completions),
:mod:`weft.serve.completions` (Completions), :mod:`weft.serve.responses` (Responses),
:mod:`weft.serve.utility` (models, tokenize, detokenize, health, metrics); the state behind
them is :class:`weft.serve.server.Server` (``request.app.state.server``).

Every handler validates its body into a msgspec Struct (:mod:`weft.serve.body`),
checks the model name (a plain string comparison: a request never names a path),
turns the request into engine requests (one per prompt and choice) and either
collects their deltas or streams them as server-sent events. Decoding bodies,
tokenization, chat templating and detokenization of prompts run on the engine's
tokenizer threads (:meth:`weft.engine.api.async_engine.AsyncEngine.off_loop`), never
on the event loop. Leaving a handler for any reason (a client that disconnects
included) aborts the engine requests that are still running, which frees their
KV blocks. A stream that ends in an error sends an OpenAI-shaped error event,
then ``[DONE]``.

Around the handlers: :class:`HTTPError` is answered by an exception handler with
OpenAI's error body; :class:`AuthMiddleware` asks the API routes for the key;
:class:`RequestIdMiddleware` names each response's request (``X-Request-Id``), lists
the request fields the server ignored (``x-weft-ignored-fields``) and answers an
unexpected exception with a generic 500 naming that id, never with its text.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from weft.config import WeftConfig
from weft.engine.api.async_engine import AsyncEngine
from weft.serve import protocol as p
from weft.serve.body import ClientGone, HTTPError
from weft.serve.chat import chat_completions
from weft.serve.completions import completions
from weft.serve.openapi import openapi_route
from weft.serve.responses import responses
from weft.serve.server import Server, request_id
from weft.serve.utility import detokenize, health, metrics, models, tokenize

logger = logging.getLogger("weft.serve")

API_ROUTES = (
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
)
"""The routes that need the API key (when one is set)."""
OPEN_ROUTES = (
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
)


def error_response(error: HTTPError) -> Response:
    body = p.ErrorResponse(
        p.ErrorBody(message=error.message, type=error.kind, param=error.param, code=str(error.status))
    )
    return Response(
        msgspec.json.encode(body), status_code=error.status, media_type="application/json", headers=error.headers
    )


def internal_error(request: Request) -> HTTPError:
    """The 500 for an unexpected exception: a generic message naming the request (the log has the rest)."""
    logger.exception("internal error in request %s (%s %s)", request_id(request), request.method, request.url.path)
    return HTTPError(500, f"internal error in request {request_id(request)}; the server log has the details")


async def http_error(request: Request, error: Exception) -> Response:
    """Exception handler: an :class:`HTTPError` a handler raised, with OpenAI's error body."""
    assert isinstance(error, HTTPError)
    return error_response(error)


async def client_gone(request: Request, error: Exception) -> Response:
    """Exception handler: the client left while its answer was being collected; the empty 499 (nginx's "client
    closed request") goes nowhere, and nothing is logged."""
    return Response(status_code=499)


async def starlette_http_error(request: Request, error: Exception) -> Response:
    """Exception handler: starlette's own (404 for a path no route has, 405 for a method), in OpenAI's shape."""
    status = getattr(error, "status_code", 500)
    return error_response(
        HTTPError(status, f"{request.method} {request.url.path}: {getattr(error, 'detail', 'error')}")
    )


class AuthMiddleware:
    """ASGI middleware: a request to one of ``paths`` needs ``Authorization: Bearer <key>`` when the server has
    a key (``server.api_key``, else ``$WEFT_API_KEY``); /health, /metrics, the OpenAPI document and plugins'
    routes are open."""

    def __init__(self, app: Any, server: Server, paths: frozenset[str]) -> None:
        self.app, self.server, self.paths = app, server, paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in self.paths:
            try:
                self.server.check_auth(Request(scope))
            except HTTPError as error:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


IGNORED_FIELDS_HEADER = "x-weft-ignored-fields"


class RequestIdMiddleware:
    """ASGI middleware: each response carries ``X-Request-Id`` and, when the body had top-level fields no API
    knows (accepted and ignored unless ``server.strict_fields``), ``x-weft-ignored-fields``; an exception a
    handler did not expect, before its response started, is a generic 500 naming the request."""

    def __init__(self, app: Any, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        started = False

        async def send_with_headers(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                headers["X-Request-Id"] = request_id(request)
                ignored = getattr(request.state, "ignored_fields", None)
                if ignored:
                    headers[IGNORED_FIELDS_HEADER] = ",".join(ignored)
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception:
            if started:  # the status went out: nothing to answer (streams end themselves with an error event)
                raise
            self.server.metrics.failed("internal")
            await error_response(internal_error(request))(scope, receive, send_with_headers)


def create_app(engine: AsyncEngine, config: WeftConfig, extra_routes: list[Any] = ()) -> Starlette:
    server = Server(engine, config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.drain(config.server.shutdown_timeout)  # done already after a signal (weft.serve.lifecycle)
        engine.stop()

    app = Starlette(
        routes=[*API_ROUTES, *OPEN_ROUTES, openapi_route(server.model_name), *extra_routes],
        middleware=[
            Middleware(RequestIdMiddleware, server=server),
            Middleware(AuthMiddleware, server=server, paths=frozenset(route.path for route in API_ROUTES)),
        ],
        exception_handlers={
            HTTPError: http_error,
            ClientGone: client_gone,
            StarletteHTTPException: starlette_http_error,
        },
        lifespan=lifespan,
    )
    # A path with a trailing slash is a 404: starlette's 307 to the path without it came before the API key's
    # check and built its Location from the client's Host header (``Host: evil.example``).
    app.router.redirect_slashes = False
    app.state.server = server
    return app
