"""Builds the flat batch of one step, runs the model and samples.

The batch lays the scheduled tokens of every request end to end. For each
KV-cache group it also builds the block table and each new token's cache slot
(as the group's spec lays them out), then asks the attention backend for its
metadata once for each group the backend owns; every layer reuses it. Groups a
model manages itself (compressed entries, recurrent state, rings) get no backend
metadata: the model reads their :class:`AttentionBatch` from the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from weft.contracts.attention import AttentionBackend, AttentionBatch
from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.layers.attention import ForwardContext
from weft.runner.sampler import SampledToken, Sampler

if TYPE_CHECKING:
    from weft.engine.kv_cache_manager import KVCacheManager
    from weft.engine.scheduler import SchedulerOutput


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

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> list[SampledToken | None]:
        """Run one step; returns the sampled token of each scheduled request (None: mid-prefill)."""
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
        sampled = self.sampler(logits.cpu(), [step.scheduled[i].request for i in sampling])
        for i, token in zip(sampling, sampled):
            results[i] = token
        return results
