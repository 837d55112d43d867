"""Encoder outputs in a step's flat batch: what a vision-language family reads from the forward context.

The runner (:mod:`weft.runner.encoder`) encodes the items a step needs (``ModelFamily.encode``), keeps their
outputs by item hash, and for every request of the step whose scheduled positions cover part of an item's
placeholder ranges, gathers those rows of the item's output: a :class:`MultimodalBatch` on
``ForwardContext.multimodal``. A range may cross a chunk boundary: each step takes the rows its positions cover.

A family calls :func:`merge_multimodal_embeddings` right after its token embedding::

    hidden = merge_multimodal_embeddings(self.embed_tokens(input_ids), context)

and reads :attr:`MultimodalBatch.positions` (multi-axis rotary positions) and :attr:`MultimodalBatch.extras`
(per-position values such as DeepSeek V4.1's ``token_types``) where it uses them. The context carries no
``multimodal`` (None) in a step without images, extras or positions: text-only steps, and every decode graph.
"""

from __future__ import annotations

import msgspec
import torch


class MultimodalBatch(msgspec.Struct):
    """A step's encoder rows, positions and extras, laid over its flat batch (``num_tokens`` rows)."""

    rows: torch.Tensor
    """int64 ``[n]``: the flat-batch rows whose embeddings are encoder outputs, ascending (may be empty)."""
    embeds: torch.Tensor
    """``[n, hidden]``: those rows' embeddings, in the order of :attr:`rows` (the encoder's dtype)."""
    positions: torch.Tensor | None = None
    """int64 ``[axes, num_tokens]`` where a request of the step has positions of its own (multi-axis rotary): its
    rows take them (output tokens continue from the prompt's largest position), other requests' rows repeat
    their plain position on every axis. None: the plain positions hold."""
    extras: dict[str, torch.Tensor] = {}
    """Per extra a request of the step carries (``token_types``), ``[..., num_tokens]``: its values at the step's
    positions; 0 at the rows of requests without it and at output positions."""


def merge_multimodal_embeddings(embeds: torch.Tensor, context: object) -> torch.Tensor:
    """``embeds`` (``[num_tokens, hidden]``, the token embeddings of the step) with the encoder rows of
    ``context.multimodal`` written over them; ``embeds`` itself when the step has none.

    ``context`` is the :class:`~weft.layers.attention.ForwardContext` (any object with a ``multimodal`` attribute).
    """
    batch: MultimodalBatch | None = getattr(context, "multimodal", None)
    if batch is None or batch.rows.numel() == 0:
        return embeds
    return embeds.index_copy(0, batch.rows, batch.embeds.to(embeds.dtype))
