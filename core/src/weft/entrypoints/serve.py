"""``weft serve``: the engine on its thread, the starlette app under uvicorn."""

from __future__ import annotations

import logging
import math
import sys

from starlette.applications import Starlette

from weft.config import WeftConfig
from weft.engine.async_engine import AsyncEngine
from weft.engine.llm_engine import LLMEngine
from weft.serve.app import create_app


def build_app(config: WeftConfig) -> Starlette:
    """Load the model and return the app serving it (plugins' ``weft_http_routes`` included)."""
    engine = LLMEngine(config)
    routes = [route for contributed in engine.hooks.hook.weft_http_routes() for route in (contributed or ())]
    return create_app(AsyncEngine(engine, config.server.max_queued_requests), config, routes)


def graceful_timeout(config: WeftConfig) -> int:
    """uvicorn's wait for open connections at shutdown (it treats 0 as "forever", so at least 1 s)."""
    return max(1, math.ceil(config.server.shutdown_timeout))


def serve(config: WeftConfig) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    server = app.state.server
    print(
        f"weft: serving {server.model_name!r} on http://{config.server.host}:{config.server.port}/v1"
        f"{' (API key required)' if server.api_key else ''}",
        file=sys.stderr,
    )
    uvicorn.run(
        app, host=config.server.host, port=config.server.port, log_level="info",
        timeout_graceful_shutdown=graceful_timeout(config),
    )
