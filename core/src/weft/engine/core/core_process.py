"""The engine core in its own process: the far end of :class:`~weft.engine.client.ProcessClient`.

The API process binds two ZMQ sockets and starts :func:`run_engine_core` with
``multiprocessing``'s spawn method; the core connects, builds its
:class:`~weft.engine.core.engine_core.EngineCore` (:func:`~weft.engine.core.builder.build_engine_core`) and
answers :class:`~weft.engine.messages.Ready` (or :class:`~weft.engine.messages.Failed`). Then it loops: take
every waiting message (new requests, aborts, shutdown), run one step when it has work
(:meth:`~weft.engine.core.engine_core.EngineCore.step_outputs`, whose failure rules the in-process client
shares), and push the step's outputs with the core's gauges; a step that failed twice fails the requests
the core held. Messages are msgpack-encoded :mod:`weft.engine.messages` Structs. The core exits when told
to, or at once when the API process is gone (:mod:`weft.engine.core.watchdog`, which also fails the requests
of a step that outlives ``engine.step_timeout``). This module imports no torch (the API process names its entry point);
the core's modules are imported in the core's process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any

import msgspec

from weft.config import WeftConfig
from weft.engine.messages import Abort, Failed, Ready, Shutdown, StepOutputs, ToCore

if TYPE_CHECKING:
    from weft.engine.core.api_clients import ApiClients
    from weft.engine.core.engine_core import EngineCore

logger = logging.getLogger("weft.engine")


STEP_FAILED = "the engine step failed twice (the server log has the details)"


def _receive(
    core: EngineCore,
    poller: Any,
    inputs: Any,
    decoder: msgspec.msgpack.Decoder,
    clients: ApiClients,
    refused: dict[str, str],
) -> tuple[bool, bool]:
    """Apply every waiting message (waiting up to a second when the core has no work); the requests the core
    refuses go to ``refused``. Returns whether to stop and whether anything arrived."""
    timeout = 0 if core.has_work else 1000
    received = False
    while poller.poll(timeout):
        message = decoder.decode(inputs.recv())
        timeout, received = 0, True
        if isinstance(message, Shutdown):
            return True, received
        if isinstance(message, Abort):
            core.abort(message.request_ids)
            clients.forget(message.request_ids)
            continue
        try:
            clients.added(message.client, [request.request_id for request in message.requests])
        except ValueError:
            logger.exception("dropped a message")
            continue
        for request in message.requests:
            try:
                core.add_request(request)
            except ValueError as error:
                refused[request.request_id] = str(error)
    return False, received


def _failed_step(core: Any, failure: Any, refused: dict[str, str]) -> tuple[StepOutputs, BaseException | None]:
    """A step that failed twice (``failure``, a :class:`~weft.engine.core.engine_core.StepFailed`): the message
    failing the requests it held, and the error the core stops with when its workers are gone (else None)."""
    error = failure.__cause__
    if failure.fatal:
        reason, fatal = f"the engine's workers failed: {error}", error
    else:
        logger.error("engine step failed again; failing the requests it held", exc_info=error)
        reason, fatal = STEP_FAILED, None
    return StepOutputs([], core.stats(), refused, dict.fromkeys(failure.request_ids, reason)), fatal


def run_engine_core(
    config: WeftConfig, input_addresses: list[str], output_addresses: list[str], parent_pid: int
) -> None:
    """The core process's main function: one pair of addresses per API process (bound there; the first is the
    parent's, which says when to stop)."""
    import zmq

    from weft.engine.core.api_clients import ApiClients
    from weft.engine.core.builder import build_engine_core
    from weft.engine.core.engine_core import StepFailed
    from weft.engine.core.watchdog import CoreWatchdog
    from weft.heap import freeze_startup_objects
    from weft.plugins.registry import problems_reported_by_parent

    problems_reported_by_parent()  # the API process logged the installed plugins' problems

    # Ctrl-C reaches the whole process group (and a service manager may SIGTERM every process of it);
    # the API process decides when the core stops (Shutdown, after draining), so the core must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Started as a daemon (it dies with the API process), yet its executor may start worker processes,
    # which multiprocessing refuses to daemons; the core stops them itself, and they watch it.
    multiprocessing.current_process().daemon = False
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    for address in input_addresses:
        inputs.connect(address)
    outputs = ApiClients(context, output_addresses)
    decoder = msgspec.msgpack.Decoder(ToCore)
    try:
        core = build_engine_core(config)
        freeze_startup_objects()  # this process serves one engine until it exits: out of the collector's view
    except BaseException as error:
        outputs.send_all(Failed(f"{type(error).__name__}: {error}", traceback.format_exc()))
        outputs.close(linger=5000)
        raise SystemExit(1) from None
    outputs.send_all(Ready(core.describe()))
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    watchdog = CoreWatchdog(parent_pid, config.engine.step_timeout, lambda: core.scheduler.unfinished_ids, outputs)
    watchdog.start()
    fatal: BaseException | None = None
    try:
        while True:
            refused: dict[str, str] = {}
            stop, received = _receive(core, poller, inputs, decoder, outputs, refused)
            if stop:
                break
            if not core.has_work:
                if received:  # the API side's gauges follow aborts too
                    outputs.send(StepOutputs([], core.stats(), refused))
                continue
            watchdog.step_began()
            try:
                message = core.step_outputs(refused)
            except StepFailed as failure:
                message, fatal = _failed_step(core, failure, refused)
            watchdog.last_stats = message.stats
            outputs.send(message)
            if failed_by_watchdog := watchdog.step_ended():
                core.abort(failed_by_watchdog)  # the API side ended them already
                outputs.forget(failed_by_watchdog)
            if fatal is not None:
                break
    finally:
        watchdog.stop()
        core.close()
        if fatal is not None:
            logger.error("the engine core stops: %s", fatal)
            outputs.send_all(Failed(str(fatal)))
        outputs.close(linger=1000)
        inputs.close(linger=0)
        context.term()
    # Everything is closed: skip the interpreter's teardown (torch's takes over a second), so a
    # shutdown's exit is not held up by it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if fatal is not None else 0)
