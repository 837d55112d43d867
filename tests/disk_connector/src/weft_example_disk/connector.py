"""A KV connector that keeps full prompt blocks as files in a directory, for any later engine of the same model.

One file holds one prefix block (``connector_block_size`` tokens) of one
prefix-cacheable KV-cache group, the blocks of all the group's layers stacked::

    <path>/<model identity>/tp<rank>of<size>-pp<rank>of<size>/<group>-<dtype>-<block size>/<chained block hash>.pt

Scheduler role: a lookup counts the prompt's leading blocks whose files exist
(never the block holding the last token) and offers those beyond the engine's
own prefix-cache hit. Each step it plans the loads the step carries and the
saves of prompt blocks that became full. Worker role: loads before the forward
pass, saves after it, both synchronous, so no save outlives its step.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import msgspec
import torch

from weft.contracts.kv_cache import KVCacheGroupSpec, prefix_cacheable_groups
from weft.contracts.kv_connector import (
    ConnectorContext,
    ConnectorOutput,
    ConnectorRequest,
    ConnectorStep,
    KVConnector,
    block_axis,
    connector_block_size,
)

logger = logging.getLogger("weft.disk")


class DiskOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[plugins.disk]``."""

    path: Annotated[str, msgspec.Meta(min_length=1, description="directory the blocks are kept in")]


class BlockFile(msgspec.Struct, frozen=True, array_like=True):
    """One stored prefix block of one group: its file and the group's cache blocks it covers."""

    path: str
    group: int
    blocks: tuple[int, ...]


class DiskStepMetadata(msgspec.Struct, frozen=True):
    """The files each request loads and saves in one step."""

    loads: dict[str, tuple[BlockFile, ...]] = {}
    saves: dict[str, tuple[BlockFile, ...]] = {}


class _Tracked:
    """The scheduler role's state of one admitted request."""

    def __init__(self, request: ConnectorRequest) -> None:
        self.request = request
        self.saved = 0
        """Leading prompt blocks saved, or planned to be, since the request was admitted."""


