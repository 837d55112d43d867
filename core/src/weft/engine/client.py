"""How the API side talks to the engine core: one contract, with the core in the caller's process or its own.

:class:`CoreClient` is what :class:`~weft.engine.api.llm_engine.LLMEngine` (``LLM``) and
:class:`~weft.engine.api.async_engine.AsyncEngine` (``weft serve``) drive: they add tokenized requests
(:class:`~weft.engine.messages.EngineCoreRequest`), abort them, and take the core's
:class:`~weft.engine.messages.StepOutputs`. Both implementations share the core's rules, written once in
:meth:`EngineCore.step_outputs <weft.engine.core.engine_core.EngineCore.step_outputs>`: a step that raises
is retried once (its running requests recomputed); one that fails again aborts every request the core
holds, so the core serves the next ones. Requests the core refuses, when added or once their constraint
failed to compile, come back in the next outputs' ``refused``; a request that hit a stop string (found on
the API side, :mod:`weft.engine.api.output_processor`) is aborted through :meth:`CoreClient.abort`.

- :class:`InProcessClient` holds the core and steps it when asked for outputs; a step that failed twice
  raises its error in the caller (the one who stepped), after the core aborted the requests.
- :class:`ProcessClient` spawns the core's process (:mod:`weft.engine.core.core_process`), waits for its
  handshake and talks to it over two ZMQ sockets; the core steps on its own, and a step that failed twice
  comes back as the requests' ``failed`` reasons.

This module imports no torch: the core's modules are imported by the in-process client when it is built,
and in the core's own process otherwise.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import msgspec

from weft.engine.messages import (
    Abort,
    AddRequests,
    EngineCoreRequest,
    Failed,
    FromCore,
    Ready,
    Shutdown,
    StepOutputs,
    ToCore,
)

if TYPE_CHECKING:
    from weft.config import WeftConfig
    from weft.contracts.loader import ModelSource
    from weft.plugins import PluginRegistry

logger = logging.getLogger("weft.engine")


class CoreStartError(RuntimeError):
    """The engine core process could not build the engine."""


class CoreClient(ABC):
    """The API side's handle on one engine core."""

    engine_settings: dict[str, object]
    """The effective engine settings (platform-sized defaults resolved), for logs and ``weft config show``."""

    @abstractmethod
    def add_requests(self, requests: list[EngineCoreRequest]) -> bool:
        """Hand the requests to the core; False when the core is gone (none was taken). Those the core refuses
        come back in a later :meth:`get_outputs`' ``refused``."""

    @abstractmethod
    def abort(self, request_ids: list[str]) -> None:
        """End the requests in the core and free their KV blocks (also those finished, or unknown there)."""

    @abstractmethod
    def get_outputs(self, timeout: float) -> list[StepOutputs]:
        """What the core produced since the last call, waiting up to ``timeout`` seconds for something."""

    @abstractmethod
    def close(self, timeout: float) -> None:
        """Stop the core: it finishes its step and its KV connector's saves within ``timeout`` seconds. Idempotent."""


class InProcessClient(CoreClient):
    """The core in the caller's process, stepped by :meth:`get_outputs` (``LLM``)."""

    def __init__(self, config: WeftConfig, registry: PluginRegistry) -> None:
        from weft.engine.core.builder import build_engine_core

        self.core = build_engine_core(config, registry)
        self.config: WeftConfig = self.core.config
        """The resolved configuration the core was built from."""
        self.source: ModelSource = self.core.source
        self.engine_settings = self.core.describe()
        self._refused: dict[str, str] = {}
        """Requests the core refused when added, for the next outputs."""

    def add_requests(self, requests: list[EngineCoreRequest]) -> bool:
        for request in requests:
            try:
                self.core.add_request(request)
            except ValueError as error:
                self._refused[request.request_id] = str(error)
        return True

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)

    @property
    def has_unfinished(self) -> bool:
        """Whether the core holds requests not finished (steps in flight and KV saves aside)."""
        return self.core.has_unfinished or bool(self._refused)

    def get_outputs(self, timeout: float = 0.0) -> list[StepOutputs]:
        """One step, when the core has work (``timeout`` is not used: the step is the wait). A step that failed
        twice, or was interrupted, raises its error here once the core aborted every request it held."""
        from weft.engine.core.engine_core import StepFailed

        refused, self._refused = self._refused, {}
        if not self.core.has_work:
            return [StepOutputs([], self.core.stats(), refused)] if refused else []
        try:
            return [self.core.step_outputs(refused)]
        except StepFailed as failure:
            error = failure.__cause__
        assert error is not None
        raise error

    def close(self, timeout: float = 60.0) -> None:
        self.core.close(timeout)


