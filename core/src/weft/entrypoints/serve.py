"""``weft serve``: the engine core in its own process, the starlette app under uvicorn in this one (and, with
``server.api_server_count``, in further API processes: :mod:`weft.entrypoints.api_servers`).

Shutdown (SIGINT, SIGTERM) is graceful (:mod:`weft.serve.lifecycle`): the listener
stays up answering 503 while in-flight requests finish, for at most
``server.shutdown_timeout`` seconds; then the rest end with an error, the core
stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import socket
import sys
import time

from starlette.applications import Starlette

from weft.config import WeftConfig
from weft.engine.api.async_engine import AsyncEngine
from weft.engine.api.torch_free import transformers_without_torch
from weft.engine.client import ProcessClient
from weft.entrypoints import api_servers
from weft.entrypoints.server_app import build_app_on, build_engine, build_server
from weft.plugins.lock import verify_plugin_lock
from weft.progress import report, report_summary
from weft.serve.lifecycle import FLUSH_SECONDS

STARTUP_TIMEOUT = 3600.0
"""Seconds the engine core (and each further API process) may take to start: loading a large model."""


def serve(config: WeftConfig) -> int:
    """Serve until interrupted; returns the exit status (1 when the engine core, or an API process, died)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    transformers_without_torch()  # the tokenizer's library, before anything imports it; the core imports torch
    verify_plugin_lock(config)  # a refused plugin set is the first thing said, before any step
    report("starting the engine for %s", config.model)
    count = config.server.api_server_count
    listener = api_servers.listen(config.server.host, config.server.port) if count > 1 else None
    metrics_folder = None
    others: api_servers.ApiServers | None = None
    try:
        engine = build_engine(config, connect=lambda: ProcessClient(config, STARTUP_TIMEOUT, count))
        if listener is not None:
            metrics_folder = api_servers.count_in_every_process()  # after the core started: it counts nothing
        app = build_app_on(engine, config)
        if listener is not None:
            others = api_servers.ApiServers(config, listener.getsockname()[1], engine.client.attach_addresses)
            try:
                others.start(engine.client.process.pid, STARTUP_TIMEOUT)
            except BaseException:
                others.stop(timeout=5)
                engine.stop()
                raise
        return _serve(config, app, engine, started, listener, others)
    finally:
        if listener is not None:
            listener.close()
        if metrics_folder is not None:
            shutil.rmtree(metrics_folder, ignore_errors=True)


def _serve(
    config: WeftConfig,
    app: Starlette,
    engine: AsyncEngine,
    started: float,
    listener: socket.socket | None,
    others: api_servers.ApiServers | None,
) -> int:
    state = app.state.server
    url = (
        f"http://{config.server.host}:{config.server.port}/v1 (OpenAI-compatible"
        f"{'; API key required' if state.api_key else ''}"
        f"{f'; {config.server.api_server_count} API processes' if others is not None else ''})"
    )
    report_summary({**engine.engine_settings, "sampling_defaults": state.model_sampling_defaults}, started, url)
    server = build_server(app, config)

    def core_died() -> None:
        # On the event loop (the engine's watch task). The listener stays up for FLUSH_SECONDS: the failed
        # requests' 503s and error events go out, and /health and new requests answer 503 (a load balancer
        # sees why), then the server exits.
        asyncio.get_running_loop().call_later(FLUSH_SECONDS, setattr, server, "should_exit", True)

    engine.on_core_death = core_died
    if others is not None:
        server.on_drain = others.signal_drain
        others.watch(server.request_shutdown)
    # What start-up built (transformers, the tokenizer, the app) lives as long as the server: frozen out of the
    # collector's sight, a collection scans only what requests allocate, not that whole heap again.
    gc.freeze()
    try:
        server.run(sockets=None if listener is None else [listener])
    finally:
        if others is not None:  # they drained beside this one; the core stops once they are gone
            others.stop(config.server.shutdown_timeout + 2 * FLUSH_SECONDS + 5)
        engine.stop()
    if engine.dead:
        reason = f": {engine.death_reason}" if engine.death_reason else ""
        print(
            f"weft: error: the engine core process died (exit code {engine.client.exitcode}){reason}", file=sys.stderr
        )
        return 1
    if others is not None and others.died is not None:
        print(f"weft: error: {others.died}", file=sys.stderr)
        return 1
    return 0
