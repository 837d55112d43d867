"""Speculative (multi-token) decode: the indexer's logical top-k of each verified step turned into
physical cache slots.

With ``steps`` tokens per request verified at once, the top-k rows arrive in token order
(request-major: request 0's steps, then request 1's). The sparse-attention kernel reads one step
at a time, so the slots are written into a strided per-step slice ``[steps, requests, k]`` and
viewed back in token order; ``-1`` (no entry) stays ``-1`` and each row's valid count is its
number of entries ``>= 0``.
"""

from __future__ import annotations

import torch


def per_step_slots(
    logical: torch.Tensor, block_table: torch.Tensor, entries_per_block: int, steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logical`` ``[requests * steps, k]`` entry indices (``-1`` none), ``block_table`` ``[requests, blocks]``.

    Returns ``(by_step, slots, valid)``: the physical slots laid out ``[steps, requests, k]``, the same
    slots in token order ``[requests * steps, k]`` (a copy: the strided view cannot be flattened in
    place), and each row's count of valid entries.
    """
    requests = block_table.shape[0]
    k = logical.shape[-1]
    by_step = torch.full((steps, requests, k), -1, dtype=torch.long, device=logical.device)
    token_order = by_step.permute(1, 0, 2)  # [requests, steps, k], a strided view of the same storage
    entries = logical.view(requests, steps, k).long()
    blocks = (
        block_table.long().gather(1, (entries.clamp(min=0) // entries_per_block).view(requests, -1)).view_as(entries)
    )
    slots = blocks * entries_per_block + entries.clamp(min=0) % entries_per_block
    token_order.copy_(torch.where(entries >= 0, slots, -1))
    slots_in_token_order = token_order.reshape(requests * steps, k)
    return by_step, slots_in_token_order, (slots_in_token_order >= 0).sum(dim=-1)
