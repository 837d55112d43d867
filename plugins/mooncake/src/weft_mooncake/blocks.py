"""Where a stored object's bytes are on the worker: in the KV cache itself, or in a staging buffer.

A stored object is one prefix block of one KV-cache group across a run of the group's
layers (all of them, or ``layers_per_object`` at a time: :func:`layer_parts`): for each
layer of the run in the group's order, for each of the object's cache blocks,
the block's keys then its values (the attention backends' layout ``[2, num_blocks, ...]``),
or the block's bytes (a model-managed group, block first: DeepSeek V4's compressed entries
and snapshots). Both kinds of cache give the store that same byte layout, so the store's
bytes do not depend on where the cache lives.

* :class:`HostBlocks`: a cache in host memory (the ``cpu`` platform). The cache tensors
  are registered with Mooncake's transfer engine and every block's keys and values are
  one buffer slice each: objects move straight between the cache and the store, with
  no copy of ours.
* :class:`DeviceBlocks`: a cache in CUDA device memory. Objects go through a pinned
  host staging buffer registered with Mooncake (one slice per object): a save gathers
  the blocks on the device into a scratch buffer and copies it to the staging buffer,
  a load copies the staging buffer to the scratch buffer and scatters it into the
  blocks. The copies run on a side stream per direction, outside the engine's
  forward pass (and so outside any captured CUDA graph); a save first waits for the
  forward that wrote its blocks (an event recorded after it). Each direction owns
  half of both buffers, and one thread per direction uses it, one batch at a time.

A batch is what one store call moves: the objects of one group and layer run, at most
:data:`MAX_SLICES_PER_CALL` buffer slices and, through a staging buffer, at most half of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from weft.contracts.kv_cache import KVCacheGroupSpec

MAX_SLICES_PER_CALL = 1024
"""Buffer slices one batch call may move: larger batches overflow the TCP transport's queue (parts of
them fail) and can outlast the master's read lease (10 s), on a loaded machine."""

Direction = Literal["load", "save"]


class StoredObject(Protocol):
    """What a batch needs to know of a stored object (weft_mooncake.connector.BlockTransfer)."""

    group: int
    blocks: tuple[int, ...]
    part: int
    """Which run of the group's layers the object holds (:func:`layer_parts`); 0 when one object holds them all."""


class Batch(NamedTuple):
    """One store call's objects (all of ``group`` and ``part``), with the buffer slices each object's bytes take."""

    group: int
    part: int
    objects: list[StoredObject]
    addresses: list[list[int]]
    sizes: list[list[int]]


def whole_groups(layers: dict[int, GroupLayers]) -> dict[int, list[range]]:
    """One run of every layer per group: objects that hold all their group's layers."""
    return {group: layer_parts(len(tensors), 0) for group, (tensors, _, _) in layers.items()}


def layer_parts(layer_count: int, layers_per_object: int) -> list[range]:
    """The runs of a group's layers (by index in its order) one object each holds: all of them when
    ``layers_per_object`` is 0, else ``layers_per_object`` at a time (the last run may be shorter)."""
    step = layers_per_object or layer_count
    return [range(start, min(start + step, layer_count)) for start in range(0, layer_count, step)]


class GroupLayers(NamedTuple):
    """The cache tensors of one stored group's layers, checked for a layout the store knows."""

    tensors: list[torch.Tensor]
    block_bytes: int
    """Bytes of one block's part in one layer: its keys (as many for its values), or all of it (block first)."""
    parts: int = 2
    """2: keys and values, ``[2, num_blocks, ...]``; 1: block first, ``[num_blocks, ...]``."""


