"""The ``mp`` executor: one worker process per device, several nodes through one launcher each.

The engine core serves the rendezvous store (:mod:`weft.distributed.rendezvous`),
binds two ZMQ channels and publishes their addresses there: steps go out on one
that every worker subscribes to (a step is encoded once), answers come back on
the other. It starts this node's ranks with torch.multiprocessing's spawn; the
launchers of other nodes (``weft serve`` with ``engine.distributed.node_rank``
above 0) start theirs, and every rank joins torch.distributed through the same
store (:mod:`weft.runner.worker_process`).

Per step the workers run the scheduler's output; the output rank (the last
pipeline stage's first tensor rank) sends the sampled tokens back. Whenever the
engine waits for workers it also watches them: a local worker that exits, a
worker's error, a node whose launcher falls silent, fail the executor with an
error that names the rank and the cause (:class:`ExecutorFailed`); the other
workers are stopped, none is waited for past ``engine.distributed.worker_timeout``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any, ClassVar

import msgspec

from weft.contracts.executor import (
    Executor,
    ExecutorFailed,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    StepHandle,
    WorkerInfo,
    encode_step,
)
from weft.distributed.messages import (
    Execute,
    FromWorkers,
    Hello,
    Initialized,
    InitializeKVCache,
    Loaded,
    LoadModel,
    NodeAlive,
    SampleTokens,
    Shutdown,
    StepDone,
    ToWorkers,
    WorkerFailed,
)
from weft.distributed.placement import Placement, placement
from weft.distributed.rendezvous import publish_config, serve_store
from weft.distributed.workers import check_layout, exit_cause, merge_worker_info
from weft.resolve import parallel_layout

logger = logging.getLogger("weft.distributed")

NODE_SILENCE_SECONDS = 15.0
"""A node launcher sends a heartbeat every second; this long without one, its node is taken for dead."""


class _Step(StepHandle):
    def __init__(self, executor: MultiprocExecutor, sequence: int) -> None:
        self.executor = executor
        self.sequence = sequence
        self.output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self.output is None:
            self.output = self.executor.wait_for_step(self.sequence)
        return self.output


class MultiprocExecutor(Executor):
    name: ClassVar[str] = "mp"
    supports_async_output: ClassVar[bool] = True

    def __init__(self, options: Any, config: Any, registry: Any = None) -> None:
        super().__init__(options, config, registry)
        self.placement: Placement = placement(config)
        if self.placement.node_rank != 0:
            raise ValueError(
                f"engine.distributed.node_rank = {self.placement.node_rank}: only node 0 runs the engine; "
                f"start this node with `weft serve` (it runs its workers for node 0)"
            )
        self.layout = parallel_layout(config)
        self.timeout = config.engine.distributed.worker_timeout
        self.processes: dict[int, Any] = {}
        self.failure: ExecutorFailed | None = None
        self._closed = False
        self._sent = 0
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._waiting_steps: deque[int] = deque()
        self._joined: set[int] = set()
        """Ranks that said Hello."""
        self._node_seen: dict[int, float] = {}
        """Nodes other than 0 that joined, and when their launcher was last heard."""
        check_layout(config, registry, self.placement)
        self._open_channels()
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise

    # Starting.

    def _open_channels(self) -> None:
        import zmq

        self.store, self.store_address = serve_store(self.placement, self.timeout)
        self.context = zmq.Context()
        self.steps = self.context.socket(zmq.XPUB)
        self.steps.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.steps.setsockopt(zmq.SNDHWM, 0)
        self.results = self.context.socket(zmq.PULL)
        self.results.setsockopt(zmq.RCVHWM, 0)
        several_nodes = self.placement.nnodes > 1
        host = "0.0.0.0" if several_nodes else "127.0.0.1"
        advertised = self.placement.master_addr if several_nodes else "127.0.0.1"
        steps_port = self.steps.bind_to_random_port(f"tcp://{host}")
        results_port = self.results.bind_to_random_port(f"tcp://{host}")
        self.store.set("steps", f"tcp://{advertised}:{steps_port}")
        self.store.set("results", f"tcp://{advertised}:{results_port}")
        publish_config(self.store, self.config)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(FromWorkers)

    def _start_workers(self) -> None:
        import torch.multiprocessing as torch_mp

        from weft.runner.worker_process import run_worker

        spawn = torch_mp.get_context("spawn")
        for local_rank, rank in enumerate(self.placement.node_ranks(0)):
            process = spawn.Process(
                target=run_worker,
                args=(self.config, self.layout.at_rank(rank), local_rank, self.store_address, os.getpid()),
                name=f"weft-worker-{rank}",
                daemon=True,
            )
            process.start()
            self.processes[rank] = process
        world = self.layout.world_size
        if self.placement.nnodes > 1:
            logger.info(
                "waiting for %d nodes to join at %s:%s",
                self.placement.nnodes - 1,
                self.placement.master_addr,
                self.store_address.port,
            )
        hosts: dict[int, str] = {}
        subscribed = 0
        deadline = time.monotonic() + self.timeout
        while len(hosts) < world or subscribed < world:
            while self.steps.poll(0):
                if self.steps.recv()[:1] == b"\x01":  # a worker's subscription: it will see every message
                    subscribed += 1
            message = self._receive(deadline, "start", patience=0.1)
            if isinstance(message, Hello):
                hosts[message.rank] = message.host
                self._joined.add(message.rank)
                node = self.placement.node_of(message.rank)
                if node:
                    self._node_seen[node] = time.monotonic()
        logger.info("%d workers joined (%s)", world, ", ".join(sorted(set(hosts.values()))))

    # Steps.

    def _broadcast(self, message: ToWorkers) -> None:
        self._check()
        self.steps.send(self.encoder.encode(message))

    def _collect(self, kind: type, phase: str) -> dict[int, Any]:
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout
        while len(answers) < self.layout.world_size:
            message = self._receive(deadline, phase)
            if isinstance(message, kind):
                answers[message.rank] = message
        return answers

    def load_model(self) -> WorkerInfo:
        self._broadcast(LoadModel())
        answers = self._collect(Loaded, "load the model")
        return merge_worker_info([answers[rank].info for rank in sorted(answers)], self.layout)

    def initialize_kv_cache(self, num_blocks: list[int]) -> None:
        self._broadcast(InitializeKVCache(num_blocks))
        self._collect(Initialized, "allocate the KV cache")

    def execute_model(self, step: SchedulerOutput) -> StepHandle | None:
        self._broadcast(Execute(encode_step(step)))
        if step.structured_output_request_ids:
            return None  # the workers sample once sample_tokens brings the bitmask
        return self._expect_step()

    def sample_tokens(self, grammar: GrammarOutput) -> StepHandle:
        self._broadcast(SampleTokens(grammar))
        return self._expect_step()

    def _expect_step(self) -> StepHandle:
        """A handle for the next step output the output rank will send."""
        sequence = self._sent
        self._sent += 1
        self._waiting_steps.append(sequence)
        return _Step(self, sequence)

    def wait_for_step(self, sequence: int) -> ModelRunnerOutput:
        while sequence not in self._outputs:
            self._check()
            # A step's wait has no deadline (a long prefill is legitimate); a dead worker still ends it.
            message = self._receive(None, "run a step")
            if isinstance(message, StepDone):
                self._outputs[self._waiting_steps.popleft()] = message.output
        return self._outputs.pop(sequence)

    # Watching the workers.

    def _receive(self, deadline: float | None, phase: str, patience: float | None = None) -> FromWorkers | None:
        """The next answer from the workers (None after ``patience`` seconds without one); raises ExecutorFailed
        when a worker died, failed, or none answered by ``deadline``."""
        given_up = time.monotonic() + patience if patience is not None else None
        while True:
            self._check()
            if self.results.poll(100):
                message = self.decoder.decode(self.results.recv())
                if isinstance(message, WorkerFailed):
                    self._fail(self._root_cause(message))
                if isinstance(message, NodeAlive):
                    self._node_seen[message.node_rank] = time.monotonic()
                    continue
                return message
            self._watch()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"the workers did not {phase} within engine.distributed.worker_timeout = {self.timeout:g} s")
            if given_up is not None and time.monotonic() > given_up:
                return None

    def _root_cause(self, first: WorkerFailed) -> str:
        """What to blame: when one rank dies, the others' collectives fail too; the one killed is the cause."""
        reports = [first]
        settle = time.monotonic() + 1.0
        while time.monotonic() < settle:
            if self.results.poll(50):
                message = self.decoder.decode(self.results.recv())
                if isinstance(message, WorkerFailed):
                    reports.append(message)
        for report in reports:
            detail = f"\n{report.traceback}" if report.traceback else ""
            logger.error("worker rank %d failed: %s%s", report.rank, report.cause, detail)
        for rank, process in self.processes.items():
            if process.exitcode is not None and process.exitcode < 0:
                return f"worker rank {rank} (pid {process.pid}) {exit_cause(process.exitcode)}"
        killed = [report for report in reports if not report.traceback]  # a node launcher's report of a death
        blamed = killed[0] if killed else first
        verb = "" if killed else "failed: "
        return f"worker rank {blamed.rank} {verb}{blamed.cause}"

    def _watch(self) -> None:
        for rank, process in self.processes.items():
            if process.exitcode is not None:
                # Its own report may be on the way: it names the error, not just the exit.
                if self.results.poll(200):
                    return
                hint = (
                    ""
                    if rank in self._joined
                    else (
                        " before it started; a script that starts an engine with several workers must do so under "
                        '`if __name__ == "__main__":` (multiprocessing\'s spawn imports the script again in each '
                        "worker)"
                    )
                )
                self._fail(f"worker rank {rank} (pid {process.pid}) {exit_cause(process.exitcode)}{hint}")
        now = time.monotonic()
        for node, seen in self._node_seen.items():
            if now - seen > NODE_SILENCE_SECONDS:
                ranks = self.placement.node_ranks(node)
                self._fail(
                    f"node {node} (worker ranks {ranks.start}-{ranks.stop - 1}) stopped answering "
                    f"for {NODE_SILENCE_SECONDS:g} s"
                )

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _fail(self, reason: str) -> None:
        self.failure = ExecutorFailed(f"{reason}; the engine stops (requests in flight fail)")
        logger.error("%s", self.failure)
        self._stop_workers(grace=0.0)
        raise self.failure

    # Stopping.

    def _stop_workers(self, grace: float) -> None:
        try:
            self.steps.send(self.encoder.encode(Shutdown()), flags=1)  # zmq.NOBLOCK: never wait on a dead peer
        except Exception:  # noqa: BLE001 - a closed or full channel: the workers are stopped below anyway
            pass
        deadline = time.monotonic() + grace
        for process in self.processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.exitcode is None:
                process.kill()
                process.join(timeout=5)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_workers(grace=10.0 if self.failure is None else 0.0)
        for sock in (getattr(self, "steps", None), getattr(self, "results", None)):
            if sock is not None:
                sock.close(linger=0)
        if getattr(self, "context", None) is not None:
            self.context.term()
