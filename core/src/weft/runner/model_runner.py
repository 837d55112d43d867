"""Builds the flat batch of one step, runs the model and samples.

The batch lays the scheduled tokens of every request end to end. For each
KV-cache group it also builds the block table and each new token's cache slot
(as the group's spec lays them out), then asks the attention backend for its
metadata once for each group the backend owns; every layer reuses it. Groups a
model manages itself (compressed entries, recurrent state, rings) get no backend
metadata: the model reads their :class:`AttentionBatch` from the context.

Decode steps can replay captured graphs (:meth:`ModelRunner.capture_graphs`).
A graph is captured per batch size over static input buffers; a step of ``n``
decodes replays the smallest captured size ``>= n``, its extra rows padded as
one-token requests whose key and value go to a scratch block no request owns.
Steps with a prefill chunk, or more decodes than the largest size, run eagerly.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from weft.contracts.attention import AttentionBackend, AttentionBatch
from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.layers.attention import ForwardContext
from weft.runner.sampler import SampledToken, Sampler

if TYPE_CHECKING:
    from weft.contracts.platform import Platform
    from weft.engine.kv_cache_manager import KVCacheManager
    from weft.engine.scheduler import SchedulerOutput

logger = logging.getLogger("weft.runner")


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (and ``max_num_seqs`` itself)."""
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    return sorted(set(sizes) | {max_num_seqs})


