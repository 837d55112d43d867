"""The pieces of ``weft serve``'s API process: its engine, the app on it and the uvicorn server for the app
(shared by :mod:`weft.entrypoints.serve`, :mod:`weft.entrypoints.api_servers` and the tests)."""

from __future__ import annotations

from collections.abc import Callable

from starlette.applications import Starlette

from weft.config import WeftConfig
from weft.engine.api.async_engine import AsyncEngine
from weft.engine.client import ProcessClient
from weft.plugins import PluginRegistry
from weft.serve.app import create_app
from weft.serve.lifecycle import GracefulServer, InFlightRequests, uvicorn_config


def build_engine(
    config: WeftConfig, registry: PluginRegistry | None = None, connect: Callable[[], ProcessClient] | None = None
) -> AsyncEngine:
    """Start the engine core (or, with ``connect``, attach to one) under the server's settings."""
    server = config.server
    return AsyncEngine(
        config,
        registry or PluginRegistry(),
        server.max_queued_requests,
        request_timeout=server.request_timeout,
        tokenizer_threads=server.tokenizer_threads,
        connect=connect,
    )


def build_app_on(engine: AsyncEngine, config: WeftConfig) -> Starlette:
    """The app serving ``engine`` (plugins' ``weft_http_routes`` included); the engine is stopped if it fails."""
    try:
        hooks = engine.registry.hooks().hook
        routes = [route for contributed in hooks.weft_http_routes() for route in (contributed or ())]
        return create_app(engine, config, routes)
    except BaseException:
        engine.stop()
        raise


def build_app(
    config: WeftConfig, registry: PluginRegistry | None = None, connect: Callable[[], ProcessClient] | None = None
) -> Starlette:
    """Start the engine core (``connect``: see :func:`build_engine`) and return the app serving it."""
    return build_app_on(build_engine(config, registry, connect), config)


def build_server(
    app: Starlette, config: WeftConfig, log_level: str = "info", port: int | None = None
) -> GracefulServer:
    """The uvicorn server for ``app`` (``port``: instead of ``server.port``), its requests tracked from their
    arrival (:class:`weft.serve.lifecycle.InFlightRequests`)."""
    settings = config.server
    engine: AsyncEngine = app.state.server.engine
    in_flight = InFlightRequests(app, engine, app.state.server.metrics.failed)
    return GracefulServer(
        uvicorn_config(
            in_flight, settings.host, settings.port if port is None else port, settings.header_timeout, log_level
        ),
        engine,
        settings.shutdown_timeout,
        in_flight,
    )
