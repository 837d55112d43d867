"""Nano-batches: a decode step's rows split in two, so that one half's attention can run beside the other's GEMMs.

A large decode step is compute-bound GEMMs (the projections and the MLP) and then memory-bound attention (the KV
reads), one after the other in every layer: the step costs their sum. Split the rows into two nano-batches A and B
(NanoFlow's nano-batching) and a layer's work becomes six pieces, which the ``nano_batches`` op
(:mod:`weft.builtins.nano_batches`) orders so that B's attention is issued, on a second stream, while A's GEMMs
run, and A's attention while B's run:

    GEMM stream       qkv A | qkv B | out+MLP A, qkv A' | out+MLP B, qkv B' | ...
    attention stream          | attn A      | attn B           | attn A'      | ...

This module owns what a model and the runner share for it:

- :class:`NanoBatch`: one nano-batch as the runner describes it (its rows of the step, and a
  :class:`~weft.layers.attention.ForwardContext` whose attention metadata covers only those rows);
  :func:`decode_nano_batches` builds them for a decode graph's step (every row one token).
- :class:`StagedLayer`: a decoder layer cut where its attention starts and ends, the three stages the op
  interleaves; :class:`NanoBatchState`: one nano-batch's activations between them.

Which families split (:attr:`weft.contracts.model.ModelFamily.splits_decode_batches`), and which steps (decode
graphs of at least ``engine.decode_overlap_min_batch`` rows, where ``engine.decode_overlap`` is on), are decided by
the runner; how the pieces are ordered is the op's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec
import torch

from weft.contracts.attention import AttentionBackend, AttentionBatch


class NanoBatch(msgspec.Struct, frozen=True):
    """Rows ``start:stop`` of a step, and the forward context of those rows alone."""

    start: int
    stop: int
    context: Any
    """A :class:`~weft.layers.attention.ForwardContext` whose ``metadata`` and ``batches`` describe only these
    rows (their row ``0`` is the step's row ``start``)."""


class NanoBatchState:
    """One nano-batch's activations as they pass through the layers: the op's stages read and replace them."""

    __slots__ = ("rotary", "hidden", "residual", "context")

    def __init__(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        context: Any,
    ) -> None:
        self.rotary, self.hidden, self.residual, self.context = rotary, hidden, residual, context


class StagedLayer(Protocol):
    """A decoder layer in three stages; running them in order is the layer's forward.

    The first and last are the GEMM-bound work (norms, projections, MLP), the middle one the paged attention (it
    stores the nano-batch's keys and values and reads its requests' caches)."""

    def attention_inputs(
        self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """``(what attend takes, the residual stream)``: the input norm, the QKV projection and the rotation."""
        ...

    def attend(self, inputs: tuple[torch.Tensor, ...], context: Any) -> torch.Tensor:
        """The paged attention of ``inputs`` (from :meth:`attention_inputs`) through ``context``'s backend."""
        ...

    def after_attention(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(the layer's output, the residual stream before it)``: the output projection, the norm, the MLP."""
        ...


def split_rows(size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two nano-batches of a ``size``-row step: halves, the first the larger by one row when ``size`` is odd."""
    if size < 2:
        raise ValueError(f"a step of {size} row(s) cannot be split into two nano-batches")
    middle = (size + 1) // 2
    return (0, middle), (middle, size)


def decode_nano_batches(
    backend: AttentionBackend,
    batches: Sequence[AttentionBatch],
    paged: Sequence[bool],
    size: int,
    make_context: Callable[[list[Any], list[AttentionBatch]], Any],
) -> list[NanoBatch]:
    """The two nano-batches of a decode step of ``size`` rows, each one token, from the step's per-group
    ``batches`` (``paged[g]``: the backend builds group ``g``'s metadata). ``make_context(metadata, batches)``
    makes a nano-batch's forward context from its own metadata and batches.

    Every row is one token, so a nano-batch's ``query_start`` is ``0 .. rows``: the step's first ``rows + 1``
    entries, which are that (read on the device only, as a graph's capture requires)."""
    parts = []
    for start, stop in split_rows(size):
        own = [
            AttentionBatch(
                query_start=batch.query_start[: stop - start + 1],
                seq_lens=batch.seq_lens[start:stop],
                block_table=batch.block_table[start:stop],
                slot_mapping=batch.slot_mapping[start:stop],
                max_query_len=1,
                max_seq_len=batch.max_seq_len,
                block_size=batch.block_size,
            )
            for batch in batches
        ]
        metadata = [
            backend.build_metadata(batch) if is_paged else None for batch, is_paged in zip(own, paged, strict=True)
        ]
        parts.append(NanoBatch(start, stop, make_context(metadata, own)))
    return parts
