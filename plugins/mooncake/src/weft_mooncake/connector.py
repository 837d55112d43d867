"""The MooncakeStore KV connector: full prompt blocks in Mooncake's distributed store, loaded back on a hit.

One stored object is one prefix block (:func:`connector_block_size` tokens) of one
prefix-cacheable KV-cache group, across all the group's layers, keys then values,
copied straight from and into the engine's KV-cache tensors (they are registered
with Mooncake's transfer engine; no staging copy). Its key names the model, the
KV dtype, the TP and PP rank, the group, the block size and the block's chained
prefix hash, so only an engine that would compute the same bytes finds it::

    weft/<model>@<config digest>/<dtype>/tp<rank>of<size>/pp<rank>of<size>/<group>/<block size>/<hash>

Scheduler role: a request's lookup asks the store which leading blocks exist
(prompts shorter than a block match nothing; the last token is always left to
compute) and offers those beyond the engine's local prefix-cache hit. Every step
it plans the loads of newly admitted requests and the saves of prompt blocks
that became full (never blocks holding generated tokens). A preempted request
starts afresh when it is admitted again.

Worker role: loads run before the forward pass, in one batch; a request any of
whose objects is missing or the wrong size reports a failed load and is
recomputed (its saves of that step are skipped). Saves run after the forward on
a background thread, reading the cache blocks directly; finished requests keep
their blocks until their saves are done (``delay_free``), and a preempted
request's saves are finished before the next forward writes to any block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta
from weft.contracts.kv_connector import (
    ConnectorContext,
    ConnectorOutput,
    ConnectorRequest,
    ConnectorStep,
    KVConnector,
    connector_block_size,
)

from weft_mooncake.store import StoreClient

if TYPE_CHECKING:
    import torch
    from weft.contracts.kv_cache import KVCacheGroupSpec

logger = logging.getLogger("weft.mooncake")

MAX_SLICES_PER_CALL = 1024
"""Buffer slices one batch call may move: larger batches overflow the TCP transport's queue (parts of
them fail) and can outlast the master's read lease (10 s), on a loaded machine."""


class MooncakeOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[plugins.mooncake]``: where the store is and what this engine does with it (Mooncake's own names)."""

    master_server_address: Annotated[
        str, Meta(pattern=r"^[^:\s]+:[0-9]{1,5}$", description="host:port of mooncake_master's RPC service")
    ] = "127.0.0.1:50051"
    metadata_server: Annotated[
        str, Meta(min_length=1, description="transfer-engine metadata service, e.g. http://host:port/metadata (the master's "
                              "--enable_http_metadata_server), an etcd host:port, or P2PHANDSHAKE")
    ] = "http://127.0.0.1:8080/metadata"
    global_segment_size: Annotated[
        int, Meta(ge=0, description="bytes of this engine's memory contributed to the store; 0 = contribute none "
                                    "(objects then live on storage nodes and outlive the engine)")
    ] = 0
    local_buffer_size: Annotated[int, Meta(ge=0, description="bytes of Mooncake's local transfer buffer")] = 16 << 20
    protocol: Annotated[Literal["tcp", "rdma"], Meta(description="transfer protocol")] = "tcp"
    device_name: Annotated[str, Meta(description="RDMA devices for protocol rdma, e.g. mlx5_0")] = ""
    local_hostname: Annotated[str, Meta(description="address other Mooncake nodes reach this engine at")] = (
        "127.0.0.1"
    )
    role: Annotated[
        Literal["both", "producer", "consumer"],
        Meta(description="both: save and load; producer: only save; consumer: only load, never save"),
    ] = "both"

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


class RequestTransfer(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    objects: tuple[BlockTransfer, ...]


class MooncakeStepMetadata(msgspec.Struct, frozen=True):
    """What the scheduler role asks the workers to do in one step (msgspec-encodable)."""

    loads: tuple[RequestTransfer, ...] = ()
    saves: tuple[RequestTransfer, ...] = ()
    preempted: frozenset[str] = frozenset()


class _Tracked:
    """The scheduler role's state of one admitted request."""

    __slots__ = ("request", "block_ids", "stored", "load_from", "load_to", "saved_any")

    def __init__(self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...], stored: int) -> None:
        self.request = request
        self.block_ids = block_ids
        self.stored = stored
        """Prefix blocks that are in the store or planned to be saved."""
        self.load_from = self.load_to = 0
        self.saved_any = False


class MooncakeStoreConnector(KVConnector):
    """Full prompt blocks in Mooncake's distributed store (MooncakeStore), loaded back on a prefix hit."""

    name: ClassVar[str] = "mooncake"
    metadata_type: ClassVar[Any] = MooncakeStepMetadata
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
        prefix = (
            f"weft/{context.model}/{{dtype}}/tp{context.tp_rank}of{context.tp_size}/"
            f"pp{context.pp_rank}of{context.pp_size}/{{group}}/{self.block_size}/"
        )
        self._key_prefixes = {
            index: prefix.format(dtype=self.groups[index].spec.dtype, group=self.groups[index].name)
            for index in self.stored_groups
        }
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
        # Worker role.
        self._layouts: list[list[tuple[int, int, int]]] = [[] for _ in self.groups]
        """Per group, per layer: (keys base address, values base address, bytes per block)."""
        self._registered: list[int] = []
        self._metadata: MooncakeStepMetadata | None = None
        self._failed_loads: set[str] = set()
        self._pending: dict[str, list[Future[Any]]] = {}
        self._awaiting: set[str] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weft-mooncake-save") if worker else None
        self.dropped_saves = 0
        """Objects not saved because the store was unavailable or refused them."""

    # Keys.

    def key(self, group: int, block_hash: bytes) -> str:
        return self._key_prefixes[group] + block_hash.hex()

    def _objects(self, tracked: _Tracked, first: int, end: int) -> tuple[BlockTransfer, ...]:
        objects = []
        for position in range(first, end):
            block_hash = tracked.request.block_hashes[position]
            for group in self.stored_groups:
                per_object = self.block_size // self.groups[group].spec.block_size
                blocks = tracked.block_ids[group][position * per_object : (position + 1) * per_object]
                objects.append(BlockTransfer(block_hash, group, tuple(blocks)))
        return tuple(objects)

    # Scheduler role.

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.loads or self.block_size is None:
            return 0, False
        usable = min(len(request.block_hashes), (len(request.prompt_token_ids) - 1) // self.block_size)
        if usable * self.block_size <= num_computed_tokens:
            return 0, False
        hits = self._hits.get(request.request_id)
        if hits is None:
            hits = self._count_stored(request.block_hashes[:usable])
            self._hits[request.request_id] = hits
        return max(hits * self.block_size - num_computed_tokens, 0), False

    def _count_stored(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks whose objects of every stored group exist in the store."""
        if not hashes:
            return 0
        keys = [self.key(group, block_hash) for block_hash in hashes for group in self.stored_groups]
        found = self.client.call("lookup", self.client.store.batch_is_exist, keys)
        if found is None:
            return 0
        width = len(self.stored_groups)
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
        if num_external_tokens:
            tracked.load_to = hits
            tracked.load_from = hits - num_external_tokens // self.block_size
        self._tracked[request.request_id] = tracked

    def build_connector_meta(self, step: ConnectorStep) -> MooncakeStepMetadata:
        loads, saves = [], []
        for scheduled in step.requests:
            tracked = self._tracked.get(scheduled.request_id)
            if tracked is None:
                continue
            tracked.block_ids = scheduled.block_ids
            if tracked.load_to > tracked.load_from:
                loads.append(RequestTransfer(scheduled.request_id, self._objects(tracked, tracked.load_from, tracked.load_to)))
                tracked.load_from = tracked.load_to = 0
            if not self.saves:
                continue
            computed = min(scheduled.num_computed_tokens + scheduled.num_new_tokens, len(tracked.request.prompt_token_ids))
            full = min(computed // self.block_size, len(tracked.request.block_hashes))
            if full > tracked.stored:
                saves.append(RequestTransfer(scheduled.request_id, self._objects(tracked, tracked.stored, full)))
                tracked.stored = full
                tracked.saved_any = True
        return MooncakeStepMetadata(loads=tuple(loads), saves=tuple(saves), preempted=step.preempted)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        for request_id in output.failed_loads:
            tracked = self._tracked.get(request_id)
            if tracked is not None:  # its blocks are recomputed: save them all again (Mooncake skips stored keys)
                tracked.stored = 0

    def request_finished(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._hits.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        return (tracked is not None and tracked.saved_any), None

    # Worker role.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for index in self.stored_groups:
            group = self.groups[index]
            for layer in group.layer_names:
                tensor = kv_caches[layer]
                self._layouts[index].append(self._layer_layout(layer, tensor, group))
                if tensor.data_ptr() not in self._registered:
                    status = self.client.store.register_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size())
                    if status != 0:
                        raise RuntimeError(f"weft-mooncake: registering the KV cache of {layer} failed ({status})")
                    self._registered.append(tensor.data_ptr())

    @staticmethod
    def _layer_layout(layer: str, tensor: torch.Tensor, group: KVCacheGroupSpec) -> tuple[int, int, int]:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"weft-mooncake moves KV blocks from host memory; the cache of {layer} is on {tensor.device} "
                f"(device caches need a staging buffer this connector does not have yet): use the cpu platform"
            )
        page = group.spec.page_size_bytes()
        if not tensor.is_contiguous() or tensor.dim() < 3 or tensor.shape[0] != 2:
            raise ValueError(
                f"weft-mooncake expects the default KV-cache layout [2, num_blocks, block_size, ...] "
                f"(AttentionBackend.kv_cache_shape); {layer} has shape {tuple(tensor.shape)}"
            )
        half = tensor[0]
        block_bytes = half[0].numel() * tensor.element_size()
        if 2 * block_bytes != page:
            raise ValueError(
                f"weft-mooncake: a block of {layer} takes {2 * block_bytes} bytes but its group "
                f"{group.name!r} declares {page}"
            )
        return tensor[0].data_ptr(), tensor[1].data_ptr(), block_bytes

    def _batches(self, objects: Sequence[BlockTransfer]):
        """``(keys, addresses, sizes)`` of consecutive objects, at most :data:`MAX_SLICES_PER_CALL` slices each."""
        keys: list[str] = []
        addresses: list[list[int]] = []
        sizes: list[list[int]] = []
        for block in objects:
            block_addresses, block_sizes = self._buffers(block)
            if keys and sum(map(len, sizes)) + len(block_sizes) > MAX_SLICES_PER_CALL:
                yield keys, addresses, sizes
                keys, addresses, sizes = [], [], []
            keys.append(self.key(block.group, block.block_hash))
            addresses.append(block_addresses)
            sizes.append(block_sizes)
        if keys:
            yield keys, addresses, sizes

    def _buffers(self, transfer: BlockTransfer) -> tuple[list[int], list[int]]:
        addresses, sizes = [], []
        for keys_base, values_base, block_bytes in self._layouts[transfer.group]:
            for block in transfer.blocks:
                offset = block * block_bytes
                addresses += (keys_base + offset, values_base + offset)
                sizes += (block_bytes, block_bytes)
        return addresses, sizes

    def bind_connector_metadata(self, metadata: MooncakeStepMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        metadata = self._metadata
        if metadata is None:
            return
        for request_id in metadata.preempted:  # their blocks may be written from now on
            for future in self._pending.pop(request_id, ()):
                future.result()
        if not metadata.loads:
            return
        for transfer in metadata.loads:
            for keys, addresses, sizes in self._batches(transfer.objects):
                if transfer.request_id in self._failed_loads:
                    break
                store = self.client.store
                results = self.client.call("load", store.batch_get_into_multi_buffers, keys, addresses, sizes)
                if results is None or any(got != sum(want) for got, want in zip(results, sizes, strict=True)):
                    self._failed_loads.add(transfer.request_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in :meth:`start_load_kv`: every layer is ready."""

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        """An object spans all layers of its group, so saving starts in :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        metadata = self._metadata
        if metadata is None or not metadata.saves or self._executor is None:
            return
        for transfer in metadata.saves:
            if transfer.request_id in self._failed_loads:  # its KV of this step is not valid
                continue
            if not self.client.available:
                self.dropped_saves += len(transfer.objects)
                continue
            for keys, addresses, sizes in self._batches(transfer.objects):
                future = self._executor.submit(self._put, keys, addresses, sizes)
                self._pending.setdefault(transfer.request_id, []).append(future)

    def _put(self, keys: list[str], addresses: list[list[int]], sizes: list[list[int]]) -> None:
        try:
            store = self.client.store
            results = self.client.call("save", store.batch_put_from_multi_buffers, keys, addresses, sizes)
        except Exception:  # a save is best effort: never let it fail the engine
            logger.exception("weft-mooncake: saving %d objects failed", len(keys))
            results = None
        refused = len(keys) if results is None else sum(1 for value in results if value != 0)
        if refused:
            self.dropped_saves += refused
            logger.debug("weft-mooncake: %d of %d objects were not saved (%s)", refused, len(keys), results)

    def get_finished(self, finished_request_ids: set[str]) -> ConnectorOutput:
        self._awaiting |= finished_request_ids
        done = set()
        for request_id in self._awaiting:
            pending = [future for future in self._pending.get(request_id, ()) if not future.done()]
            if pending:
                self._pending[request_id] = pending
            else:
                self._pending.pop(request_id, None)
                done.add(request_id)
        self._awaiting -= done
        failed, self._failed_loads = self._failed_loads, set()
        return ConnectorOutput(finished_sending=frozenset(done), failed_loads=frozenset(failed))

    # Both roles.

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for address in self._registered:
            self.client.store.unregister_buffer(address)
        self._registered.clear()
        self.client.close()
