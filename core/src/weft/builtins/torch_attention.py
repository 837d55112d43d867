"""The "torch" attention backend: paged KV cache and attention in plain torch.

Per step, :meth:`TorchAttention.build_metadata` turns block tables into flat
cache-slot indices once. Each layer then writes the new keys and values, and
attends in two shapes: every request with a few new tokens (decodes, the
verification rows of speculative decoding, the tail of a prompt after a prefix
hit) together, padded to the longest context and the most new tokens, and each
longer prefill chunk on its own. Both go through
``scaled_dot_product_attention`` with an explicit mask (causal with the
chunk's offset into the context, and the sliding window when the layer has one); a layer
with attention sinks (gpt-oss) or a logits soft cap (Gemma 2) takes the same masks through explicit scores,
since ``scaled_dot_product_attention`` has neither.
Non-finite keys and values are stored as zeros, so one request's NaNs never reach another's attention.
An fp8 cache (``engine.kv_cache_dtype = "fp8"``) stores their float8_e4m3 rounding and is read back in the
query's dtype, block by block as each request gathers its keys.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import torch
import torch.nn.functional as F

from weft.contracts.attention import AttentionBackend, AttentionBatch, AttentionLayer

SHORT_QUERY = 16
"""Requests with at most this many new tokens in a step attend together, in one padded batch."""


class TorchAttentionMetadata(msgspec.Struct):
    slot_mapping: torch.Tensor
    short_rows: torch.Tensor | None
    """``[S, Q]``: the query row of each short request's ``Q`` (the most new tokens among them) query slots; a
    padding slot repeats the request's last row."""
    short_kept: torch.Tensor | None
    """``[S * Q]`` bool: the slots that are real query rows (not padding)."""
    short_blocks: torch.Tensor | None
    """Cache blocks of each short request, padded with block 0, ``[S, max_blocks]``."""
    short_bias: dict[int | None, torch.Tensor]
    """Additive mask (0 or -inf) over the gathered key positions of each short request's query slots,
    ``[S, 1, Q, max_blocks * block_size]``, per sliding window (None: no window). A padding slot sees key 0 only."""
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    """Per longer prefill chunk: first query row, rows, its cache blocks, and its causal mask
    ``[rows, blocks * block_size]``."""


