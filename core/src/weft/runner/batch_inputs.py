"""Builds a step's flat batch: token ids, positions and the forward context of the scheduled requests.

The batch lays the scheduled tokens of every request end to end. For each
KV-cache group it also builds the block table and each new token's cache slot
(as the group's spec lays them out), then asks the attention backend for its
metadata once for each group the backend owns; every layer reuses it. Groups a
model manages itself (compressed entries, recurrent state, rings) get no backend
metadata: the model reads their :class:`AttentionBatch` from the context.

A request's last token may still be on the device (sampled by the step before, its copy to the host not
waited for): :func:`known_tokens` leaves a 0 in its place, which the caller's ``fill_unknown`` overwrites from
the device (:meth:`weft.runner.forward.BatchForward.prepare_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from weft.contracts.attention import AttentionBackend, AttentionBatch
from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.layers.attention import ForwardContext
from weft.runner.logits_processors import to_device
from weft.runner.request_state import RequestState

if TYPE_CHECKING:
    from weft.contracts.kv_connector import SparseEntryReader
    from weft.runner.encoder import EncoderRunner
    from weft.runner.kv_connector import WorkerConnector

FillUnknown = Callable[[torch.Tensor, list[RequestState], list[int]], None]
"""Copies the tokens still on the device into a batch's flat token ids (``input_ids, states, counts``)."""


class InputBuilder:
    """A worker's batch builder: the KV-cache groups, caches and attention backend every step's context names."""

    def __init__(
        self,
        backend: AttentionBackend,
        groups: Sequence[KVCacheGroupSpec],
        kv_caches: dict[str, torch.Tensor],
        device: torch.device,
        sparse_entries: SparseEntryReader | None,
        connector: WorkerConnector | None,
    ) -> None:
        self.backend = backend
        self.groups = tuple(groups)
        self.kv_caches = kv_caches
        self.device = device
        self.sparse_entries = sparse_entries
        self.connector = connector
        self.encoder: EncoderRunner | None = None
        """The worker's image encoder outputs (:mod:`weft.runner.encoder`): each step's context then carries the
        rows, positions and extras its images give (``ForwardContext.multimodal``); None: the model reads text."""

    def build(
        self, states: list[RequestState], counts: list[int], fill_unknown: FillUnknown
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int]]:
        """Token ids, positions and the forward context of ``states`` (``counts`` tokens each); and where
        each request's tokens start in the flat batch."""
        positions: list[int] = []
        query_start = [0]
        seq_lens = []
        for state, count in zip(states, counts, strict=False):
            start = state.num_computed_tokens
            positions.extend(range(start, start + count))
            query_start.append(query_start[-1] + count)
            seq_lens.append(start + count)
        device = self.device
        input_ids = to_device(known_tokens(states, counts), torch.long, self.device)
        fill_unknown(input_ids, states, counts)
        position_tensor = to_device(positions, torch.long, self.device)
        query_start_tensor = to_device(query_start, torch.int32, self.device)
        seq_lens_tensor = to_device(seq_lens, torch.int32, self.device)
        rows = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), query_start_tensor.diff().long())
        metadata, batches = [], []
        for index, group in enumerate(self.groups):
            tables = [state.block_ids[index] for state in states]
            width = max(len(table) for table in tables)
            block_table = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32)
            block_table = block_table.to(device, non_blocking=True)
            slot_mapping = group.spec.slot_mapping(block_table, rows, position_tensor)
            batch = AttentionBatch(
                query_start=query_start_tensor,
                seq_lens=seq_lens_tensor,
                block_table=block_table,
                slot_mapping=slot_mapping.to(torch.int32),
                max_query_len=max(counts),
                max_seq_len=max(seq_lens),
                block_size=group.spec.block_size,
            )
            batches.append(batch)
            metadata.append(self.backend.build_metadata(batch) if group.spec.paged_attention else None)
        prefix_hits = [state.take_prefix_hit() for state in states]
        context = ForwardContext(
            backend=self.backend,
            metadata=metadata,
            kv_caches=self.kv_caches,
            batches=batches,
            prefix_hits=prefix_hits,
            request_ids=[state.request_id for state in states],
            sparse_entries=self.sparse_entries,
            wait_for_layer=self.connector.layer_wait if self.connector is not None else None,
            multimodal=self.encoder.batch(states, counts, query_start) if self.encoder is not None else None,
        )
        return input_ids, position_tensor, context, query_start


def known_only(input_ids: torch.Tensor, states: list[RequestState], counts: list[int]) -> None:
    """The :data:`FillUnknown` of a batch whose tokens are all on the host (a speculator's catch-up forward):
    nothing to copy in."""


def known_tokens(states: list[RequestState], counts: list[int]) -> list[int]:
    """The next ``counts`` token ids of each of ``states``, end to end; 0 for a token still on the device (the last
    step's, which :meth:`weft.runner.step_handles.PendingStep.fill_unknown` copies in)."""
    token_ids: list[int] = []
    for state, count in zip(states, counts, strict=False):
        start = state.num_computed_tokens
        known = state.token_ids[start : start + count]
        token_ids.extend(known)
        token_ids.extend([0] * (count - len(known)))
    return token_ids
