"""The MooncakeStore KV connector: full prompt blocks in Mooncake's distributed store, loaded back on a hit.

One stored object is one prefix block (:func:`connector_block_size` tokens) of one
prefix-cacheable KV-cache group, across all the group's layers, keys then values
(:mod:`weft_mooncake.blocks`: straight from and into a host-memory cache, through a
pinned staging buffer for a CUDA device cache). Its key names the model, the KV
dtype, the TP and PP rank, the group, the block size and the block's chained
prefix hash, so only an engine that would compute the same bytes finds it::

    weft/<model>@<config digest>/<dtype>/tp<rank>of<size>/pp<rank>of<size>/<group>/<block size>/<hash>

and, with ``layers_per_object = n``, ``.../<block size>/layers<n>/<run>/<hash>`` (``run``
counts the group's runs of ``n`` layers from 0).

Scheduler role: a request's lookup asks the store which leading blocks exist
(prompts shorter than a block match nothing; the last token is always left to
compute) and offers those beyond the engine's local prefix-cache hit. With
``load_async`` (the default; not under tensor or pipeline parallelism, where the
engine would recompute a request whose load failed on one rank while another
rank's load may still be writing) the offer is asynchronous: the engine parks the
request outside the running batch with its blocks, the workers load them in the
background while other requests step, and report it in ``finished_receiving`` (or
``failed_loads``: it is then computed, in the same blocks). Otherwise the load is
planned in the step the request is admitted for and done before that step's
forward. Every step plans the saves of prompt blocks that became full (never
blocks holding generated tokens). A preempted request starts afresh when it is
admitted again.

Worker role: one background thread loads, another saves. A request any of whose
objects is missing or the wrong size reports a failed load and is recomputed (a
synchronous load's request skips its saves of that step). Saves start after the
forward and never block the step; finished requests keep their blocks until their
saves are done (``delay_free``), and a preempted request's saves are finished
before the next forward writes to any block. A request that ends while its load is
in flight keeps its blocks until the load is over (it is then named in
``finished_receiving``).

Layer by layer: with ``layers_per_object = n`` an object holds ``n`` of its group's
layers (keys name the run), and a synchronous load moves the first run of every
block, then the next: ``wait_for_layer_load`` returns as soon as its layer's run has
landed, and the engine waits for each layer just before that layer's attention
(core API 1.9), so the first layers compute while later ones arrive. With the
default 0 an object holds every layer of its group (the fewest objects, so the
fewest store calls). An asynchronous load overlaps other requests' steps instead:
its request waits for all of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from weft.contracts.kv_connector import (
    ConnectorContext,
    ConnectorMetric,
    ConnectorOutput,
    ConnectorRequest,
    ConnectorStep,
    KVConnector,
    connector_block_size,
)
from weft_mooncake.blocks import Batch, DeviceBlocks, HostBlocks, group_layers, layer_parts
from weft_mooncake.store import StoreClient

if TYPE_CHECKING:
    import torch

    from weft.contracts.kv_cache import KVCacheGroupSpec

logger = logging.getLogger("weft.mooncake")

_LOAD_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class MooncakeOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[plugins.mooncake]``: where the store is and what this engine does with it (Mooncake's own names)."""

    master_server_address: Annotated[
        str, Meta(pattern=r"^[^:\s]+:[0-9]{1,5}$", description="host:port of mooncake_master's RPC service")
    ] = "127.0.0.1:50051"
    metadata_server: Annotated[
        str,
        Meta(
            min_length=1,
            description="transfer-engine metadata service, e.g. http://host:port/metadata (the master's "
            "--enable_http_metadata_server), an etcd host:port, or P2PHANDSHAKE",
        ),
    ] = "http://127.0.0.1:8080/metadata"
    global_segment_size: Annotated[
        int,
        Meta(
            ge=0,
            description="bytes of this engine's memory contributed to the store; 0 = contribute none "
            "(objects then live on storage nodes and outlive the engine)",
        ),
    ] = 0
    local_buffer_size: Annotated[int, Meta(ge=0, description="bytes of Mooncake's local transfer buffer")] = 16 << 20
    protocol: Annotated[Literal["tcp", "rdma"], Meta(description="transfer protocol")] = "tcp"
    device_name: Annotated[str, Meta(description="RDMA devices for protocol rdma, e.g. mlx5_0")] = ""
    local_hostname: Annotated[str, Meta(description="address other Mooncake nodes reach this engine at")] = "127.0.0.1"
    role: Annotated[
        Literal["both", "producer", "consumer"],
        Meta(description="both: save and load; producer: only save; consumer: only load, never save"),
    ] = "both"
    load_async: Annotated[
        bool,
        Meta(
            description="load a hit in the background while other requests step (the request waits outside "
            "the batch); false: load it before the forward of the step it is admitted for"
        ),
    ] = True
    staging_buffer_size: Annotated[
        int,
        Meta(
            ge=1 << 20,
            description="bytes of pinned host memory (and as much device memory) that device KV "
            "caches move through, half for loads and half for saves",
        ),
    ] = 256 << 20
    layers_per_object: Annotated[
        int,
        Meta(
            ge=0,
            description="layers of a group one stored object holds: 0 = all of them (fewest objects); n: "
            "a synchronous load lands n layers at a time, so the first layers compute while "
            "later ones arrive",
        ),
    ] = 0

    def __post_init__(self) -> None:
        if self.protocol == "rdma" and not self.device_name:
            raise ValueError("protocol = 'rdma' needs device_name (e.g. 'mlx5_0'); or use protocol = 'tcp'")


