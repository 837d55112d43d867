"""``weft serve``: the engine core in its own process, the starlette app under uvicorn in this one.

Shutdown (SIGINT, SIGTERM) is graceful (:mod:`weft.serve.lifecycle`): the listener
stays up answering 503 while in-flight requests finish, for at most
``server.shutdown_timeout`` seconds; then the rest end with an error, the core
stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time

from starlette.applications import Starlette

from weft.config import WeftConfig
from weft.engine.api.async_engine import AsyncEngine
from weft.engine.api.torch_free import transformers_without_torch
from weft.plugins import PluginRegistry
from weft.plugins.lock import verify_plugin_lock
from weft.progress import report, report_summary
from weft.serve.app import create_app
from weft.serve.lifecycle import FLUSH_SECONDS, GracefulServer, InFlightRequests, uvicorn_config


def build_app(config: WeftConfig, registry: PluginRegistry | None = None) -> Starlette:
    """Start the engine core and return the app serving it (plugins' ``weft_http_routes`` included)."""
    registry = registry or PluginRegistry()
    server = config.server
    engine = AsyncEngine(
        config,
        registry,
        server.max_queued_requests,
        request_timeout=server.request_timeout,
        tokenizer_threads=server.tokenizer_threads,
    )
    try:
        routes = [route for contributed in registry.hooks().hook.weft_http_routes() for route in (contributed or ())]
        return create_app(engine, config, routes)
    except BaseException:
        engine.stop()
        raise


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


def serve(config: WeftConfig) -> int:
    """Serve until interrupted; returns the exit status (1 when the engine core died)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    transformers_without_torch()  # the tokenizer's library, before anything imports it; the core imports torch
    verify_plugin_lock(config)  # a refused plugin set is the first thing said, before any step
    report("starting the engine for %s", config.model)
    app = build_app(config)
    state = app.state.server
    engine: AsyncEngine = state.engine
    url = (
        f"http://{config.server.host}:{config.server.port}/v1 (OpenAI-compatible"
        f"{'; API key required' if state.api_key else ''})"
    )
    report_summary({**engine.engine_settings, "sampling_defaults": state.model_sampling_defaults}, started, url)
    server = build_server(app, config)

    def core_died() -> None:
        # On the event loop (the engine's watch task). The listener stays up for FLUSH_SECONDS: the failed
        # requests' 503s and error events go out, and /health and new requests answer 503 (a load balancer
        # sees why), then the server exits.
        asyncio.get_running_loop().call_later(FLUSH_SECONDS, setattr, server, "should_exit", True)

    engine.on_core_death = core_died
    # What start-up built (transformers, the tokenizer, the app) lives as long as the server: frozen out of the
    # collector's sight, a collection scans only what requests allocate, not that whole heap again.
    gc.freeze()
    try:
        server.run()
    finally:
        engine.stop()
    if engine.dead:
        reason = f": {engine.death_reason}" if engine.death_reason else ""
        print(
            f"weft: error: the engine core process died (exit code {engine.client.exitcode}){reason}", file=sys.stderr
        )
        return 1
    return 0
