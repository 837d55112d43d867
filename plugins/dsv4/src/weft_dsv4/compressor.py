"""The compressor of CSA and HCA layers (and of the indexer): pools every ``m`` tokens into one entry,
keeping the incomplete window (and CSA's overlap half-window) as recurrent state between steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from weft.api import Linear
from weft_dsv4.norm import RMSNorm
from weft_dsv4.rope import InterleavedRope, apply_rope

if TYPE_CHECKING:
    from weft_dsv4.step import DecodeBatch, PrefillBatch

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn."""


class EntryFormat:
    """How a compressor's entries sit in their cache: as they are, rounded to the cache's dtype."""

    def row_width(self, dim: int) -> int:
        """Cache elements one entry of ``dim`` takes."""
        return dim

    def cache_dtype(self, dtype: str) -> str:
        return dtype

    def encode(self, entries: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        """Cache rows ``[..., row_width]`` of ``entries`` ``[..., dim]``."""
        return entries.to(cache_dtype)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """The entries cache rows ``rows`` ``[..., row_width]`` hold (their dtype: the cache's or float32)."""
        return rows


class Fp8EntryFormat(EntryFormat):
    """float8_e4m3fn with one float32 scale per entry (its largest magnitude / 448), as DeepSeek stores the
    indexer's keys: ``dim`` bytes then the scale's 4 in a uint8 cache; read back as float32. Halves a bf16
    cache's bytes (plus 4 per entry); an entry of zeros stays zeros."""

    def row_width(self, dim: int) -> int:
        return dim + 4

    def cache_dtype(self, dtype: str) -> str:
        return "uint8"

    def encode(self, entries: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        values = entries.float()
        largest = values.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(largest > 0, largest / FP8_MAX, torch.ones_like(largest))
        quantized = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch.cat([quantized.view(torch.uint8), scale.view(torch.uint8)], dim=-1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        dim = rows.shape[-1] - 4
        scale = rows[..., dim:].contiguous().view(torch.float32)
        return rows[..., :dim].view(torch.float8_e4m3fn).float() * scale  # a same-size view: no copy


class Compressor(nn.Module):
    """Pools ``ratio`` tokens into one entry: per-channel softmax of ``gate + position_bias`` over the
    window's tokens weighting ``kv``, then RMSNorm and RoPE at the window's first position.

    With ``overlap`` (CSA) projections are ``2 * dim`` wide: entry ``w`` pools the first half of the
    tokens of window ``w - 1`` together with the second half of the tokens of window ``w``.
    """

    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, eps: float, lookahead: int = 0) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap, self.width = dim, ratio, overlap, width
        self.lookahead = lookahead
        """Positions a step may compute past the verified ones (``ModelConfig.num_lookahead_tokens``): the ring keeps
        this many more, so that rejected proposals never overwrite a position the next window still pools."""
        self.kv_proj = Linear(hidden_size, width, bias=False)
        self.gate_proj = Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)
        self.format = EntryFormat()
        """How the entries sit in the cache (the indexer's keys may be float8: ``indexer_key_dtype``)."""

    @property
    def span(self) -> int:
        """Positions of source tokens an entry pools from the state ring."""
        return 2 * self.ratio if self.overlap else self.ratio

    @property
    def ring_length(self) -> int:
        """Positions the state ring keeps (slot ``position % ring_length``): ``span``, and ``lookahead`` more."""
        return self.span + self.lookahead

    def state_elements(self) -> int:
        return self.ring_length * 2 * self.width

    def project(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv`` (activation dtype) and ``gate + position_bias`` (fp32) of each token."""
        return self.kv_proj(hidden), self.gate_proj(hidden) + self.position_bias[positions % self.ratio]

    def prefill(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        batch: PrefillBatch,
        state: torch.Tensor,
        cache: torch.Tensor,
        tables: torch.Tensor,
        rope: InterleavedRope,
        snapshots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Add every prefilling request's tokens (their projections ``kv``, ``gate`` by step row) to its windows,
        store the entries they complete in ``cache`` (the requests' blocks ``tables`` ``[requests, blocks]``) and
        return every request's entries ``[requests, longest, dim]`` (padded past each request's count) as the
        cache holds them (``format``: rounded to its dtype, or float8 read back).

        ``state`` is the layer's state columns of this compressor, ``[blocks, ring_length * 2 * width]``: each
        request's fp32 ring (kv | gate per position, slot ``position % ring_length``), updated in place.
        ``snapshots`` (the same columns of the snapshot group) receive the state as it stood after each boundary a
        request crosses.
        """
        m, span, width, device = self.ratio, self.span, self.width, kv.device
        length = self.ring_length
        ring = state.view(state.shape[0], length, 2 * width)
        new = torch.cat([kv.float(), gate], dim=-1)

        def source(request: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            """Position ``position`` of request ``request`` (index tensors of one shape): the step's row or the ring."""
            start = batch.starts[request]
            row = (batch.row_starts[request] + position - start).clamp(0, new.shape[0] - 1)
            old = ring[batch.state_blocks[request], position.clamp(min=0) % length]
            return torch.where((position >= start)[..., None], new[row], old)

        if snapshots is not None and batch.boundary_requests.numel():
            positions = batch.boundaries[:, None] - span + torch.arange(span, device=device)
            taken = positions >= 0
            requests = batch.boundary_requests[:, None].expand_as(positions)[taken]
            blocks = batch.boundary_snapshot_blocks[:, None].expand_as(positions)[taken]
            target = snapshots.view(snapshots.shape[0], length, 2 * width)
            target[blocks, positions[taken] % length] = source(requests, positions[taken])
        # Entries first .. last - 1 of each request, where first = start // m and last = end // m.
        firsts, lasts = batch.starts // m, batch.ends // m
        counts = lasts - firsts
        requests = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
        windows = (
            firsts[requests]
            + torch.arange(requests.numel(), device=device)
            - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        )
        if requests.numel():
            slots = 2 * m if self.overlap else m
            positions = (windows[:, None] - (1 if self.overlap else 0)) * m + torch.arange(slots, device=device)
            entries = self.windows_to_entries(
                source(requests[:, None].expand_as(positions), positions), windows, kv.dtype, rope
            )
            per_block = cache.shape[1]
            slots_of = (
                tables[requests].gather(1, (windows // per_block)[:, None])[:, 0] * per_block + windows % per_block
            )
            cache.view(-1, cache.shape[-1])[slots_of] = self.format.encode(entries, cache.dtype)
        # The ring keeps each request's last ring_length positions.
        kept = batch.ends[:, None] - length + torch.arange(length, device=device)
        kept_mask = kept >= torch.maximum(batch.starts, batch.ends - length)[:, None]
        kept_requests = torch.arange(kept.shape[0], device=device)[:, None].expand_as(kept)[kept_mask]
        kept_positions = kept[kept_mask]
        values = new[batch.row_starts[kept_requests] + kept_positions - batch.starts[kept_requests]]
        ring[batch.state_blocks[kept_requests], kept_positions % length] = values
        per_block = cache.shape[1]
        index = torch.arange(int(lasts.max()), device=device).expand(lasts.numel(), -1)
        flat = cache.view(-1, cache.shape[-1])
        return self.format.decode(flat[tables.gather(1, index // per_block) * per_block + index % per_block])

    def decode_step(
        self,
        hidden: torch.Tensor,
        batch: DecodeBatch,
        state: torch.Tensor,
        cache: torch.Tensor,
        table: torch.Tensor,
        rope: InterleavedRope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token for each decoding request: record it in the state ring, pool and store the
        entries of the windows it completes, and return the slots of every request's entries in the
        flat ``cache`` (``[slots, dim]``) ``[rows, n]`` (padded to the longest) with their validity ``[rows, n]``.

        ``state`` is the layer's state columns of this compressor, ``[blocks, ring_length * 2 * width]``.
        """
        m, length, width = self.ratio, self.ring_length, self.width
        positions = batch.positions
        kv, gate = self.project(hidden, positions)
        ring = state.view(state.shape[0], length, 2 * width)
        ring[batch.state_blocks, positions % length] = torch.cat([kv.float(), gate], dim=-1)
        per_block = cache.shape[1]
        flat = cache.view(-1, cache.shape[-1])
        rows = batch.completing(m)
        if rows is not None:
            window = ((positions[rows] + 1) // m - 1).clamp(min=0)
            width_tokens = 2 * m if self.overlap else m
            source = (window[:, None] - (1 if self.overlap else 0)) * m + torch.arange(width_tokens, device=kv.device)
            entries = self.windows_to_entries(
                ring[batch.state_blocks[rows][:, None], source.clamp(min=0) % length], window, kv.dtype, rope
            )
            slots = table[rows].gather(1, (window // per_block)[:, None])[:, 0] * per_block + window % per_block
            flat[batch.or_scratch(rows, m, slots, (cache.shape[0] - 1) * per_block)] = self.format.encode(
                entries, cache.dtype
            )
        counts = (positions + 1) // m
        if batch.full_width:
            longest = table.shape[1] * per_block  # every entry the table can address (as a decode graph reads)
        else:
            longest = max((position + 1) // m for position in batch.position_list)
        index = torch.arange(longest, device=kv.device).expand(positions.shape[0], -1)
        return table.gather(1, index // per_block) * per_block + index % per_block, index < counts[:, None]

    def windows_to_entries(
        self, sources: torch.Tensor, windows: torch.Tensor, dtype: torch.dtype, rope: InterleavedRope
    ) -> torch.Tensor:
        """Entries ``windows`` ``[count]`` from the fp32 (kv | gate) of their source positions
        ``[count, slots, 2 * width]`` (``m`` positions, or ``2m`` from the window before with overlap), at their first
        position's RoPE."""
        m, width = self.ratio, self.width
        source_kv, source_gate = sources[..., :width].to(dtype), sources[..., width:]
        if self.overlap:
            d = self.dim
            source_kv = torch.cat([source_kv[:, :m, :d], source_kv[:, m:, d:]], dim=1)
            source_gate = torch.cat([source_gate[:, :m, :d], source_gate[:, m:, d:]], dim=1)
            # Entry 0 has no window before it: its a-half is kv 0 with weight 0.
            missing = (windows == 0)[:, None, None] & (torch.arange(2 * m, device=sources.device) < m)[None, :, None]
            source_kv = source_kv.masked_fill(missing, 0.0)
            source_gate = source_gate.masked_fill(missing, float("-inf"))
        entries = self.pool_windows(source_kv, source_gate)
        return apply_rope(entries, *rope.table(windows * m, entries.dtype))

    def pool_windows(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``[count, slots, dim]`` windows to entries: softmax over the slots per channel (fp32), weighted sum, norm."""
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return self.kv_norm((kv * weights).sum(dim=1))