class BlockTransfer(msgspec.Struct, frozen=True, array_like=True):
    """One stored object: its prefix block's hash, its group, and the group's cache blocks it covers.

    Each worker keys it with its own rank (:meth:`MooncakeStoreConnector.key`): under tensor or pipeline
    parallelism every rank stores its own part of the block."""

    block_hash: bytes
    group: int
    blocks: tuple[int, ...]
    part: int = 0
    """The run of the group's layers it holds (``layers_per_object``; :func:`weft_mooncake.blocks.layer_parts`)."""


class RequestTransfer(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    objects: tuple[BlockTransfer, ...]


class MooncakeStepMetadata(msgspec.Struct, frozen=True):
    """What the scheduler role asks the workers to do in one step (msgspec-encodable)."""

    loads: tuple[RequestTransfer, ...] = ()
    """Synchronous loads: done before this step's forward."""
    receives: tuple[RequestTransfer, ...] = ()
    """Asynchronous loads to start: reported in ``finished_receiving`` or ``failed_loads``."""
    saves: tuple[RequestTransfer, ...] = ()
    preempted: frozenset[str] = frozenset()
    ended: tuple[str, ...] = ()
    """Requests that ended before their asynchronous load was reported done: name them in
    ``finished_receiving`` once no write reaches their blocks."""
    settled: tuple[str, ...] = ()
    """Requests whose failed asynchronous load the scheduler took in (they are recomputed)."""


class _Tracked:
    """The scheduler role's state of one admitted request."""

    __slots__ = ("request", "block_ids", "stored", "load_from", "load_to", "saved_any", "receiving")

    def __init__(self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...], stored: int) -> None:
        self.request = request
        self.block_ids = block_ids
        self.stored = stored
        """Prefix blocks that are in the store or planned to be saved."""
        self.load_from = self.load_to = 0
        """Prefix blocks a synchronous load fills in the request's next step."""
        self.saved_any = False
        self.receiving = False
        """An asynchronous load is planned and the workers have not reported it yet."""


