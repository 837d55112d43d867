"""``weft serve --api-server-count N``: N API processes on one port in front of one engine core (vLLM's flag).

One API process does every request's HTTP, tokenizing, detokenization and streaming. On a fast GPU it falls
behind the engine core (the Qwen3-0.6B workload at 256 streams kept it at 93% of a core, docs/benchmarks.md);
several share that work.

The first API process (``weft serve`` itself) binds its listening socket, starts the engine core with one pair
of ZMQ addresses per API process (:class:`~weft.engine.client.ProcessClient`), then starts the others
(:func:`run_api_server`, spawned) with their addresses and the core's pid. Each builds its own app (tokenizer,
chat template, metrics) on an :class:`~weft.engine.api.async_engine.AsyncEngine` attached to that core
(:class:`~weft.engine.client.AttachedClient`) and listens on the same port: every socket is bound with
``SO_REUSEPORT``, so the kernel spreads new connections over the processes by a hash of the client's address
(one process that accepts whole bursts of connections would take them all from a socket they shared). The core
sends each process the outputs of its own requests (:mod:`weft.engine.core.api_clients`).

Lifetimes:

- A signal to the first process (SIGTERM from a service manager, Ctrl-C) drains every process: the first passes
  SIGTERM on to the others, which ignore SIGINT (a terminal's Ctrl-C reaches the whole process group: one
  Ctrl-C is one drain, a second hurries them all). Once they have all exited, the first stops the core.
- Another API process that dies takes the server down: the first shuts down and exits with status 1, as when
  the core dies (the dead process's connections are gone, and its requests with them).
- When the core or the first process dies, the others notice within a second and exit.

Metrics: each process counts what it served in prometheus_client's multiprocess mode (a temporary folder in
``PROMETHEUS_MULTIPROC_DIR``, set after the core started, so that only the API processes write there), and
``GET /metrics`` on any of them adds every process's counts up (:mod:`weft.serve.metrics`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from weft.config import WeftConfig
from weft.engine.client import CoreStartError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

logger = logging.getLogger("weft.serve")

BACKLOG = 2048
"""The listening socket's queue of connections not yet accepted (uvicorn's default)."""


def listen(host: str, port: int) -> socket.socket:
    """One API process's listening socket (bound as uvicorn binds its own, and shareable: ``SO_REUSEPORT``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    listener.listen(BACKLOG)
    return listener


def count_in_every_process() -> str:
    """Put this process's metrics, and those of the processes it starts from now on, in a shared folder
    (prometheus_client's multiprocess mode); returns the folder. Call it before any metric is made."""
    from prometheus_client import values

    folder = tempfile.mkdtemp(prefix="weft-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    values.ValueClass = values.get_value_class()  # chosen when prometheus_client was imported: choose again
    return folder


class ApiServers:
    """The API processes beyond the first: started by :meth:`start`, watched, drained and stopped."""

    def __init__(self, config: WeftConfig, port: int, attach_addresses: list[tuple[str, str]]) -> None:
        """``port``: the one the first process listens on (``server.port``, or the one it was given for 0)."""
        self.config = config
        self.port = port
        self.attach_addresses = attach_addresses
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.died: str | None = None
        """Why the server goes down, when one of these processes died while it served."""
        self._stopping = threading.Event()

    def start(self, core_pid: int, startup_timeout: float) -> None:
        """Start them and wait until each serves (:class:`~weft.engine.client.CoreStartError` naming the first
        that could not)."""
        spawn = multiprocessing.get_context("spawn")
        pipes = []
        for index, addresses in enumerate(self.attach_addresses, start=1):
            receiver, sender = spawn.Pipe(duplex=False)
            process = spawn.Process(
                target=run_api_server,
                args=(self.config, index, addresses, core_pid, self.port, sender, startup_timeout),
                name=f"weft-api-server-{index}",
                daemon=False,
            )
            process.start()
            sender.close()
            self.processes.append(process)
            pipes.append(receiver)
        deadline = time.monotonic() + startup_timeout
        for index, (process, receiver) in enumerate(zip(self.processes, pipes, strict=True), start=1):
            while not receiver.poll(0.2):
                if not process.is_alive():
                    raise CoreStartError(f"API process {index} exited with code {process.exitcode} while starting")
                if time.monotonic() > deadline:
                    raise CoreStartError(f"API process {index} did not start within {startup_timeout:.0f} s")
            try:
                problem = receiver.recv()
            except EOFError:
                problem = f"it exited with code {process.join(5) or process.exitcode}"
            receiver.close()
            if problem:
                raise CoreStartError(f"API process {index} could not start: {problem}")

    def watch(self, on_death: Callable[[], None]) -> None:
        """Call ``on_death`` (from a thread of its own) when one of them exits before a drain or :meth:`stop`."""

        def run() -> None:
            while not self._stopping.wait(0.2):
                for index, process in enumerate(self.processes, start=1):
                    if not process.is_alive():
                        self.died = f"API process {index} (pid {process.pid}) exited with code {process.exitcode}"
                        logger.error("%s; the server is shutting down", self.died)
                        on_death()
                        return

        threading.Thread(target=run, name="weft-api-servers-watch", daemon=True).start()

    def signal_drain(self) -> None:
        """Drain them (each repeated call hurries them, as a second signal does); their exits are expected now."""
        self._stopping.set()
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for them to finish their drain, then kill what is left."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)  # idempotent with signal_drain: they drain once
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                logger.warning("API process %s did not stop within %g s; killing it", process.name, timeout)
                process.kill()
                process.join(5)


def run_api_server(
    config: WeftConfig,
    index: int,
    addresses: tuple[str, str],
    core_pid: int,
    port: int,
    ready: Connection,
    startup_timeout: float,
) -> None:
    """An API process beyond the first: its app on an engine attached to the running core, listening on ``port``
    beside the others. Says on ``ready`` that it serves (an empty string) or why it cannot."""
    import sys

    from weft.engine.api.torch_free import transformers_without_torch
    from weft.engine.client import AttachedClient
    from weft.entrypoints.server_app import build_app, build_server
    from weft.serve.lifecycle import FLUSH_SECONDS

    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s [api {index}]: %(message)s")
    multiprocessing.current_process().daemon = False
    transformers_without_torch()
    try:
        app = build_app(config, connect=lambda: AttachedClient(config, addresses, index, core_pid, startup_timeout))
        server = build_server(app, config, log_level="warning")
        listener = listen(config.server.host, port)
    except BaseException as error:  # the first process names it and stops the server
        ready.send(f"{type(error).__name__}: {error}")
        raise SystemExit(1) from None
    engine = app.state.server.engine
    server.ignores_sigint = True  # the first process passes the terminal's Ctrl-C on as SIGTERM

    def core_died() -> None:  # on the event loop, as in the first process: the failed requests' answers go out
        asyncio.get_running_loop().call_later(FLUSH_SECONDS, setattr, server, "should_exit", True)

    engine.on_core_death = core_died
    ready.send("")
    ready.close()
    gc.freeze()
    try:
        server.run(sockets=[listener])
    finally:
        engine.stop()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if engine.dead else 0)
