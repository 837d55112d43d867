"""The ``ray`` executor: the model's ranks as Ray actors, placed with one placement-group bundle per device.

``engine.distributed_executor_backend = "ray"`` with ``[plugins.ray]``::

    [plugins.ray]
    address = "auto"          # an existing cluster ("auto", "host:6379", "ray://host:10001"); default:
                              # the one $RAY_ADDRESS names, else a local cluster started for the engine
    placement_strategy = "PACK"

The engine core reserves one bundle per rank (``{"GPU": 1, "CPU": 1}`` on an accelerator,
``{"CPU": 1}`` on the CPU platform); Ray puts them on the cluster's nodes (PACK fills a node
before the next, SPREAD spreads them). Each actor makes its rank's worker exactly as a worker
process of the ``mp`` executor does (:func:`weft.runner.worker_process.build_worker`):
the ranks meet at a TCP store the engine core serves and join torch.distributed. Before that,
each actor verifies its machine's installed plugins against the plugin lock the engine core
read (``[plugins] lock`` or ``WEFT_PLUGINS_LOCK``; the file need not exist on the actor's
node) and refuses, naming its rank and host, when they differ. Every step
goes to every actor; the output rank's answer is the step's output. A step with structured
outputs goes as two calls to every actor, the forward and then the sampling with the step's
grammar bitmask (an actor runs its calls in order).

A worker that dies (its actor process killed, its node lost) or fails surfaces as a Ray
error on the step's result: the executor raises :class:`~weft.contracts.executor.ExecutorFailed`
naming the rank and the cause, and kills the other actors, none of which is waited for.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, ClassVar, Literal

import msgspec

from weft.api import (
    NamedLock,
    PluginError,
    StoreAddress,
    check_layout,
    configured_lock,
    merge_worker_info,
    parallel_layout,
    verify_installed,
)
from weft.contracts.executor import (
    Executor,
    ExecutorFailed,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    StepHandle,
    WorkerInfo,
    decode_scheduler_output,
    encode_step,
)

logger = logging.getLogger("weft.ray")


class RayOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    address: str | None = None
    """The cluster to join: "auto", "host:6379" or "ray://host:10001"; None: $RAY_ADDRESS's, else a local one."""
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    namespace: str = "weft"


class RayWorker:
    """One rank in a Ray actor (``ray.remote`` is applied when the executor starts)."""

    def start(self, config: Any, layout: Any, store: StoreAddress, lock: NamedLock | None) -> tuple[int, str]:
        """``lock``: the plugin lock the engine core read, which this actor's machine must match (None: none named)."""
        from weft.api import build_worker, connect_store, problems_reported_by_parent

        problems_reported_by_parent()  # the engine's process logged the installed plugins' problems
        if lock is not None:
            verify_installed(lock, f" on {socket.gethostname()} (Ray worker rank {layout.rank})")
        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s [rank {layout.rank}]: %(message)s")
        # Ray gives the actor its bundle's device alone (CUDA_VISIBLE_DEVICES): it is device 0 here.
        self.worker, self.parallel = build_worker(config, layout, 0, connect_store(store))
        return os.getpid(), socket.gethostname()

    def load_model(self) -> WorkerInfo:
        return self.worker.load_model()

    def initialize_kv_cache(self, num_blocks: list[int]) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute(self, step: bytes) -> ModelRunnerOutput | None:
        handle = self.worker.execute_model(decode_scheduler_output(step))
        # None: the step has structured outputs and samples when sample() brings its bitmask (an actor runs
        # its calls in the order they were sent, so sample() follows this execute()).
        return None if handle is None else handle.result()

    def sample(self, grammar: GrammarOutput) -> ModelRunnerOutput:
        return self.worker.sample_tokens(grammar).result()

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.parallel.close()


class _Step(StepHandle):
    def __init__(self, executor: RayExecutor, references: list[Any], forward: list[Any] | None = None) -> None:
        """``forward``: the execute() calls of a step that samples through ``references`` (structured outputs)."""
        self.executor, self.references, self.forward = executor, references, forward
        self.output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self.output is None:
            if self.forward is not None:
                self.executor.wait(self.forward, "run a step", deadline=None)  # a failed forward names its rank
            answers = self.executor.wait(self.references, "run a step", deadline=None)
            self.output = answers[self.executor.layout.output_rank]
        return self.output


