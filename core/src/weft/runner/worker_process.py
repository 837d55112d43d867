"""The main function of one worker process: a rank of the model.

Started by the ``mp`` executor on node 0 and by the node launcher
(:mod:`weft.entrypoints.node`) on the others, with spawn. It connects to the
store, reads the engine's channel addresses there, joins torch.distributed,
builds its :class:`~weft.runner.worker.Worker`, then follows the engine's
messages (:mod:`weft.distributed.messages`). Any error is sent to the engine
(rank, error, traceback) before the process exits with status 1; a worker whose
launcher disappears exits by itself.

Steps and asynchronous output: a step's handle is resolved (its tokens appended
to the runner's request state; the output rank sends them) before the next
message is waited for, unless that message is already there: then the next step
is launched first, so its input preparation overlaps the device's work.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import traceback
from typing import Any

import msgspec

from weft.config import WeftConfig
from weft.contracts.executor import StepHandle, decode_scheduler_output
from weft.contracts.parallel import ParallelLayout
from weft.distributed.messages import (
    Execute,
    FromWorkers,
    Hello,
    Initialized,
    InitializeKVCache,
    Loaded,
    LoadModel,
    SampleTokens,
    Shutdown,
    StepDone,
    ToWorkers,
    WorkerFailed,
)
from weft.distributed.rendezvous import StoreAddress, connect_store, distributed_store
from weft.heap import freeze_startup_objects

logger = logging.getLogger("weft.distributed")

PARENT_CHECK_SECONDS = 1.0


class WorkerChannel:
    """The worker's end of the engine's channels: steps in (subscribed), answers out."""

    def __init__(self, steps_address: str, results_address: str) -> None:
        import zmq

        self.context = zmq.Context()
        self.results = self.context.socket(zmq.PUSH)
        self.results.setsockopt(zmq.SNDHWM, 0)
        self.results.connect(results_address)
        self.steps = self.context.socket(zmq.SUB)
        self.steps.setsockopt(zmq.RCVHWM, 0)
        self.steps.setsockopt(zmq.SUBSCRIBE, b"")
        self.steps.connect(steps_address)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ToWorkers)

    def send(self, message: FromWorkers) -> None:
        self.results.send(self.encoder.encode(message))

    def waiting(self) -> bool:
        return bool(self.steps.poll(0))

    def receive(self, parent_pid: int) -> ToWorkers:
        """The next message; exits the process when the launcher that started it is gone."""
        while not self.steps.poll(int(PARENT_CHECK_SECONDS * 1000)):
            if os.getppid() != parent_pid:
                logger.error("worker %d: the process that started it is gone; exiting", os.getpid())
                os._exit(1)
        return self.decoder.decode(self.steps.recv())

    def close(self) -> None:
        self.results.close(linger=2000)
        self.steps.close(linger=0)
        self.context.term()


def run_worker(
    config: WeftConfig, layout: ParallelLayout, local_rank: int, store_address: StoreAddress, parent_pid: int
) -> None:
    """A worker process's main function."""
    from weft.plugins.registry import problems_reported_by_parent

    problems_reported_by_parent()  # the engine's process logged the installed plugins' problems
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; the engine decides
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s [rank {layout.rank}]: %(message)s")
    channel: WorkerChannel | None = None
    worker: Any = None
    parallel: Any = None
    try:
        store = connect_store(store_address)
        channel = WorkerChannel(store.get("steps").decode(), store.get("results").decode())
        channel.send(Hello(layout.rank, os.getpid(), socket.gethostname()))
        worker, parallel = build_worker(config, layout, local_rank, store)
        logger.info("worker rank %d (pid %d) joined on %s", layout.rank, os.getpid(), worker.device)
        serve_steps(worker, channel, layout, parent_pid)
    except BaseException as error:  # noqa: BLE001 - every failure is reported to the engine, then the process exits
        if channel is not None:
            channel.send(WorkerFailed(layout.rank, f"{type(error).__name__}: {error}", traceback.format_exc()))
        logger.exception("worker rank %d failed", layout.rank)
        if channel is not None:
            channel.close()
        os._exit(1)  # collectives of other ranks may still reference this one: no orderly teardown
    if worker is not None:
        worker.shutdown()
    if parallel is not None:
        parallel.close()
    channel.close()


def build_worker(config: WeftConfig, layout: ParallelLayout, local_rank: int, store: Any) -> tuple[Any, Any]:
    """Join the model's world and build this rank's :class:`~weft.runner.worker.Worker` (model not loaded yet)."""
    from weft.distributed.state import init_parallel
    from weft.plugins import PluginRegistry
    from weft.resolve import build_platform
    from weft.runner.worker import Worker

    registry = PluginRegistry()
    platform = build_platform(registry, config)
    device = platform.select_device(local_rank)
    if device.type == "cpu":  # the ranks share the host's cores
        import torch

        from weft.host import usable_cpus

        cores = usable_cpus()
        torch.set_num_threads(max(1, cores // layout.world_size))
    parallel = init_parallel(
        layout, platform, device, distributed_store(store), config.engine.distributed.worker_timeout
    )
    return Worker(config, registry, parallel, platform, local_rank), parallel


def serve_steps(worker: Any, channel: WorkerChannel, layout: ParallelLayout, parent_pid: int) -> None:
    """Follow the engine's messages until it says Shutdown."""
    pending: StepHandle | None = None
    answers = layout.rank == layout.output_rank

    def finish(handle: StepHandle) -> None:
        output = handle.result()
        if answers:
            channel.send(StepDone(output))

    while True:
        if pending is not None and not channel.waiting():
            finish(pending)
            pending = None
        message = channel.receive(parent_pid)
        if isinstance(message, Execute):
            handle = worker.execute_model(decode_scheduler_output(message.step))
            if pending is not None:
                finish(pending)
            pending = handle  # None: the step samples once SampleTokens brings its bitmask
            continue
        if isinstance(message, SampleTokens):
            if pending is not None:
                finish(pending)
            pending = worker.sample_tokens(message.grammar)
            continue
        if pending is not None:
            finish(pending)
            pending = None
        if isinstance(message, LoadModel):
            channel.send(Loaded(layout.rank, worker.load_model()))
        elif isinstance(message, InitializeKVCache):
            worker.initialize_kv_cache(message.num_blocks)
            freeze_startup_objects()
            channel.send(Initialized(layout.rank))
        elif isinstance(message, Shutdown):
            return