class MooncakeStoreConnector(KVConnector):
    """Full prompt blocks in Mooncake's distributed store (MooncakeStore), loaded back on a prefix hit."""

    name: ClassVar[str] = "mooncake"
    metadata_type: ClassVar[Any] = MooncakeStepMetadata
    metrics: ClassVar[tuple[ConnectorMetric, ...]] = (
        ConnectorMetric("loaded_bytes_total", "Bytes of KV blocks loaded from the Mooncake store"),
        ConnectorMetric(
            "load_seconds",
            "Seconds one request's load from the Mooncake store took, copies included",
            "histogram",
            _LOAD_SECONDS_BUCKETS,
        ),
        ConnectorMetric("saved_bytes_total", "Bytes of KV blocks saved to the Mooncake store"),
        ConnectorMetric("dropped_saves_total", "Objects not saved: the store was unavailable or refused them"),
    )
    Options = MooncakeOptions

    def __init__(
        self,
        options: MooncakeOptions | None,
        role: Literal["scheduler", "worker"],
        groups: Sequence[KVCacheGroupSpec],
        context: ConnectorContext,
    ) -> None:
        super().__init__(options, role, groups, context)
        options = self.options
        self.block_size = connector_block_size(self.groups)
        self.stored_groups = tuple(i for i, group in enumerate(self.groups) if group.prefix_cacheable)
        self.saves = options.role in ("both", "producer")
        self.loads = options.role in ("both", "consumer")
        if options.layers_per_object and context.pp_size > 1:
            raise ValueError(
                f"weft-mooncake: layers_per_object = {options.layers_per_object} cuts a group's layers into runs, "
                f"and under pipeline parallelism (pipeline_parallel_size = {context.pp_size}) each stage holds only "
                f"its own layers, so the engine's runs and a stage's would differ: set layers_per_object = 0"
            )
        self.load_async = options.load_async and context.tp_size == 1 and context.pp_size == 1
        if options.load_async and not self.load_async and role == "scheduler":
            logger.info(
                "weft-mooncake loads synchronously under tensor or pipeline parallelism (%d x %d ranks): the engine "
                "recomputes a request as soon as one rank reports its load failed, while an asynchronous load of "
                "another rank could still be writing into its blocks",
                context.tp_size,
                context.pp_size,
            )
        prefix = (
            f"weft/{context.model}/{{dtype}}/tp{context.tp_rank}of{context.tp_size}/"
            f"pp{context.pp_rank}of{context.pp_size}/{{group}}/{self.block_size}/"
        )
        self._key_prefixes = {
            index: prefix.format(dtype=self.groups[index].spec.dtype, group=self.groups[index].name)
            + (f"layers{options.layers_per_object}/" if options.layers_per_object else "")
            for index in self.stored_groups
        }
        self._parts = {
            index: layer_parts(len(self.groups[index].layer_names), options.layers_per_object)
            for index in self.stored_groups
        }
        """Per stored group, the runs of its layers one object each holds."""
        worker = role == "worker"
        self.client = StoreClient(
            local_hostname=options.local_hostname,
            metadata_server=options.metadata_server,
            # Only the worker moves bytes; the scheduler role only asks which keys exist.
            global_segment_size=options.global_segment_size if worker else 0,
            local_buffer_size=options.local_buffer_size if worker else 0,
            protocol=options.protocol,
            device_name=options.device_name,
            master_server_address=options.master_server_address,
        )
        # Scheduler role.
        self._tracked: dict[str, _Tracked] = {}
        self._hits: dict[str, int] = {}
        """Leading prefix blocks found in the store by the latest lookup of each waiting request."""
        self._receives: list[RequestTransfer] = []
        self._ended: list[str] = []
        self._settled: list[str] = []
        # Worker role.
        self.blocks: HostBlocks | DeviceBlocks | None = None
        self._metadata: MooncakeStepMetadata | None = None
        self._failed_loads: set[str] = set()
        """Synchronous loads of this step that failed."""
        self._step_load: Future[set[str]] | None = None
        """This step's synchronous loads, landing run by run on the loader thread."""
        self._step_load_requests: set[str] = set()
        """The requests of :attr:`_step_load` (all failed if the loader itself raises)."""
        self._landed: dict[tuple[int, int], threading.Event] | None = None
        """Per stored group and run of its layers: set once this step's synchronous loads of it landed."""
        self._layer_parts: dict[str, tuple[int, int]] = {}
        """Each stored layer's group and run."""
        self._pending: dict[str, list[Future[None]]] = {}
        """Saves in flight per request."""
        self._awaiting: set[str] = set()
        self._receiving: dict[str, Future[bool]] = {}
        """Asynchronous loads not reported yet, per request: whether every object arrived."""
        self._ended_receiving: set[str] = set()
        self._failed_receiving: set[str] = set()
        """Reported as failed; named in ``finished_receiving`` if the request ends before it is settled."""
        self._released: set[str] = set()
        """Ended requests whose failed load is over: named in the next ``finished_receiving``."""
        self._loader = self._saver = None
        if worker:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weft-mooncake-load")
            self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weft-mooncake-save")
        self._observations: dict[str, list[float]] = {}
        self._observations_lock = threading.Lock()
        self.dropped_saves = 0
        """Objects not saved because the store was unavailable or refused them."""

    # Keys.

    def key(self, group: int, block_hash: bytes, part: int = 0) -> str:
        run = f"{part}/" if self.options.layers_per_object else ""
        return f"{self._key_prefixes[group]}{run}{block_hash.hex()}"

    def _objects(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...], first: int, end: int
    ) -> tuple[BlockTransfer, ...]:
        """The objects of prefix blocks ``first:end``: every block's first run of layers, then the next run."""
        objects = []
        for part in range(max(len(self._parts[group]) for group in self.stored_groups)):
            for position in range(first, end):
                block_hash = request.block_hashes[position]
                for group in self.stored_groups:
                    if part >= len(self._parts[group]):
                        continue
                    per_object = self.block_size // self.groups[group].spec.block_size
                    blocks = block_ids[group][position * per_object : (position + 1) * per_object]
                    objects.append(BlockTransfer(block_hash, group, tuple(blocks), part))
        return tuple(objects)

    # Scheduler role.

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.loads or self.block_size is None:
            return 0, False
        usable = min(len(request.block_hashes), (len(request.prompt_token_ids) - 1) // self.block_size)
        if usable * self.block_size <= num_computed_tokens:
            return 0, False
        hits = self._hits.get(request.request_id)
        if hits is None:
            hits = self._count_stored(request.block_hashes[:usable])
            self._hits[request.request_id] = hits
        count = max(hits * self.block_size - num_computed_tokens, 0)
        return count, bool(count) and self.load_async

    def _count_stored(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks whose objects of every stored group exist in the store."""
        if not hashes:
            return 0
        keys = [
            self.key(group, block_hash, part)
            for block_hash in hashes
            for group in self.stored_groups
            for part in range(len(self._parts[group]))
        ]
        found = self.client.call("lookup", self.client.store.batch_is_exist, keys)
        if found is None:
            return 0
        width = len(keys) // len(hashes)
        count = 0
        while count < len(hashes) and all(value == 1 for value in found[count * width : (count + 1) * width]):
            count += 1
        return count

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...], num_external_tokens: int
    ) -> None:
        # Called at every admission, after a preemption too: the request's tracking starts afresh.
        hits = self._hits.pop(request.request_id, 0)
        tracked = _Tracked(request, block_ids, stored=hits)
        self._tracked[request.request_id] = tracked
        if not num_external_tokens:
            return
        first = hits - num_external_tokens // self.block_size
        if self.load_async:  # block_ids hold every block to load: the request is in no step until it is done
            self._receives.append(RequestTransfer(request.request_id, self._objects(request, block_ids, first, hits)))
            tracked.receiving = True
        else:
            tracked.load_from, tracked.load_to = first, hits

    def build_connector_meta(self, step: ConnectorStep) -> MooncakeStepMetadata:
        loads, saves = [], []
        for scheduled in step.requests:
            tracked = self._tracked.get(scheduled.request_id)
            if tracked is None:
                continue
            tracked.block_ids = scheduled.block_ids
            if tracked.load_to > tracked.load_from:
                objects = self._objects(tracked.request, tracked.block_ids, tracked.load_from, tracked.load_to)
                loads.append(RequestTransfer(scheduled.request_id, objects))
                tracked.load_from = tracked.load_to = 0
            if not self.saves:
                continue
            computed = min(
                scheduled.num_computed_tokens + scheduled.num_new_tokens, len(tracked.request.prompt_token_ids)
            )
            full = min(computed // self.block_size, len(tracked.request.block_hashes))
            if full > tracked.stored:
                objects = self._objects(tracked.request, tracked.block_ids, tracked.stored, full)
                saves.append(RequestTransfer(scheduled.request_id, objects))
                tracked.stored = full
                tracked.saved_any = True
        metadata = MooncakeStepMetadata(
            loads=tuple(loads),
            receives=tuple(self._receives),
            saves=tuple(saves),
            preempted=step.preempted,
            ended=tuple(self._ended),
            settled=tuple(self._settled),
        )
        self._receives, self._ended, self._settled = [], [], []
        return metadata

    def update_connector_output(self, output: ConnectorOutput) -> None:
        for request_id in output.finished_receiving | output.failed_loads:
            tracked = self._tracked.get(request_id)
            if tracked is not None and tracked.receiving:
                tracked.receiving = False
                if request_id in output.failed_loads:
                    self._settled.append(request_id)
        for request_id in output.failed_loads:
            tracked = self._tracked.get(request_id)
            if tracked is not None:  # its blocks are recomputed: save them all again (Mooncake skips stored keys)
                tracked.stored = 0

    def request_finished(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._hits.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        if tracked.receiving:  # a load may still write into its blocks
            self._ended.append(request.request_id)
            return True, None
        return tracked.saved_any, None

    # Worker role.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = {index: group_layers(self.groups[index], kv_caches) for index in self.stored_groups}
        if not layers:
            return
        devices = {tensor.device for group in layers.values() for tensor in group.tensors}
        if len(devices) > 1 or next(iter(devices)).type not in ("cpu", "cuda"):
            raise ValueError(
                f"weft-mooncake moves KV blocks between the store and host memory or one CUDA device; "
                f"this worker's stored KV caches are on {sorted(map(str, devices))}"
            )
        if next(iter(devices)).type == "cpu":
            self.blocks = HostBlocks(layers, self._register, self._parts)
        else:
            self.blocks = DeviceBlocks(layers, self.options.staging_buffer_size, self._register, self._parts)
        self._layer_parts = {
            layer: (index, part)
            for index in self.stored_groups
            for part, run in enumerate(self._parts[index])
            for layer in (self.groups[index].layer_names[position] for position in run)
        }

    def _register(self, address: int, size: int) -> None:
        status = self.client.store.register_buffer(address, size)
        if status != 0:
            raise RuntimeError(
                f"weft-mooncake: registering {size} bytes at {address:#x} with Mooncake failed ({status})"
            )

    def bind_connector_metadata(self, metadata: MooncakeStepMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        self._settle_step_load()  # a step whose forward failed left its load running: nothing else may write now
        metadata = self._metadata
        if metadata is None:
            return
        for request_id in metadata.preempted:  # their blocks may be written from now on
            for future in self._pending.pop(request_id, ()):
                future.result()
        for request_id in metadata.settled:
            self._failed_receiving.discard(request_id)
        for request_id in metadata.ended:
            if request_id in self._receiving:
                self._ended_receiving.add(request_id)
            elif request_id in self._failed_receiving:  # it failed before it ended: no write reaches its blocks
                self._failed_receiving.discard(request_id)
                self._released.add(request_id)
        if not (metadata.receives or metadata.loads):
            return
        # Device caches: the loads' writes wait for the work the engine queued before this step (an
        # earlier step's forward still on the device may read a block that a load now overwrites).
        queued = self.blocks.forward_done()
        for transfer in metadata.receives:
            self._receiving[transfer.request_id] = self._loader.submit(self._load, transfer, queued)
        if (
            metadata.loads
        ):  # synchronous: landed run by run while the forward runs (on the loader, which owns the staging)
            self._landed = {
                (group, part): threading.Event()
                for group in self.stored_groups
                for part in range(len(self._parts[group]))
            }
            self._step_load = self._loader.submit(self._load_in_runs, metadata.loads, self._landed, queued)
            self._step_load_requests = {transfer.request_id for transfer in metadata.loads}

    def _load(self, transfer: RequestTransfer, queued: Any) -> bool:
        """Load a request's objects into its blocks (after the engine's ``queued`` work); whether every object
        arrived."""
        started = time.perf_counter()
        loaded = self._move(transfer.request_id, transfer.objects, queued)
        if loaded is None:
            return False
        self._observe("loaded_bytes_total", loaded)
        self._observe("load_seconds", time.perf_counter() - started)
        return True

    def _load_in_runs(
        self, transfers: Sequence[RequestTransfer], landed: dict[tuple[int, int], threading.Event], queued: Any
    ) -> set[str]:
        """A step's synchronous loads: every request's first run of layers, then the next, each run's event set
        once it landed for all of them (set at the end whatever happened); returns the requests that failed."""
        failed: set[str] = set()
        loaded = dict.fromkeys((transfer.request_id for transfer in transfers), 0)
        seconds = dict.fromkeys(loaded, 0.0)
        """Per request: the time its own objects took to land (the runs of several requests interleave)."""
        try:
            for part in range(max(len(runs) for runs in self._parts.values())):
                for transfer in transfers:
                    objects = [stored for stored in transfer.objects if stored.part == part]
                    if transfer.request_id in failed or not objects:
                        continue
                    started = time.perf_counter()
                    moved = self._move(transfer.request_id, objects, queued)
                    seconds[transfer.request_id] += time.perf_counter() - started
                    if moved is None:
                        failed.add(transfer.request_id)
                    else:
                        loaded[transfer.request_id] += moved
                for (_group, of_part), event in landed.items():
                    if of_part == part:
                        event.set()
        finally:
            for event in landed.values():
                event.set()
        for request_id, moved in loaded.items():
            if request_id not in failed:
                self._observe("loaded_bytes_total", moved)
                self._observe("load_seconds", seconds[request_id])
        return failed

    def _move(self, request_id: str, objects: Sequence[BlockTransfer], queued: Any) -> int | None:
        """Load ``objects`` into their blocks once the engine's ``queued`` work is done with them; the bytes
        moved, None unless every object arrived."""
        loaded = 0
        try:
            for batch in self.blocks.batches(objects, "load"):
                keys = self._keys(batch)
                store = self.client.store
                results = self.client.call(
                    "load", store.batch_get_into_multi_buffers, keys, batch.addresses, batch.sizes
                )
                if results is None or any(got != sum(want) for got, want in zip(results, batch.sizes, strict=True)):
                    return None
                self.blocks.unstage_loaded(batch, queued)
                loaded += sum(map(sum, batch.sizes))
        except Exception:  # a load that fails is recomputed: never let it fail the engine
            logger.exception("weft-mooncake: loading request %s failed", request_id)
            return None
        return loaded

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Returns once this step's synchronous loads of ``layer_name``'s run of layers landed (asynchronous
        loads complete in the background)."""
        landed, where = self._landed, self._layer_parts.get(layer_name)
        if landed is not None and where is not None:
            landed[where].wait()

    def _settle_step_load(self) -> None:
        """The step's synchronous loads are over: their failures join this step's report (all of them, if the
        loader itself raised: they are recomputed rather than left waiting)."""
        if self._step_load is not None:
            step_load, self._step_load, self._landed = self._step_load, None, None
            try:
                self._failed_loads |= step_load.result()
            except Exception:  # noqa: BLE001 - a bug in the loader: recompute, never fail or stall the engine
                logger.exception("weft-mooncake: a step's synchronous loads failed; their requests are recomputed")
                self._failed_loads |= self._step_load_requests

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        """An object spans all layers of its group, so saving starts in :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        self._settle_step_load()  # a request whose load failed saves nothing of this step
        metadata = self._metadata
        if metadata is None or not metadata.saves or self._saver is None:
            return
        forward_done = self.blocks.forward_done()
        for transfer in metadata.saves:
            if transfer.request_id in self._failed_loads:  # its KV of this step is not valid
                continue
            if not self.client.available:
                self._dropped(len(transfer.objects))
                continue
            future = self._saver.submit(self._save, transfer, forward_done)
            self._pending.setdefault(transfer.request_id, []).append(future)

    def _save(self, transfer: RequestTransfer, forward_done: Any) -> None:
        try:
            batches = list(self.blocks.batches(transfer.objects, "save"))
        except Exception:  # a save is best effort: never let it fail the engine
            logger.exception("weft-mooncake: planning the save of %d objects failed", len(transfer.objects))
            self._dropped(len(transfer.objects))
            return
        for batch in batches:
            try:
                self.blocks.stage_for_save(batch, forward_done)
                store = self.client.store
                keys = self._keys(batch)
                results = self.client.call(
                    "save", store.batch_put_from_multi_buffers, keys, batch.addresses, batch.sizes
                )
            except Exception:  # a save is best effort: never let it fail the engine
                logger.exception("weft-mooncake: saving %d objects failed", len(batch.objects))
                results = None
            refused = len(batch.objects) if results is None else sum(1 for value in results if value != 0)
            saved = sum(sum(sizes) for sizes, value in zip(batch.sizes, results or (), strict=False) if value == 0)
            self._observe("saved_bytes_total", saved)
            if refused:
                self._dropped(refused)
                logger.debug(
                    "weft-mooncake: %d of %d objects were not saved (%s)", refused, len(batch.objects), results
                )

    def _keys(self, batch: Batch) -> list[str]:
        return [self.key(batch.group, stored.block_hash, batch.part) for stored in batch.objects]

    def _dropped(self, count: int) -> None:
        self.dropped_saves += count
        self._observe("dropped_saves_total", count)

    def _observe(self, name: str, value: float) -> None:
        with self._observations_lock:
            self._observations.setdefault(name, []).append(float(value))

    def get_finished(self, finished_request_ids: set[str]) -> ConnectorOutput:
        self._settle_step_load()
        self._awaiting |= finished_request_ids
        sent = set()
        for request_id in self._awaiting:
            pending = [future for future in self._pending.get(request_id, ()) if not future.done()]
            if pending:
                self._pending[request_id] = pending
            else:
                self._pending.pop(request_id, None)
                sent.add(request_id)
        self._awaiting -= sent
        arrived, failed = self._released, self._failed_loads
        self._released, self._failed_loads = set(), set()
        for request_id in [request_id for request_id, future in self._receiving.items() if future.done()]:
            complete = self._load_result(request_id, self._receiving.pop(request_id))
            if complete or request_id in self._ended_receiving:
                arrived.add(request_id)
            else:
                failed.add(request_id)
                self._failed_receiving.add(request_id)
            self._ended_receiving.discard(request_id)
        with self._observations_lock:
            observations, self._observations = self._observations, {}
        return ConnectorOutput(
            finished_sending=frozenset(sent),
            finished_receiving=frozenset(arrived),
            failed_loads=frozenset(failed),
            observations=observations,
        )

    @staticmethod
    def _load_result(request_id: str, future: Future[bool]) -> bool:
        """Whether an asynchronous load completed; one whose loader raised counts as failed (recomputed)."""
        error = future.exception()
        if error is not None:
            logger.error("weft-mooncake: loading request %s failed; it is recomputed", request_id, exc_info=error)
            return False
        return future.result()

    # Both roles.

    def close(self) -> None:
        if self._loader is not None:
            try:
                self._settle_step_load()  # its writes are over before the cache goes
            except Exception:  # noqa: BLE001 - closing: report, and go on releasing
                logger.exception("weft-mooncake: the last step's load failed")
        for executor in (self._loader, self._saver):
            if executor is not None:
                executor.shutdown(wait=True)
        self._loader = self._saver = None
        if self.blocks is not None:
            for address in self.blocks.registered:
                self.client.store.unregister_buffer(address)
            self.blocks = None
        self.client.close()