class TorchAttention(AttentionBackend):
    """Paged attention in pure torch: any platform, any head size, sliding windows, soft-capped logits."""

    name: ClassVar[str] = "torch"
    supports_sinks: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    kv_cache_dtypes: ClassVar[frozenset[str]] = frozenset({"float8_e4m3fn"})

    def __init__(self, options: msgspec.Struct | None, platform: Any) -> None:
        super().__init__(options, platform)
        self.windows: set[int] = set()
        self.dtype = torch.float32

    def prepare(self, layers: list[AttentionLayer], dtype: str) -> None:
        super().prepare(layers, dtype)
        self.dtype = getattr(torch, dtype)
        self.windows = {layer.sliding_window for layer in layers if layer.sliding_window is not None}

    def build_metadata(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        query_start = batch.query_start.tolist()
        seq_lens = batch.seq_lens.tolist()
        device = batch.slot_mapping.device
        block_size = batch.block_size
        short_requests, prefills = [], []
        for index, seq_len in enumerate(seq_lens):
            rows = query_start[index + 1] - query_start[index]
            if rows <= SHORT_QUERY:
                short_requests.append(index)
                continue
            blocks = batch.block_table[index, : -(-seq_len // block_size)].long()
            key_positions = torch.arange(blocks.numel() * block_size, device=device).unsqueeze(0)
            query_positions = torch.arange(seq_len - rows, seq_len, device=device).unsqueeze(1)
            prefills.append((query_start[index], rows, blocks, key_positions - query_positions))
        short_rows = short_kept = short_blocks = None
        short_bias: dict[int | None, torch.Tensor] = {}
        if short_requests:
            chosen = torch.tensor(short_requests, device=device)
            lengths = batch.seq_lens[chosen].long()
            starts = batch.query_start[chosen].long()
            counts = batch.query_start[chosen + 1].long() - starts
            most = max(query_start[index + 1] - query_start[index] for index in short_requests)
            width = -(-max(seq_lens[index] for index in short_requests) // block_size)
            short_blocks = batch.block_table[chosen, :width].long()
            slot = torch.arange(most, device=device)
            kept = slot.unsqueeze(0) < counts.unsqueeze(1)  # [S, Q]
            short_rows = starts.unsqueeze(1) + torch.minimum(slot.unsqueeze(0), (counts - 1).unsqueeze(1))
            short_kept = kept.reshape(-1)
            keys = torch.arange(width * block_size, device=device).view(1, 1, -1)
            query_positions = (lengths - counts).unsqueeze(1) + slot.unsqueeze(0)  # [S, Q]
            causal = keys <= query_positions.unsqueeze(2)
            for window in (None, *self.windows):
                seen = causal if window is None else causal & (keys > (query_positions - window).unsqueeze(2))
                seen = torch.where(kept.unsqueeze(2), seen, keys == 0)  # a padding slot: one key, no NaN
                bias = torch.zeros(seen.shape, dtype=self.dtype, device=device).masked_fill_(~seen, float("-inf"))
                short_bias[window] = bias.unsqueeze(1)
        return TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping.long(),
            short_rows=short_rows,
            short_kept=short_kept,
            short_blocks=short_blocks,
            short_bias=short_bias,
            prefills=prefills,
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        heads, dim = layer.num_kv_heads, layer.head_dim
        # Masked positions still enter the products below with weight 0, and 0 * NaN is NaN: a request whose
        # keys or values are not finite (NaN activations) must not leave them where other requests' padded or
        # recycled blocks read. Its own outputs are NaN anyway, and the sampler fails it alone.
        self.store_kv(kv_cache, key.nan_to_num(0.0, 0.0, 0.0), value.nan_to_num(0.0, 0.0, 0.0), metadata.slot_mapping)
        key_blocks, value_blocks = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, dim]
        output = torch.empty_like(query)
        gqa = layer.num_heads != layer.num_kv_heads

        if metadata.short_rows is not None:
            count, width = metadata.short_blocks.shape
            most = metadata.short_rows.shape[1]
            flat = metadata.short_blocks.reshape(-1)
            gathered = (count, width * block_size, heads, dim)
            keys = _gather(key_blocks, flat, query.dtype).view(gathered).transpose(1, 2)
            values = _gather(value_blocks, flat, query.dtype).view(gathered).transpose(1, 2)
            queries = query.index_select(0, metadata.short_rows.reshape(-1)).view(count, most, layer.num_heads, dim)
            bias = metadata.short_bias[layer.sliding_window]  # [S, 1, Q, L]
            group = layer.num_heads // heads
            if sinks is not None:
                attended = _attend_with_sinks(layer, queries.transpose(1, 2), keys, values, bias, sinks)
                attended = attended.transpose(1, 2)  # [S, Q, heads, dim]
            else:
                # The query heads sharing a KV head attend as rows of one head: no K/V repetition.
                grouped = queries.view(count, most, heads, group, dim).permute(0, 2, 3, 1, 4)
                grouped_bias = bias.unsqueeze(2).expand(count, 1, group, most, bias.shape[-1])
                attended = _attend(
                    layer,
                    grouped.reshape(count, heads, group * most, dim),
                    keys,
                    values,
                    grouped_bias.reshape(count, 1, group * most, bias.shape[-1]),
                )
                attended = attended.view(count, heads, group, most, dim).permute(0, 3, 1, 2, 4)
            attended = attended.reshape(count * most, layer.num_heads, dim)
            kept = metadata.short_kept
            output.index_copy_(0, metadata.short_rows.reshape(-1)[kept], attended[kept])

        for start, rows, blocks, offsets in metadata.prefills:
            length = blocks.numel() * block_size
            keys = _gather(key_blocks, blocks, query.dtype).view(1, length, heads, dim).transpose(1, 2)
            values = _gather(value_blocks, blocks, query.dtype).view(1, length, heads, dim).transpose(1, 2)
            queries = query[start : start + rows].transpose(0, 1).unsqueeze(0)  # [1, heads, rows, dim]
            visible = offsets <= 0
            if layer.sliding_window is not None:
                visible = visible & (offsets > -layer.sliding_window)
            if sinks is not None:
                attended = _attend_with_sinks(layer, queries, keys, values, visible, sinks)
            else:
                if gqa and layer.logits_soft_cap is not None:
                    group = layer.num_heads // heads
                    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
                attended = _attend(layer, queries, keys, values, visible, gqa)
            output[start : start + rows] = attended.squeeze(0).transpose(0, 1)
        return output


def _gather(blocks: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache blocks ``indices`` of one half (keys or values) of a layer's cache, in ``dtype``; float8 blocks are
    gathered as their bytes (torch has no float8 ``index_select`` on every device) and then converted."""
    if blocks.dtype != torch.float8_e4m3fn:
        return blocks.index_select(0, indices)
    return blocks.view(torch.uint8).index_select(0, indices).view(torch.float8_e4m3fn).to(dtype)


def _capped(layer: AttentionLayer, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (scaled) under the layer's soft cap, if it has one: ``cap * tanh(score / cap)``."""
    cap = layer.logits_soft_cap
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _masked(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (boolean: visible, or additive) applied to ``scores``."""
    return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask


def _attend(
    layer: AttentionLayer,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gqa: bool = False,
) -> torch.Tensor:
    """Softmax attention under ``mask`` (boolean: visible, or additive); with the layer's soft cap when it has one,
    as Hugging Face's eager attention computes it (capped scores, the mask added, softmax in float32)."""
    if layer.logits_soft_cap is None:
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=layer.scale, enable_gqa=gqa)
    scores = _masked(_capped(layer, queries @ keys.transpose(-1, -2) * layer.scale), mask)
    return scores.softmax(-1, dtype=torch.float32).to(values.dtype) @ values


def _attend_with_sinks(
    layer: AttentionLayer,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention of ``queries`` ``[B, heads, rows, dim]`` over ``keys``/``values`` ``[B, kv_heads, L, dim]`` under
    ``mask`` (boolean: visible, or additive) with each head's sink logit as one more softmax term that has no
    value, as Hugging Face's gpt-oss computes it (softmax in float32)."""
    group = queries.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = _masked(_capped(layer, (queries @ keys.transpose(-1, -2)).float() * layer.scale), mask)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probabilities = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probabilities.to(values.dtype) @ values