def group_layers(group: KVCacheGroupSpec, kv_caches: dict[str, torch.Tensor]) -> GroupLayers:
    """The group's cache tensors; ValueError naming the layer unless each is contiguous in the
    default layout ``[2, num_blocks, block_size, ...]`` or, for a model-managed group, block first
    (``weft.contracts.kv_connector.block_axis``), with the group's page size."""
    from weft.contracts.kv_connector import block_axis

    tensors, parts = [], 2
    page = group.spec.page_size_bytes()
    for layer in group.layer_names:
        tensor = kv_caches[layer]
        parts = 2 if block_axis(group, layer, tensor) == 1 else 1
        if not tensor.is_contiguous():
            raise ValueError(f"weft-mooncake expects contiguous KV caches; {layer} has strides {tensor.stride()}")
        tensors.append(tensor)
    return GroupLayers(tensors, page // parts, parts)


class HostBlocks:
    """A host-memory cache: objects move straight between the registered cache tensors and the store."""

    def __init__(
        self,
        layers: dict[int, GroupLayers],
        register: Callable[[int, int], None],
        parts: dict[int, list[range]] | None = None,
    ) -> None:
        """``parts``: per group, the runs of its layers one object each holds (default: one run of all)."""
        self._parts = parts or whole_groups(layers)
        self._layouts: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        """Per stored group, per layer: (base address of each part, bytes of a block's part)."""
        self.registered: list[int] = []
        for group, (tensors, block_bytes, parts) in layers.items():
            self._layouts[group] = [
                (tuple(part.data_ptr() for part in tensor) if parts == 2 else (tensor.data_ptr(),), block_bytes)
                for tensor in tensors
            ]
            for tensor in tensors:
                if tensor.data_ptr() not in self.registered:
                    register(tensor.data_ptr(), tensor.numel() * tensor.element_size())
                    self.registered.append(tensor.data_ptr())

    def object_bytes(self, group: int, blocks_per_object: int, part: int = 0) -> int:
        layouts = [self._layouts[group][layer] for layer in self._parts[group][part]]
        return sum(len(bases) * block_bytes for bases, block_bytes in layouts) * blocks_per_object

    def batches(self, objects: Sequence[StoredObject], direction: Direction) -> Iterator[Batch]:
        for (group, part), of_group in _by_group(objects):
            batch = Batch(group, part, [], [], [])
            layouts = [self._layouts[group][layer] for layer in self._parts[group][part]]
            for stored in of_group:
                addresses, sizes = [], []
                for bases, block_bytes in layouts:
                    for block in stored.blocks:
                        addresses += (base + block * block_bytes for base in bases)
                        sizes += (block_bytes,) * len(bases)
                if batch.objects and sum(map(len, batch.sizes)) + len(sizes) > MAX_SLICES_PER_CALL:
                    yield batch
                    batch = Batch(group, part, [], [], [])
                batch.objects.append(stored)
                batch.addresses.append(addresses)
                batch.sizes.append(sizes)
            if batch.objects:
                yield batch

    def forward_done(self) -> None:
        """The forward ran on the host: its blocks are written."""
        return None

    def stage_for_save(self, batch: Batch, forward_done: None) -> None:
        """Nothing to stage: the store reads the cache."""

    def unstage_loaded(self, batch: Batch, queued: None) -> None:
        """Nothing to unstage: the store wrote into the cache."""


class DeviceBlocks:
    """A CUDA device cache, moved through a pinned host staging buffer with copies on side streams."""

    def __init__(
        self,
        layers: dict[int, GroupLayers],
        staging_bytes: int,
        register: Callable[[int, int], None],
        parts: dict[int, list[range]] | None = None,
    ) -> None:
        """``parts``: as :class:`HostBlocks`'."""
        import torch

        self._parts = parts or whole_groups(layers)
        first = next(iter(layers.values())).tensors[0]
        self.device = first.device
        self._layers = {
            group: (byte_layers(tensors, block_bytes, parts), block_bytes, parts)
            for group, (tensors, block_bytes, parts) in layers.items()
        }
        self.half = staging_bytes // 2
        largest = max(self.object_bytes(group, 1) for group in layers)
        if largest > self.half:
            raise ValueError(
                f"weft-mooncake: staging_buffer_size = {staging_bytes} holds half for loads and half for saves, and "
                f"one stored block of this model takes {largest} bytes: set staging_buffer_size to at least "
                f"{2 * largest}"
            )
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True)
        self.scratch = torch.empty(staging_bytes, dtype=torch.uint8, device=self.device)
        self.streams = {"load": torch.cuda.Stream(self.device), "save": torch.cuda.Stream(self.device)}
        self._region = {"load": 0, "save": self.half}
        register(self.staging.data_ptr(), staging_bytes)
        self.registered = [self.staging.data_ptr()]

    def object_bytes(self, group: int, blocks_per_object: int, part: int = 0) -> int:
        _, block_bytes, parts = self._layers[group]
        return len(self._parts[group][part]) * blocks_per_object * parts * block_bytes

    def batches(self, objects: Sequence[StoredObject], direction: Direction) -> Iterator[Batch]:
        base = self.staging.data_ptr() + self._region[direction]
        for (group, part), of_group in _by_group(objects):
            batch, used = Batch(group, part, [], [], []), 0
            for stored in of_group:
                size = self.object_bytes(group, len(stored.blocks), part)
                if batch.objects and (used + size > self.half or len(batch.objects) >= MAX_SLICES_PER_CALL):
                    yield batch
                    batch, used = Batch(group, part, [], [], []), 0
                batch.objects.append(stored)
                batch.addresses.append([base + used])
                batch.sizes.append([size])
                used += size
            if batch.objects:
                yield batch

    def forward_done(self) -> torch.cuda.Event:
        """An event after the work queued so far on the engine's stream (the forward that wrote the blocks)."""
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stage_for_save(self, batch: Batch, forward_done: torch.cuda.Event) -> None:
        """Gather the batch's blocks into the staging buffer; returns once the bytes are there."""
        import torch

        stream = self.streams["save"]
        with torch.inference_mode(), torch.cuda.stream(stream):  # the engine's cache may be an inference tensor
            stream.wait_event(forward_done)
            staged, blocks = self._staged(batch, "save")
            gather_blocks(self._part_layers(batch), blocks, staged)
            start = self._region["save"]
            self.staging[start : start + staged.numel()].copy_(staged.view(-1), non_blocking=True)
        stream.synchronize()

    def unstage_loaded(self, batch: Batch, queued: torch.cuda.Event) -> None:
        """Scatter the batch's objects from the staging buffer into their blocks, after the engine's ``queued``
        work (:meth:`forward_done` when the load started); returns once they are there."""
        import torch

        stream = self.streams["load"]
        with torch.inference_mode(), torch.cuda.stream(stream):
            stream.wait_event(queued)
            staged, blocks = self._staged(batch, "load")
            start = self._region["load"]
            staged.view(-1).copy_(self.staging[start : start + staged.numel()], non_blocking=True)
            scatter_blocks(staged, blocks, self._part_layers(batch))
        stream.synchronize()

    def _part_layers(self, batch: Batch) -> list[torch.Tensor]:
        tensors = self._layers[batch.group][0]
        return [tensors[layer] for layer in self._parts[batch.group][batch.part]]

    def _staged(self, batch: Batch, direction: Direction) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's scratch view (see :func:`gather_blocks`) and its block ids, on the device."""
        import torch

        _, block_bytes, parts = self._layers[batch.group]
        layer_count = len(self._parts[batch.group][batch.part])
        count = len(batch.objects[0].blocks)
        start = self._region[direction]
        size = len(batch.objects) * self.object_bytes(batch.group, count, batch.part)
        staged = self.scratch[start : start + size].view(len(batch.objects), layer_count, count, parts, block_bytes)
        ids = [block for stored in batch.objects for block in stored.blocks]
        return staged, torch.tensor(ids, dtype=torch.long, device=self.device)