class DiskConnector(KVConnector):
    """Full prompt blocks as files in a directory, loaded back by any later engine of the same model."""

    name: ClassVar[str] = "disk"
    Options = DiskOptions

    def __init__(
        self,
        options: DiskOptions | None,
        role: Literal["scheduler", "worker"],
        groups: Sequence[KVCacheGroupSpec],
        context: ConnectorContext,
    ) -> None:
        super().__init__(options, role, groups, context)
        self.block_size = connector_block_size(self.groups)
        self.stored_groups = prefix_cacheable_groups(self.groups)  # never a ring or a recurrent state
        ranks = f"tp{context.tp_rank}of{context.tp_size}-pp{context.pp_rank}of{context.pp_size}"
        self.root = Path(self.options.path).expanduser() / context.model.replace("/", "--") / ranks
        self._tracked: dict[str, _Tracked] = {}  # scheduler role
        self._caches: dict[str, torch.Tensor] = {}  # worker role, from here on
        self._axes: dict[str, int] = {}
        self._metadata = DiskStepMetadata()
        self._failed: set[str] = set()

    def _file(self, group: int, block_hash: bytes) -> Path:
        spec = self.groups[group]
        return self.root / f"{spec.name}-{spec.spec.dtype}-{self.block_size}" / f"{block_hash.hex()}.pt"

    def _block_files(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...], first: int, end: int
    ) -> tuple[BlockFile, ...]:
        """The files of prefix blocks ``[first, end)``, with the cache blocks each covers in its group."""
        files = []
        for position in range(first, end):
            for group in self.stored_groups:
                per_file = self.block_size // self.groups[group].spec.block_size
                blocks = block_ids[group][position * per_file : (position + 1) * per_file]
                files.append(BlockFile(str(self._file(group, request.block_hashes[position])), group, blocks))
        return tuple(files)

    # Scheduler role.

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if self.block_size is None:
            return 0, False
        usable = (len(request.prompt_token_ids) - 1) // self.block_size  # the last token is always computed
        found = 0
        while found < usable and all(
            self._file(group, request.block_hashes[found]).exists() for group in self.stored_groups
        ):
            found += 1
        return max(found * self.block_size - num_computed_tokens, 0), False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...], num_external_tokens: int
    ) -> None:
        self._tracked[request.request_id] = _Tracked(request)  # after a preemption too: start afresh

    def build_connector_meta(self, step: ConnectorStep) -> DiskStepMetadata:
        loads, saves = {}, {}
        for item in step.requests:
            tracked = self._tracked.get(item.request_id)
            if tracked is None or self.block_size is None:
                continue
            request = tracked.request
            if item.num_external_tokens:  # tokens [num_computed - num_external, num_computed) come from disk
                first = (item.num_computed_tokens - item.num_external_tokens) // self.block_size
                loads[item.request_id] = self._block_files(
                    request, item.block_ids, first, item.num_computed_tokens // self.block_size
                )
            computed = min(item.num_computed_tokens + item.num_new_tokens, len(request.prompt_token_ids))
            full = computed // self.block_size  # prompt blocks complete after this step; never generated tokens
            if full > tracked.saved:
                saves[item.request_id] = self._block_files(request, item.block_ids, tracked.saved, full)
                tracked.saved = full
        return DiskStepMetadata(loads=loads, saves=saves)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        for request_id in output.failed_loads:  # the worker skipped its saves of that step: plan them again
            if request_id in self._tracked:
                self._tracked[request_id].saved = 0

    def request_finished(self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...]) -> tuple[bool, None]:
        self._tracked.pop(request.request_id, None)
        return False, None  # saves are done by the end of their step: the blocks may be freed at once

    # Worker role.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for index in self.stored_groups:
            group = self.groups[index]
            for layer in group.layer_names:
                self._axes[layer] = block_axis(group, layer, kv_caches[layer])  # refuses a layout it does not know
        self._caches = kv_caches

    def bind_connector_metadata(self, metadata: DiskStepMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = DiskStepMetadata()

    def start_load_kv(self) -> None:
        for request_id, files in self._metadata.loads.items():
            try:
                for file in files:
                    self._load(file)
            except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as error:
                # A missing, damaged or foreign file: report the load failed, and the engine recomputes.
                logger.warning("weft-example-disk: loading request %s failed: %s", request_id, error)
                self._failed.add(request_id)

    def _load(self, file: BlockFile) -> None:
        layers = self.groups[file.group].layer_names
        stacked = torch.load(file.path, weights_only=True)
        expected = [len(layers), *self._block_shape(layers[0], len(file.blocks))]
        if list(stacked.shape) != expected or stacked.dtype != self._caches[layers[0]].dtype:
            raise ValueError(f"{file.path} holds {list(stacked.shape)} {stacked.dtype}; expected {expected}")
        for layer, blocks in zip(layers, stacked, strict=False):
            cache = self._caches[layer]
            cache.index_copy_(
                self._axes[layer], torch.tensor(file.blocks, device=cache.device), blocks.to(cache.device)
            )

    def _block_shape(self, layer: str, count: int) -> list[int]:
        shape = list(self._caches[layer].shape)
        shape[self._axes[layer]] = count
        return shape

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in :meth:`start_load_kv` (the engine calls this inside the forward, just before the
        layer's attention: a connector that lands layers one by one can let the first layers compute early)."""

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        """A file spans all layers of its group, so saving happens in :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        for request_id, files in self._metadata.saves.items():
            if request_id in self._failed:  # its KV of this step saw an incomplete context
                continue
            for file in files:
                if not os.path.exists(file.path):
                    self._save(file)

    def _save(self, file: BlockFile) -> None:
        blocks = [
            self._caches[layer].index_select(
                self._axes[layer], torch.tensor(file.blocks, device=self._caches[layer].device)
            )
            for layer in self.groups[file.group].layer_names
        ]
        path = Path(file.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, partial = tempfile.mkstemp(dir=path.parent, suffix=".partial")
        with os.fdopen(descriptor, "wb") as out:
            torch.save(torch.stack(blocks).cpu(), out)
        os.replace(partial, path)  # readers, in this process or another, never see half a file

    def get_finished(self, finished_request_ids: set[str]) -> ConnectorOutput:
        failed, self._failed = self._failed, set()
        return ConnectorOutput(failed_loads=frozenset(failed))