class ProcessClient(CoreClient):
    """The core in its own process (``weft serve``): spawned here, fed and drained over ZMQ.

    :meth:`add_requests` and :meth:`abort` never block (call them from one thread, the event loop's);
    :meth:`get_outputs` is for one other thread (the reader's)."""

    def __init__(self, config: WeftConfig, startup_timeout: float, api_servers: int = 1) -> None:
        """Start the core process and wait up to ``startup_timeout`` seconds for it to build the engine
        (:class:`CoreStartError` when it could not). ``api_servers``: the API processes the core serves; this is
        the first, the others attach through :attr:`attach_addresses` (:class:`AttachedClient`)."""
        self.config = config
        self._folder = tempfile.mkdtemp(prefix="weft-core-")
        addresses = [(f"ipc://{self._folder}/in-{i}", f"ipc://{self._folder}/out-{i}") for i in range(api_servers)]
        self.attach_addresses = addresses[1:]
        """The (input, output) addresses the other API processes bind, in order."""
        self._bind(*addresses[0])
        from weft.engine.core.core_process import run_engine_core  # torch-free: the core imports its modules

        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=run_engine_core,
            args=(config, [address for address, _ in addresses], [address for _, address in addresses], os.getpid()),
            name="weft-engine-core",
            daemon=True,
        )
        self.process.start()
        self.engine_settings = self._handshake(startup_timeout)
        logger.debug("engine core process %d ready: %s", self.process.pid, self.engine_settings)

    def _bind(self, input_address: str, output_address: str) -> None:
        import zmq

        self.death_reason = ""
        """Why the core stopped, when it said (its workers failed)."""
        self._zmq = zmq.Context()
        self._input = self._zmq.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(input_address)
        self._output = self._zmq.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._closed = False

    def _handshake(self, timeout: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while not self._output.poll(200):
            if not self.alive:
                self._close_sockets()
                raise CoreStartError(f"the engine core process exited with code {self.exitcode} while starting")
            if time.monotonic() > deadline:
                self._kill()
                self._close_sockets()
                raise CoreStartError(f"the engine core did not start within {timeout:.0f} s")
        message = self._decoder.decode(self._output.recv())
        if isinstance(message, Failed):
            self._reap()
            self._close_sockets()
            logger.debug("the engine core's traceback:\n%s", message.traceback)
            raise CoreStartError(f"the engine core could not start: {message.message}")
        assert isinstance(message, Ready)
        return message.engine

    def _kill(self) -> None:
        self.process.kill()

    def _reap(self) -> None:
        """The core said it failed: wait for its process to end."""
        self.process.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    @property
    def client_index(self) -> int:
        """This API process's index among those the core serves."""
        return 0

    def add_requests(self, requests: list[EngineCoreRequest]) -> bool:
        return self._send(AddRequests(requests, self.client_index))

    def abort(self, request_ids: list[str]) -> None:
        self._send(Abort(request_ids))

    def _send(self, message: ToCore) -> bool:
        """Send to the core without ever blocking; False when no core is connected (it died)."""
        import zmq

        try:
            self._input.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:  # a PUSH socket without a peer: the core is gone
            return False
        return True

    def get_outputs(self, timeout: float) -> list[StepOutputs]:
        """Every message that arrived (waiting up to ``timeout`` for the first): when the reader falls behind the
        core, a request's tokens of several steps are handled as one batch. The core's :class:`Failed`, its last
        word when its workers are gone, sets :attr:`death_reason`."""
        if not self._output.poll(int(timeout * 1000)):
            return []
        messages: list[Any] = []
        while self._output.poll(0):
            messages.append(self._decoder.decode(self._output.recv()))
        for message in messages:
            if isinstance(message, Failed):
                self.death_reason = message.message
        return [message for message in messages if isinstance(message, StepOutputs)]

    def shut_down(self, timeout: float, quiet: bool) -> None:
        """Tell the core to stop and wait up to ``timeout`` seconds, then kill it (logged at info level when
        ``quiet``: nothing is lost). The output socket stays open: a core can't close its socket while messages it
        sent wait to be read, so the reader drains them until :meth:`close`."""
        if not self.process.is_alive():
            return
        self._send(Shutdown())
        self.process.join(timeout=timeout)
        if self.process.is_alive():
            (logger.info if quiet else logger.warning)("the engine core did not stop within %g s; killing it", timeout)
            self.process.kill()
            self.process.join(timeout=5)

    def close(self, timeout: float = 60.0) -> None:
        """Stop the core (:meth:`shut_down`) if it runs, then close the sockets. Idempotent."""
        if self._closed:
            return
        self.shut_down(timeout, quiet=False)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._closed = True
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._zmq.term()
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)


class AttachedClient(ProcessClient):
    """An API process other than the first (``server.api_server_count``): it binds the addresses the first one
    gave it and talks to the core that one started; it neither starts nor stops the core.

    It takes the core for dead when the core's process is gone, or when the first API process (its parent, which
    owns the core) is."""

    def __init__(
        self, config: WeftConfig, addresses: tuple[str, str], index: int, core_pid: int, startup_timeout: float
    ) -> None:
        self.config = config
        self._folder = ""
        self._index = index
        self._core_pid = core_pid
        self._parent_pid = os.getppid()
        self._bind(*addresses)
        self.engine_settings = self._handshake(startup_timeout)

    @property
    def client_index(self) -> int:
        return self._index

    @property
    def alive(self) -> bool:
        return os.getppid() == self._parent_pid and _running(self._core_pid)

    @property
    def exitcode(self) -> int | None:
        return None  # not this process's child

    def _kill(self) -> None:
        pass  # the first API process owns the core

    def _reap(self) -> None:
        pass

    def shut_down(self, timeout: float, quiet: bool) -> None:
        """Nothing to stop: the first API process stops the core once every API process drained."""


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (exists and is not a zombie waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return True  # no procfs: the signal's answer stands