class StaticInputs:
    """Device buffers a captured graph reads; each step's decode inputs are copied into them."""

    def __init__(self, size: int, widths: Sequence[int], device: torch.device) -> None:
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.query_start = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = [torch.zeros(size, width, dtype=torch.int32, device=device) for width in widths]
        self.slot_mappings = [torch.zeros(size, dtype=torch.int32, device=device) for _ in widths]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        groups: Sequence[KVCacheGroupSpec],
        kv_caches: dict[str, torch.Tensor],
        kv_cache_manager: KVCacheManager,
        device: torch.device,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.backend = backend
        self.groups = tuple(groups)
        self.kv_caches = kv_caches
        self.kv_cache_manager = kv_cache_manager
        self.device = device
        self.sampler = sampler
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.static: StaticInputs | None = None
        self.scratch_blocks: list[int] = []
        self.max_model_len = 0

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> list[SampledToken | None]:
        """Run one step; returns the sampled token of each scheduled request (None: mid-prefill)."""
        count = len(step.scheduled)
        if self.graphs and step.num_tokens == count:
            size = self._graph_size(count)
            if size is not None:
                logits = self._replay(step, size)
                return list(self.sampler(logits, [item.request for item in step.scheduled]))
        return self._execute_eager(step)

    def _execute_eager(self, step: SchedulerOutput) -> list[SampledToken | None]:
        token_ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        seq_lens = []
        for item in step.scheduled:
            start = item.request.num_computed_tokens
            end = start + item.num_new_tokens
            token_ids.extend(item.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            query_start.append(len(token_ids))
            seq_lens.append(end)
        device = self.device
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        position_tensor = torch.tensor(positions, dtype=torch.long, device=device)
        query_start_tensor = torch.tensor(query_start, dtype=torch.int32, device=device)
        seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        rows = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=device), query_start_tensor.diff().long()
        )
        metadata, batches = [], []
        for index, group in enumerate(self.groups):
            tables = [self.kv_cache_manager.block_ids(item.request.request_id, (index,))[0] for item in step.scheduled]
            width = max(len(table) for table in tables)
            block_table = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
            size = group.spec.block_size
            slot_mapping = group.spec.slot_mapping(block_table, rows, position_tensor)
            batch = AttentionBatch(
                query_start=query_start_tensor,
                seq_lens=seq_lens_tensor,
                block_table=block_table,
                slot_mapping=slot_mapping.to(torch.int32),
                max_query_len=max(b - a for a, b in zip(query_start, query_start[1:])),
                max_seq_len=max(seq_lens),
                block_size=size,
            )
            batches.append(batch)
            metadata.append(self.backend.build_metadata(batch) if group.spec.paged_attention else None)
        context = ForwardContext(backend=self.backend, metadata=metadata, kv_caches=self.kv_caches, batches=batches)
        hidden = self.model(input_ids, position_tensor, context)
        sampling = [i for i, item in enumerate(step.scheduled) if item.samples]
        results: list[SampledToken | None] = [None] * len(step.scheduled)
        if not sampling:
            return results
        last_rows = torch.tensor([query_start[i + 1] - 1 for i in sampling], device=device)
        logits = self.model.compute_logits(hidden[last_rows])
        sampled = self.sampler(logits, [step.scheduled[i].request for i in sampling])
        for i, token in zip(sampling, sampled):
            results[i] = token
        return results

    # Graphs.

    @torch.inference_mode()
    def capture_graphs(self, platform: Platform, sizes: Sequence[int], scratch_blocks: Sequence[int], max_model_len: int) -> float:
        """Capture the decode forward for each batch size (largest first); returns the seconds it took.

        ``scratch_blocks`` holds, per KV-cache group, a block id no request is
        ever given: padded rows write their keys and values there.
        """
        started = time.monotonic()
        self.scratch_blocks = list(scratch_blocks)
        self.max_model_len = max_model_len
        widths = [-(-max_model_len // group.spec.block_size) for group in self.groups]
        self.static = StaticInputs(max(sizes), widths, self.device)
        self._zeros = array("i", [0]) * max(widths)
        self._rows = torch.arange(max(sizes))
        self._fill_padding(0, max(sizes))
        for size in sorted(set(sizes), reverse=True):
            self.graphs[size] = platform.capture_graph(lambda size=size: self._static_forward(size))
        return time.monotonic() - started

    def _graph_size(self, count: int) -> int | None:
        fitting = [size for size in self.graphs if size >= count]
        return min(fitting) if fitting else None

    def _static_forward(self, size: int) -> torch.Tensor:
        """The decode forward over the first ``size`` rows of the static buffers; what a graph captures."""
        static = self.static
        assert static is not None
        metadata, batches = [], []
        for index, group in enumerate(self.groups):
            batch = AttentionBatch(
                query_start=static.query_start[: size + 1],
                seq_lens=static.seq_lens[:size],
                block_table=static.block_tables[index][:size],
                slot_mapping=static.slot_mappings[index][:size],
                max_query_len=1,
                max_seq_len=self.max_model_len,
                block_size=group.spec.block_size,
            )
            batches.append(batch)
            metadata.append(self.backend.build_metadata(batch))
        context = ForwardContext(backend=self.backend, metadata=metadata, kv_caches=self.kv_caches, batches=batches)
        hidden = self.model(static.input_ids[:size], static.positions[:size], context)
        return self.model.compute_logits(hidden)

    def _fill_padding(self, start: int, stop: int) -> None:
        """Make rows ``start:stop`` one-token requests at position 0 that live in the scratch blocks."""
        static = self.static
        assert static is not None
        static.input_ids[start:stop] = 0
        static.positions[start:stop] = 0
        static.seq_lens[start:stop] = 1
        for index, group in enumerate(self.groups):
            static.block_tables[index][start:stop] = self.scratch_blocks[index]
            static.slot_mappings[index][start:stop] = self.scratch_blocks[index] * group.spec.block_size

    def _replay(self, step: SchedulerOutput, size: int) -> torch.Tensor:
        static = self.static
        assert static is not None
        count = len(step.scheduled)
        requests = [item.request for item in step.scheduled]
        positions = [request.num_computed_tokens for request in requests]
        # Staged on the host (a few microseconds of CPU ops), then one copy each: device-side
        # derivations would add kernel launches to every decode step.
        host_positions = torch.tensor(positions)
        static.input_ids[:count].copy_(torch.tensor([r.all_token_ids[p] for r, p in zip(requests, positions)]))
        static.positions[:count].copy_(host_positions)
        static.seq_lens[:count].copy_(host_positions + 1)
        for index, group in enumerate(self.groups):
            tables = [self.kv_cache_manager.block_ids(request.request_id, (index,))[0] for request in requests]
            width = max(len(table) for table in tables)
            rows = array("i")  # the padded tables, flat: filled at C speed, then one copy to the device
            for table in tables:
                rows.extend(table)
                rows.extend(self._zeros[: width - len(table)])
            host_table = torch.frombuffer(rows, dtype=torch.int32).view(count, width)
            static.block_tables[index][:count, :width].copy_(host_table)
            static.slot_mappings[index][:count].copy_(group.spec.slot_mapping(host_table, self._rows[:count], host_positions))
        if count < size:
            self._fill_padding(count, size)
        logits = self.graphs[size]()
        return logits[:count]


def describe_sizes(sizes: Sequence[int]) -> str:
    """``1, 2, 4, 8..256 (35 sizes)`` for logs."""
    ordered = sorted(sizes)
    if len(ordered) <= 6:
        return ", ".join(map(str, ordered))
    return f"{', '.join(map(str, ordered[:4]))}..{ordered[-1]} ({len(ordered)} sizes)"

