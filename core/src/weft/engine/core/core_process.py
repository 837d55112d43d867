"""The engine core in its own process, and the messages it exchanges with the API process over ZMQ.

The API process binds two ZMQ sockets and starts :func:`run_engine_core` with
``multiprocessing``'s spawn method; the core connects, builds its
:class:`~weft.engine.core.engine_core.EngineCore` (:func:`~weft.engine.core.builder.build_engine_core`) and answers :class:`Ready` (or
:class:`Failed`). Then it loops: take every waiting message (new requests,
aborts, shutdown), run one step when it has work, and push the step's outputs
with the core's gauges. A step that raises is retried once (its running requests
preempted and recomputed); a second failure in a row fails every request the
core holds. Messages are msgpack-encoded msgspec Structs. The core
exits when told to, or when the API process is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import traceback

import msgspec

from weft.config import WeftConfig
from weft.contracts.executor import ExecutorFailed
from weft.engine.messages import Abort, Failed, Ready, Shutdown, StepOutputs, ToCore

logger = logging.getLogger("weft.engine")


STEP_FAILED = "the engine step failed twice (the server log has the details)"


def run_engine_core(config: WeftConfig, input_address: str, output_address: str, parent_pid: int) -> None:
    """The core process's main function."""
    import zmq

    from weft.engine.core.builder import build_engine_core
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
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToCore)
    try:
        core = build_engine_core(config)
        freeze_startup_objects()  # this process serves one engine until it exits: out of the collector's view
    except BaseException as error:
        outputs.send(encoder.encode(Failed(f"{type(error).__name__}: {error}", traceback.format_exc())))
        outputs.close(linger=5000)
        raise SystemExit(1) from None
    outputs.send(encoder.encode(Ready(core.describe())))
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    fatal: ExecutorFailed | None = None
    try:
        while True:
            refused: dict[str, str] = {}
            timeout = 0 if core.has_work else 1000
            stop = received = False
            while poller.poll(timeout):
                message = decoder.decode(inputs.recv())
                timeout, received = 0, True
                if isinstance(message, Shutdown):
                    stop = True
                    break
                if isinstance(message, Abort):
                    core.abort(message.request_ids)
                    continue
                for request in message.requests:
                    try:
                        core.add_request(request)
                    except ValueError as error:
                        refused[request.request_id] = str(error)
            if stop:
                break
            if not core.has_work:
                if os.getppid() != parent_pid:
                    logger.error("the API process is gone; the engine core exits")
                    break
                if received:  # the API side's gauges follow aborts too
                    outputs.send(encoder.encode(StepOutputs([], core.stats(), refused)))
                continue
            failed: dict[str, str] = {}
            try:
                produced = core.step_with_retry()
            except ExecutorFailed as error:
                held = core.scheduler.unfinished_ids
                core.reset_after_failure()
                failed = {request_id: f"the engine's workers failed: {error}" for request_id in held}
                outputs.send(encoder.encode(StepOutputs([], core.stats(), refused, failed)))
                fatal = error
                break
            except Exception:
                logger.exception("engine step failed again; failing the requests it held")
                held = core.scheduler.unfinished_ids
                core.reset_after_failure()
                failed = dict.fromkeys(held, STEP_FAILED)
                produced = []
            refused.update(core.take_refused())  # constraints that failed to compile
            outputs.send(encoder.encode(StepOutputs(produced, core.stats(), refused, failed)))
    finally:
        core.close()
        if fatal is not None:
            logger.error("the engine core stops: %s", fatal)
            outputs.send(encoder.encode(Failed(str(fatal))))
        outputs.close(linger=1000)
        inputs.close(linger=0)
        context.term()
    # Everything is closed: skip the interpreter's teardown (torch's takes over a second), so a
    # shutdown's exit is not held up by it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if fatal is not None else 0)
