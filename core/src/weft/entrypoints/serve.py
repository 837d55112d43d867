"""``weft serve``: the engine core in its own process, the starlette app under uvicorn in this one."""

from __future__ import annotations

import logging
import math
import sys

from starlette.applications import Starlette

from weft.config import WeftConfig
from weft.engine.async_engine import AsyncEngine
from weft.plugins import PluginRegistry
from weft.serve.app import create_app


def build_app(config: WeftConfig, registry: PluginRegistry | None = None) -> Starlette:
    """Start the engine core and return the app serving it (plugins' ``weft_http_routes`` included)."""
    registry = registry or PluginRegistry()
    engine = AsyncEngine(config, registry, config.server.max_queued_requests)
    try:
        routes = [route for contributed in registry.hooks().hook.weft_http_routes() for route in (contributed or ())]
        return create_app(engine, config, routes)
    except BaseException:
        engine.stop()
        raise


def graceful_timeout(config: WeftConfig) -> int:
    """uvicorn's wait for open connections at shutdown (it treats 0 as "forever", so at least 1 s)."""
    return max(1, math.ceil(config.server.shutdown_timeout))


def serve(config: WeftConfig) -> int:
    """Serve until interrupted; returns the exit status (1 when the engine core died)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    server = app.state.server
    print(
        f"weft: serving {server.model_name!r} on http://{config.server.host}:{config.server.port}/v1"
        f"{' (API key required)' if server.api_key else ''}",
        file=sys.stderr,
    )
    engine: AsyncEngine = server.engine
    uvicorn_server = uvicorn.Server(uvicorn.Config(
        app, host=config.server.host, port=config.server.port, log_level="info",
        timeout_graceful_shutdown=graceful_timeout(config),
    ))

    def core_died() -> None:
        uvicorn_server.should_exit = True

    engine.on_core_death = core_died
    try:
        uvicorn_server.run()
    finally:
        engine.stop()
    if engine.dead:
        reason = f": {engine.death_reason}" if engine.death_reason else ""
        print(f"weft: error: the engine core process died (exit code {engine.process.exitcode}){reason}", file=sys.stderr)
        return 1
    return 0
