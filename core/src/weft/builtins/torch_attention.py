"""The "torch" attention backend: paged KV cache and attention in plain torch.

Per step, :meth:`TorchAttention.build_metadata` turns block tables into flat
cache-slot indices once. Each layer then writes the new keys and values, and
attends in two shapes: all single-token decodes together, padded to the
longest context, and each prefill chunk on its own. Both go through
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


class TorchAttentionMetadata(msgspec.Struct):
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None
    """Query rows of the decoding requests, ``[D]``."""
    decode_blocks: torch.Tensor | None
    """Cache blocks of each decoding request, padded with block 0, ``[D, max_blocks]``."""
    decode_bias: dict[int | None, torch.Tensor]
    """Additive mask (0 or -inf) over the gathered key positions of each decoding query,
    ``[D, 1, 1, max_blocks * block_size]``, per sliding window (None: no window)."""
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    """Per prefill chunk: first query row, rows, its cache blocks, and its causal mask
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
        decode_requests, prefills = [], []
        for index, seq_len in enumerate(seq_lens):
            rows = query_start[index + 1] - query_start[index]
            if rows == 1:
                decode_requests.append(index)
                continue
            blocks = batch.block_table[index, : -(-seq_len // block_size)].long()
            key_positions = torch.arange(blocks.numel() * block_size, device=device).unsqueeze(0)
            query_positions = torch.arange(seq_len - rows, seq_len, device=device).unsqueeze(1)
            prefills.append((query_start[index], rows, blocks, key_positions - query_positions))
        decode_rows = decode_blocks = None
        decode_bias: dict[int | None, torch.Tensor] = {}
        if decode_requests:
            chosen = torch.tensor(decode_requests, device=device)
            lengths = batch.seq_lens[chosen].long()
            width = -(-int(lengths.max()) // block_size)
            decode_blocks = batch.block_table[chosen, :width].long()
            positions = torch.arange(width * block_size, device=device).unsqueeze(0)
            visible = positions < lengths.unsqueeze(1)
            for window in (None, *self.windows):
                seen = visible if window is None else visible & (positions > (lengths - 1 - window).unsqueeze(1))
                bias = torch.zeros(seen.shape, dtype=self.dtype, device=device).masked_fill_(~seen, float("-inf"))
                decode_bias[window] = bias[:, None, None, :]
            decode_rows = batch.query_start[chosen].long()
        return TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping.long(),
            decode_rows=decode_rows,
            decode_blocks=decode_blocks,
            decode_bias=decode_bias,
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

        if metadata.decode_rows is not None:
            count, width = metadata.decode_blocks.shape
            flat = metadata.decode_blocks.reshape(-1)
            gathered = (count, width * block_size, heads, dim)
            keys = _gather(key_blocks, flat, query.dtype).view(gathered).transpose(1, 2)
            values = _gather(value_blocks, flat, query.dtype).view(gathered).transpose(1, 2)
            # The query heads sharing a KV head attend as rows of one head: no K/V repetition.
            group = layer.num_heads // heads
            queries = query.index_select(0, metadata.decode_rows).view(count, heads, group, dim)
            if sinks is not None:
                attended = _attend_with_sinks(
                    layer,
                    queries.reshape(count, layer.num_heads, 1, dim),
                    keys,
                    values,
                    metadata.decode_bias[layer.sliding_window],
                    sinks,
                )
            else:
                attended = _attend(layer, queries, keys, values, metadata.decode_bias[layer.sliding_window])
            output.index_copy_(0, metadata.decode_rows, attended.reshape(count, layer.num_heads, dim))

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