class RayExecutor(Executor):
    name: ClassVar[str] = "ray"
    Options = RayOptions

    def __init__(self, options: Any, config: Any, registry: Any = None) -> None:
        super().__init__(options, config, registry)
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from weft.api import select_platform

        self.layout = parallel_layout(config)
        lock = configured_lock(config)
        world = self.layout.world_size
        self.timeout = config.engine.distributed.worker_timeout
        check_layout(config, registry, None)  # Ray places the ranks: whether a node has the devices is its call
        self.failure: ExecutorFailed | None = None
        self._forward: list[Any] | None = None
        self.actors: list[Any] = []
        self.pids: dict[int, tuple[int, str]] = {}
        self.placement_group = None
        self._closed = False
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(
                address=self.options.address,
                namespace=self.options.namespace,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=True,
            )
        platform_class, _ = select_platform(registry or _registry(), config.use.platform)
        bundle = {"CPU": 1.0} if platform_class.device_type == "cpu" else {"GPU": 1.0, "CPU": 1.0}
        try:
            self.placement_group = placement_group([dict(bundle)] * world, strategy=self.options.placement_strategy)
            ready, _ = ray.wait([self.placement_group.ready()], timeout=self.timeout)
            if not ready:
                raise ExecutorFailed(
                    f"the Ray cluster cannot place {world} bundles of {bundle} ({self.options.placement_strategy}) "
                    f"within engine.distributed.worker_timeout = {self.timeout:g} s; it has {ray.cluster_resources()}: "
                    "add nodes or devices, or lower tensor_parallel_size x pipeline_parallel_size"
                )
            self.store, address = self._serve_store()
            remote = ray.remote(RayWorker)
            for rank in range(world):
                strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
                self.actors.append(
                    remote.options(
                        num_cpus=bundle["CPU"],
                        num_gpus=bundle.get("GPU", 0),
                        scheduling_strategy=strategy,
                        name=f"weft-worker-{rank}-{os.getpid()}",
                    ).remote()
                )
            started = self.wait(
                [
                    actor.start.remote(config, self.layout.at_rank(rank), address, lock)
                    for rank, actor in enumerate(self.actors)
                ],
                "start",
                time.monotonic() + self.timeout,
            )
            self.pids = dict(enumerate(started))
            logger.info("%d Ray workers joined (%s)", world, ", ".join(sorted({host for _, host in started})))
        except BaseException:
            self.shutdown()
            raise

    def _serve_store(self) -> tuple[Any, StoreAddress]:
        import datetime

        import ray
        from torch.distributed import PrefixStore, TCPStore

        host = ray.util.get_node_ip_address()
        store = TCPStore(
            "0.0.0.0", 0, is_master=True, timeout=datetime.timedelta(seconds=self.timeout), wait_for_workers=False
        )
        prefix = f"weft-ray-{os.getpid()}"
        return PrefixStore(prefix, store), StoreAddress(host, store.port, prefix, self.timeout)

    def wait(self, references: list[Any], phase: str, deadline: float | None) -> list[Any]:
        """Every rank's answer, in rank order; raises ExecutorFailed naming the first rank that died or failed."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if self.failure is not None:
            raise self.failure
        ranks = {reference: rank for rank, reference in enumerate(references)}
        answers: list[Any] = [None] * len(references)
        pending = list(references)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for reference in ready:
                rank = ranks[reference]
                try:
                    answers[rank] = ray.get(reference)
                except RayActorError as error:
                    self._fail(f"worker rank {rank}{self._where(rank)} died: {_first_line(error)}")
                except RayTaskError as error:
                    cause = error.cause if getattr(error, "cause", None) is not None else error
                    if isinstance(cause, PluginError):  # an actor refused to start (the plugin lock): its whole message
                        self._kill_actors()
                        raise cause from None
                    self._fail(
                        f"worker rank {rank}{self._where(rank)} failed: {type(cause).__name__}: {_first_line(cause)}"
                    )
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"the workers did not {phase} within engine.distributed.worker_timeout = {self.timeout:g} s")
        return answers

    def _where(self, rank: int) -> str:
        if rank not in self.pids:
            return " (Ray actor)"
        pid, host = self.pids[rank]
        return f" (Ray actor, pid {pid} on {host})"

    def _fail(self, reason: str) -> None:
        self.failure = ExecutorFailed(f"{reason}; the engine stops (requests in flight fail)")
        logger.error("%s", self.failure)
        self._kill_actors()
        raise self.failure

    def load_model(self) -> WorkerInfo:
        infos = self.wait(
            [actor.load_model.remote() for actor in self.actors], "load the model", time.monotonic() + self.timeout
        )
        return merge_worker_info(infos, self.layout)

    def initialize_kv_cache(self, num_blocks: list[int]) -> None:
        self.wait(
            [actor.initialize_kv_cache.remote(num_blocks) for actor in self.actors],
            "allocate the KV cache",
            time.monotonic() + self.timeout,
        )

    def execute_model(self, step: SchedulerOutput) -> StepHandle | None:
        if self.failure is not None:
            raise self.failure
        payload = encode_step(step)
        launched = [actor.execute.remote(payload) for actor in self.actors]
        if step.structured_output_request_ids:
            self._forward = launched
            return None  # the actors sample once sample_tokens brings the bitmask
        return _Step(self, launched)

    def sample_tokens(self, grammar: GrammarOutput) -> StepHandle:
        if self.failure is not None:
            raise self.failure
        forward, self._forward = self._forward, None
        return _Step(self, [actor.sample.remote(grammar) for actor in self.actors], forward)

    def _kill_actors(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.actors and self.failure is None:
            try:
                ray.get([actor.shutdown.remote() for actor in self.actors], timeout=30)
            except Exception:  # noqa: BLE001 - stopping anyway
                logger.warning("Ray workers did not stop cleanly; killing them")
        self._kill_actors()
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
        if self.started_ray:
            ray.shutdown()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _registry() -> Any:
    from weft.api import PluginRegistry

    return PluginRegistry()
