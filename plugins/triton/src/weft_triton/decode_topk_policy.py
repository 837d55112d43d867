"""The decode top-k launch policy: a pure function from the launch's shape and the device's
architecture to its geometry. It imports nothing (no torch, no Triton), so it is tested anywhere.

The geometry never changes the result: every CTA keeps the exact top-k of its share of a row
under one total order (score, then block id), and the merge keeps the exact top-k of those, so
any (chunks, block, warps, stages) gives bit-identical output.

The rules (from the ROCm selector's gfx950 change):

* on gfx950 with ``topk == 16`` and a capacity of at most 128 blocks: one CTA per row, a tile of
  128 blocks, 2 warps, 1 stage; measured about 28% faster than the multi-chunk path on an MI355;
* a capacity of at most ``16 * 512`` blocks: 16 chunks of 512;
* otherwise ``chunks`` is the largest power of two ``<= max(1, min(16, 64 // (total_q * heads)))``:
  many rows already fill the device, few rows split each over more CTAs.

Past those rules one thing is added: a CTA keeps its candidates in a tile, so the tile holds at
least ``topk`` (rounded up to a power of two) blocks.
"""

from __future__ import annotations

from typing import NamedTuple

SINGLE_CTA_ARCHS = frozenset({"gfx950"})
"""Architectures where one CTA per row wins at small capacities."""
SINGLE_CTA_TOPK = 16
SINGLE_CTA_CAPACITY = 128
MAX_CHUNKS = 16
CHUNK_BLOCKS = 512
"""Blocks per chunk (and per tile) on the multi-chunk path."""
ROW_CTAS = 64
"""Rows times chunks the fallback aims at: ``chunks = 64 // rows`` (at most 16, at least 1)."""


class DecodeTopKLaunch(NamedTuple):
    """How one decode top-k launch runs: a grid of ``(heads * total_q, chunks)`` CTAs, each walking its
    chunk of a row in tiles of ``block`` blocks with ``warps`` warps and ``stages`` pipeline stages."""

    chunks: int
    block: int
    warps: int
    stages: int

    @property
    def single_cta(self) -> bool:
        """One CTA per row: no workspace, no completion counter, no merge."""
        return self.chunks == 1


def floor_power_of_two(value: int) -> int:
    """The largest power of two ``<= value`` (``value >= 1``)."""
    return 1 << (value.bit_length() - 1)


def ceil_power_of_two(value: int) -> int:
    """The smallest power of two ``>= value`` (1 for ``value <= 1``)."""
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


def decode_topk_launch(arch: str, topk: int, capacity: int, total_q: int, heads: int) -> DecodeTopKLaunch:
    """The launch geometry for ``heads * total_q`` rows of ``capacity`` blocks each, keeping ``topk``.

    ``arch`` is the device's architecture name (``gfx950``, ``sm_90``; ``""`` when unknown).
    """
    if topk < 1 or capacity < 0 or total_q < 0 or heads < 0:
        raise ValueError(
            f"decode_topk_launch: topk ({topk}) must be positive and capacity ({capacity}), total_q ({total_q}) "
            f"and heads ({heads}) non-negative"
        )
    if arch in SINGLE_CTA_ARCHS and topk == SINGLE_CTA_TOPK and capacity <= SINGLE_CTA_CAPACITY:
        return DecodeTopKLaunch(chunks=1, block=128, warps=2, stages=1)
    block = max(CHUNK_BLOCKS, ceil_power_of_two(topk))
    warps = 4 if block <= CHUNK_BLOCKS else 8
    if capacity <= MAX_CHUNKS * CHUNK_BLOCKS:
        return DecodeTopKLaunch(chunks=MAX_CHUNKS, block=block, warps=warps, stages=1)
    rows = max(1, total_q * heads)
    chunks = floor_power_of_two(max(1, min(MAX_CHUNKS, ROW_CTAS // rows)))
    return DecodeTopKLaunch(chunks=chunks, block=block, warps=warps, stages=1)
