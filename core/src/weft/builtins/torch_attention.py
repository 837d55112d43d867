"""The "torch" attention backend: paged KV cache and attention in plain torch.

Per step, :meth:`TorchAttention.build_metadata` turns block tables into flat
cache-slot indices once. Each layer then writes the new keys and values, and
attends in two shapes: all single-token decodes together, padded to the
longest context, and each prefill chunk on its own. Both go through
``scaled_dot_product_attention`` with an explicit mask (causal with the
chunk's offset into the context, and the sliding window when the layer has one).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
import torch
import torch.nn.functional as F

from weft.contracts.attention import AttentionBackend, AttentionBatch, AttentionLayer


class TorchAttentionMetadata(msgspec.Struct):
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None
    """Query rows of the decoding requests, ``[D]``."""
    decode_slots: torch.Tensor | None
    """Cache slots of each decoding request's context, padded, ``[D, Lmax]``."""
    decode_positions: torch.Tensor | None
    """Position of each slot in ``decode_slots`` (``-1`` for padding), ``[D, Lmax]``."""
    decode_query_positions: torch.Tensor | None
    """Position of each decoding query, ``[D]``."""
    prefills: list[tuple[int, int, torch.Tensor, int]]
    """Per prefill chunk: first query row, rows, cache slots of its context, context length."""


class TorchAttention(AttentionBackend):
    """Paged attention in pure torch: any platform, any head size, sliding windows."""

    name: ClassVar[str] = "torch"

    def build_metadata(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        query_start = batch.query_start.tolist()
        seq_lens = batch.seq_lens.tolist()
        device = batch.slot_mapping.device
        block_size = batch.block_size
        decode_requests, prefills = [], []
        for index, seq_len in enumerate(seq_lens):
            rows = query_start[index + 1] - query_start[index]
            if rows == 1:
                decode_requests.append(index)
            else:
                slots = self._context_slots(batch.block_table[index], seq_len, block_size, device)
                prefills.append((query_start[index], rows, slots, seq_len))
        decode_rows = decode_slots = decode_positions = decode_query_positions = None
        if decode_requests:
            chosen = torch.tensor(decode_requests, device=device)
            lengths = batch.seq_lens[chosen].long()
            longest = int(lengths.max())
            positions = torch.arange(longest, device=device)
            tables = batch.block_table[chosen].long()
            blocks = tables.gather(1, (positions // block_size).expand(len(decode_requests), -1).clamp(max=tables.shape[1] - 1))
            valid = positions.unsqueeze(0) < lengths.unsqueeze(1)
            decode_slots = torch.where(valid, blocks * block_size + positions % block_size, 0)
            decode_positions = torch.where(valid, positions.unsqueeze(0), -1)
            decode_rows = batch.query_start[chosen].long()
            decode_query_positions = lengths - 1
        return TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping.long(),
            decode_rows=decode_rows,
            decode_slots=decode_slots,
            decode_positions=decode_positions,
            decode_query_positions=decode_query_positions,
            prefills=prefills,
        )

    @staticmethod
    def _context_slots(table: torch.Tensor, seq_len: int, block_size: int, device: torch.device) -> torch.Tensor:
        positions = torch.arange(seq_len, device=device)
        return table.long()[positions // block_size] * block_size + positions % block_size

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        key_cache = kv_cache[0].view(-1, layer.num_kv_heads, layer.head_dim)
        value_cache = kv_cache[1].view(-1, layer.num_kv_heads, layer.head_dim)
        key_cache.index_copy_(0, metadata.slot_mapping, key)
        value_cache.index_copy_(0, metadata.slot_mapping, value)
        output = torch.empty_like(query)
        gqa = layer.num_heads != layer.num_kv_heads

        if metadata.decode_rows is not None:
            keys = key_cache[metadata.decode_slots].transpose(1, 2)  # [D, kv_heads, L, dim]
            values = value_cache[metadata.decode_slots].transpose(1, 2)
            queries = query[metadata.decode_rows].unsqueeze(2)  # [D, heads, 1, dim]
            visible = metadata.decode_positions >= 0
            if layer.sliding_window is not None:
                visible &= metadata.decode_positions > (metadata.decode_query_positions - layer.sliding_window).unsqueeze(1)
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=visible[:, None, None, :], scale=layer.scale, enable_gqa=gqa
            )
            output[metadata.decode_rows] = attended.squeeze(2)

        for start, rows, slots, seq_len in metadata.prefills:
            keys = key_cache[slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, L, dim]
            values = value_cache[slots].transpose(0, 1).unsqueeze(0)
            queries = query[start : start + rows].transpose(0, 1).unsqueeze(0)  # [1, heads, rows, dim]
            query_positions = torch.arange(seq_len - rows, seq_len, device=query.device).unsqueeze(1)
            key_positions = torch.arange(seq_len, device=query.device).unsqueeze(0)
            visible = key_positions <= query_positions
            if layer.sliding_window is not None:
                visible &= key_positions > query_positions - layer.sliding_window
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=visible, scale=layer.scale, enable_gqa=gqa
            )
            output[start : start + rows] = attended.squeeze(0).transpose(0, 1)
        return output