def byte_layers(tensors: Sequence[torch.Tensor], block_bytes: int, parts: int = 2) -> list[torch.Tensor]:
    """Each cache tensor ``[2, num_blocks, ...]`` (or block first, ``parts`` 1) seen as bytes,
    ``[parts, num_blocks, block_bytes]``."""
    import torch

    return [tensor.view(torch.uint8).view(parts, -1, block_bytes) for tensor in tensors]


def gather_blocks(layers: Sequence[torch.Tensor], blocks: torch.Tensor, staged: torch.Tensor) -> None:
    """Copy ``blocks`` of every layer (:func:`byte_layers`) into ``staged``, ``[objects, layers, blocks per object,
    parts, block bytes]``: object after object, the stored byte layout (the module docstring)."""
    objects, _, count, parts, _ = staged.shape
    for index, cache in enumerate(layers):
        staged[:, index].copy_(cache.index_select(1, blocks).view(parts, objects, count, -1).permute(1, 2, 0, 3))


def scatter_blocks(staged: torch.Tensor, blocks: torch.Tensor, layers: Sequence[torch.Tensor]) -> None:
    """The inverse of :func:`gather_blocks`: write ``staged`` into ``blocks`` of every layer."""
    objects, _, count, parts, _ = staged.shape
    for index, cache in enumerate(layers):
        cache.index_copy_(1, blocks, staged[:, index].permute(2, 0, 1, 3).reshape(parts, objects * count, -1))


def _by_group(objects: Sequence[StoredObject]) -> Iterator[tuple[tuple[int, int], list[StoredObject]]]:
    """The objects by group and layer run, in the order each first appears."""
    groups: dict[tuple[int, int], list[StoredObject]] = {}
    for stored in objects:
        groups.setdefault((stored.group, stored.part), []).append(stored)
    yield from groups.items()
