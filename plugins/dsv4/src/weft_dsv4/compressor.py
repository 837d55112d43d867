"""The compressor of CSA and HCA layers (and of the indexer): pools every ``m`` tokens into one entry,
keeping the incomplete window (and CSA's overlap half-window) as recurrent state between steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from weft.layers.linear import Linear
from weft_dsv4.norm import RMSNorm
from weft_dsv4.rope import InterleavedRope, apply_rope

if TYPE_CHECKING:
    from weft_dsv4.step import DecodeBatch

class Compressor(nn.Module):
    """Pools ``ratio`` tokens into one entry: per-channel softmax of ``gate + position_bias`` over the
    window's tokens weighting ``kv``, then RMSNorm and RoPE at the window's first position.

    With ``overlap`` (CSA) projections are ``2 * dim`` wide: entry ``w`` pools the first half of the
    tokens of window ``w - 1`` together with the second half of the tokens of window ``w``.
    """

    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap, self.width = dim, ratio, overlap, width
        self.kv_proj = Linear(hidden_size, width, bias=False)
        self.gate_proj = Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)

    @property
    def span(self) -> int:
        """Positions of source tokens kept in the state ring."""
        return 2 * self.ratio if self.overlap else self.ratio

    def state_elements(self) -> int:
        return self.span * 2 * self.width

    def project(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv`` (activation dtype) and ``gate + position_bias`` (fp32) of each token."""
        return self.kv_proj(hidden), self.gate_proj(hidden) + self.position_bias[positions % self.ratio]

    def step(
        self, kv: torch.Tensor, gate: torch.Tensor, start: int, state: torch.Tensor, rope: InterleavedRope,
        snapshots: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> tuple[int, torch.Tensor]:
        """Add tokens ``start .. start + n - 1`` (their projections) to one request's windows.

        ``state`` is the request's fp32 ring ``[span, 2 * width]`` (kv | gate per position, slot
        ``position % span``), updated in place. Each ``(boundary, ring)`` of ``snapshots`` receives
        the state as it stood after token ``boundary - 1`` (a prefix-cache checkpoint). Returns the
        index of the first entry completed and the completed entries ``[count, dim]`` (possibly none).
        """
        m, n, end = self.ratio, kv.shape[0], start + kv.shape[0]
        for boundary, ring in snapshots:
            positions = torch.arange(max(boundary - self.span, 0), boundary, device=kv.device)
            new = torch.cat([kv.float(), gate], dim=-1)[(positions - start).clamp(min=0)]
            old = state[positions.clamp(max=max(start - 1, 0)) % self.span]
            ring[positions % self.span] = torch.where((positions >= start)[:, None], new, old)
        first, last = start // m, end // m
        entries = kv.new_zeros((0, self.dim))
        if last > first:
            base = max(first - 1, 0) * m if self.overlap else first * m
            old = torch.arange(base, start, device=kv.device)
            source_kv = torch.cat([state[old % self.span, : self.width].to(kv.dtype), kv[: last * m - start]])
            source_gate = torch.cat([state[old % self.span, self.width :], gate[: last * m - start]])
            entries = self._pool(source_kv, source_gate, first, last)
            positions = torch.arange(first, last, device=kv.device) * m
            entries = apply_rope(entries, *rope.table(positions, entries.dtype))
        keep = min(n, self.span)
        slots = torch.arange(end - keep, end, device=kv.device) % self.span
        state[slots] = torch.cat([kv[n - keep :].float(), gate[n - keep :]], dim=-1)
        return first, entries

    def decode_step(
        self, hidden: torch.Tensor, batch: DecodeBatch, state: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
        rope: InterleavedRope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token for each decoding request: record it in the state ring, pool and store the
        entries of the windows it completes, and return every request's entries ``[rows, n, dim]``
        (padded to the longest) with their validity ``[rows, n]``.

        ``state`` is the layer's state columns of this compressor, ``[blocks, span * 2 * width]``.
        """
        m, span, width = self.ratio, self.span, self.width
        positions = batch.positions
        kv, gate = self.project(hidden, positions)
        ring = state.view(state.shape[0], span, 2 * width)
        ring[batch.state_blocks, positions % span] = torch.cat([kv.float(), gate], dim=-1)
        per_block = cache.shape[1]
        flat = cache.view(-1, cache.shape[-1])
        complete = [row for row, position in enumerate(batch.position_list) if (position + 1) % m == 0]
        if complete:
            rows = torch.tensor(complete, device=kv.device)
            window = (positions[rows] + 1) // m - 1
            width_tokens = 2 * m if self.overlap else m
            source = (window[:, None] - (1 if self.overlap else 0)) * m + torch.arange(width_tokens, device=kv.device)
            gathered = ring[batch.state_blocks[rows][:, None], source % span]
            source_kv, source_gate = gathered[..., :width].to(kv.dtype), gathered[..., width:]
            if self.overlap:
                d = self.dim
                source_kv = torch.cat([source_kv[:, :m, :d], source_kv[:, m:, d:]], dim=1)
                source_gate = torch.cat([source_gate[:, :m, :d], source_gate[:, m:, d:]], dim=1)
                # Entry 0 has no window before it: its a-half is kv 0 with weight 0.
                missing = (window == 0)[:, None, None] & (torch.arange(2 * m, device=kv.device) < m)[None, :, None]
                source_kv = source_kv.masked_fill(missing, 0.0)
                source_gate = source_gate.masked_fill(missing, float("-inf"))
            entries = self.pool_windows(source_kv, source_gate)
            entries = apply_rope(entries, *rope.table(window * m, entries.dtype))
            slots = table[rows].gather(1, (window // per_block)[:, None])[:, 0] * per_block + window % per_block
            flat[slots] = entries.to(cache.dtype)
        counts = (positions + 1) // m
        longest = max((position + 1) // m for position in batch.position_list)
        index = torch.arange(longest, device=kv.device).expand(len(batch.position_list), -1)
        entries = flat[table.gather(1, index // per_block) * per_block + index % per_block]
        return entries, index < counts[:, None]

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """Entries ``first .. last - 1`` from the consecutive source tokens of their windows."""
        m, d, count = self.ratio, self.dim, last - first
        if not self.overlap:
            kv, gate = kv.view(count, m, d), gate.view(count, m, d)
        else:
            # [count, 2m, d]: half a of the window before, half b of the window itself.
            if first == 0:
                kv = torch.cat([kv.new_zeros((m, 2 * d)), kv])
                gate = torch.cat([gate.new_full((m, 2 * d), float("-inf")), gate])
            windows_kv = kv.view(count + 1, m, 2 * d)
            windows_gate = gate.view(count + 1, m, 2 * d)
            kv = torch.cat([windows_kv[:-1, :, :d], windows_kv[1:, :, d:]], dim=1)
            gate = torch.cat([windows_gate[:-1, :, :d], windows_gate[1:, :, d:]], dim=1)
        return self.pool_windows(kv, gate)

    def pool_windows(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``[count, slots, dim]`` windows to entries: softmax over the slots per channel (fp32), weighted sum, norm."""
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return self.kv_norm((kv * weights).sum(dim=1))


def write_and_read_entries(cache: torch.Tensor, table: torch.Tensor, first: int, new: torch.Tensor, count: int, ratio: int) -> torch.Tensor:
    """Store entries ``first ..`` of one request into its compressed-group blocks; return entries ``0 .. count - 1``."""
    per_block = cache.shape[1]
    flat = cache.view(-1, cache.shape[-1])
    if new.shape[0]:
        index = torch.arange(first, first + new.shape[0], device=new.device)
        flat[table[index // per_block] * per_block + index % per_block] = new.to(cache.dtype)
    index = torch.arange(count, device=cache.device)
    return flat[table[index // per_block] * per_block + index % per_block]
