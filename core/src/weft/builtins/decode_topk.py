"""The decode block top-k of sparse-attention selectors: the torch reference (``decode_topk.torch``).

Scores ``[heads, total_q, max_block]`` rank the KV blocks (or compressed entries) of
each query row; the op keeps the best ``topk`` block ids of the blocks the row may
see. Semantics (``shared/reference/ops.md``):

- rows: ``total_q == num_reqs * decode_query_len``; row ``b`` belongs to request
  ``b // q`` and sits at position ``seq_lens[req] - q + b % q``; it sees blocks
  ``0 .. ceil(max(pos + 1, 0) / block_size) - 1`` (capped at ``max_block``);
- order: score descending, ties to the smaller block id; NaN ranks as -1e30 (below every
  real score), -0.0 equals +0.0, +/-Inf are ordinary values;
- output: int32 ``[heads, total_q, topk]``, slots past ``min(topk, visible)`` are -1.

This reference sorts with torch's stable sort; the Triton implementation (weft-triton)
packs the same order into one integer key per block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from weft.contracts.ops import OpImplementation

NAN_SCORE = -1e30
"""The score a NaN ranks as: below every real score, above nothing valid."""


def visible_blocks(seq_lens: torch.Tensor, decode_query_len: int, block_size: int, max_block: int) -> torch.Tensor:
    """``[total_q]`` number of blocks each query row may see."""
    q = decode_query_len
    lengths = seq_lens.long().repeat_interleave(q)
    offsets = torch.arange(lengths.numel(), device=lengths.device) % q
    positions = lengths - q + offsets
    return ((positions + 1).clamp(min=0) + block_size - 1).div(block_size, rounding_mode="floor").clamp(max=max_block)


def check_inputs(
    scores: torch.Tensor, seq_lens: torch.Tensor, decode_query_len: int, block_size: int, topk: int
) -> None:
    if scores.dim() != 3:
        raise ValueError(f"decode_topk: scores must be [heads, total_q, max_block]; got shape {tuple(scores.shape)}")
    if decode_query_len < 1 or scores.shape[1] != seq_lens.numel() * decode_query_len:
        raise ValueError(
            f"decode_topk: total_q ({scores.shape[1]}) must equal num_reqs ({seq_lens.numel()}) * "
            f"decode_query_len ({decode_query_len})"
        )
    if block_size < 1 or topk < 1:
        raise ValueError(f"decode_topk: block_size ({block_size}) and topk ({topk}) must be positive")


class DecodeTopKTorch(OpImplementation):
    """The reference: a stable descending sort of the canonicalised scores, invisible blocks last."""

    op: ClassVar[str] = "decode_topk"
    reference: ClassVar[bool] = True
    priority: ClassVar[int] = -100
    tolerance: ClassVar[tuple[float, float]] = (0.0, 0.0)

    def __call__(
        self, scores: torch.Tensor, seq_lens: torch.Tensor, decode_query_len: int, block_size: int, topk: int
    ) -> torch.Tensor:
        check_inputs(scores, seq_lens, decode_query_len, block_size, topk)
        heads, total_q, max_block = scores.shape
        values = scores.float()
        values = torch.where(torch.isnan(values), torch.full_like(values, NAN_SCORE), values) + 0.0  # -0.0 -> +0.0
        visible = visible_blocks(seq_lens, decode_query_len, block_size, max_block)
        block_ids = torch.arange(max_block, device=scores.device)
        seen = (block_ids.view(1, -1) < visible.view(-1, 1)).expand(heads, total_q, max_block)
        # Two stable passes: by score, then visible blocks before the rest (keeping score order).
        order = torch.sort(values, dim=-1, descending=True, stable=True).indices
        by_visibility = torch.sort(seen.gather(-1, order).to(torch.int8), dim=-1, descending=True, stable=True).indices
        order = order.gather(-1, by_visibility)
        width = min(topk, max_block)
        chosen = order[..., :width].to(torch.int32)
        keep = torch.arange(width, device=scores.device).view(1, 1, -1) < visible.view(1, -1, 1)
        chosen = torch.where(keep, chosen, torch.full_like(chosen, -1))
        if width < topk:
            chosen = torch.cat([chosen, chosen.new_full((heads, total_q, topk - width), -1)], dim=-1)
        return chosen

    @classmethod
    def example_inputs(cls, device: str) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
        generator = torch.Generator().manual_seed(0)
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, 1.0, -1e30, 3.0])
        for heads, reqs, q, max_block, block_size, topk in (
            (1, 3, 1, 9, 4, 4),
            (2, 2, 2, 40, 16, 8),
            (1, 4, 1, 130, 1, 16),
            (2, 1, 3, 7, 2, 16),
            (1, 2, 1, 0, 4, 4),
        ):
            scores = torch.randint(-3, 4, (heads, reqs * q, max_block), generator=generator).float()
            if max_block:
                picks = torch.randint(0, special.numel(), (heads, reqs * q, max_block), generator=generator)
                mask = torch.rand((heads, reqs * q, max_block), generator=generator) < 0.4
                scores = torch.where(mask, special[picks], scores)
            seq_lens = torch.randint(0, max_block * block_size + 2, (reqs,), generator=generator, dtype=torch.int32)
            yield (scores.to(device), seq_lens.to(device), q, block_size, topk), {}
