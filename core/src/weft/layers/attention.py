"""The attention layer every model uses: it hands the backend its slice of the step's context."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import torch
from torch import nn

from weft.contracts.attention import AttentionBackend, AttentionBatch, AttentionLayer
from weft.layers.multimodal import MultimodalBatch
from weft.layers.nano_batches import NanoBatch


class ForwardContext(msgspec.Struct):
    """What a model's forward needs besides token ids and positions, built by the model runner per step."""

    backend: AttentionBackend
    metadata: list[Any]
    """The backend's metadata for each KV-cache group (None for a group the backend does not own)."""
    kv_caches: dict[str, torch.Tensor]
    """The cache tensor of each attention layer, by layer name."""
    batches: list[AttentionBatch] = []
    """The step's block tables and slots for each KV-cache group, for models that manage a group themselves."""
    prefix_hits: list[int] = []
    """Per request row: the tokens a prefix hit (local or loaded) supplied, on the request's first step
    since it was (re)scheduled; 0 otherwise. A model restores its checkpointed groups from them."""
    request_ids: list[str] = []
    """Per request row: its id (core API 1.6)."""
    sparse_entries: Any = None
    """The KV connector's :class:`~weft.contracts.kv_connector.SparseEntryReader`, when it offers one (core API 1.6)."""
    static_decode: bool = False
    """True when the forward is a decode graph's (captured once, replayed every step; core API 1.7): every row
    decodes one token, and ``batches`` are the runner's static device buffers, whose values change between
    replays. A model that manages groups itself may then read none of them on the host (no ``tolist``, no
    shapes taken from their values); each group's block table is padded to the longest table
    ``max_model_len`` allows (past a request's blocks, whatever an earlier replay left there: mask by
    position), and padded rows are one-token requests at
    position 0 whose every block is the group's scratch block, the last block of each cache tensor, which no
    request is given. Only set for families whose :meth:`~weft.contracts.model.ModelFamily.captures_managed_groups`
    is true; ``prefix_hits`` and ``request_ids`` are empty then, and ``sparse_entries`` is the connector's reader
    only when it is a :class:`~weft.contracts.kv_connector.CapturedSparseEntryReader` (whose per-step state the
    runner refills before every replay; core API 1.11), else None."""
    wait_for_layer: Callable[[str], None] | None = None
    """Blocks until the KV connector's load of a layer's cache for this step is complete (core API 1.9);
    None without a connector and in captured graphs. :class:`Attention` calls it before its layer's
    attention; a model that reads or writes a cache tensor any other way is waited for before the forward."""
    multimodal: MultimodalBatch | None = None
    """The step's encoder rows, multi-axis positions and per-position extras (core API 1.15); None in a step
    without any. A vision-language family merges the rows after its token embedding with
    :func:`weft.layers.multimodal.merge_multimodal_embeddings`."""
    nano_batches: list[NanoBatch] = []
    """The step's rows split into nano-batches, each with its own context (:mod:`weft.layers.nano_batches`), in a
    decode graph the runner splits (``engine.decode_overlap``); empty otherwise. The model may run its layers
    over the whole step with this context, or over each nano-batch with its own, through the ``nano_batches``
    op. Only set for families whose :attr:`~weft.contracts.model.ModelFamily.splits_decode_batches` is true
    (core API 1.17)."""


class Attention(nn.Module):
    """Paged attention of one layer: stores new K/V and attends through the selected backend."""

    def __init__(self, name: str, group: int, spec: AttentionLayer) -> None:
        super().__init__()
        self.layer_name = name
        self.group = group
        self.spec = spec

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        context: ForwardContext,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sinks``: the ``[num_heads]`` sink logits of a layer whose spec has ``sinks``."""
        if context.wait_for_layer is not None:
            context.wait_for_layer(self.layer_name)
        cache, metadata = context.kv_caches[self.layer_name], context.metadata[self.group]
        if self.spec.sinks:
            return context.backend.forward(self.spec, query, key, value, cache, metadata, sinks=sinks)
        return context.backend.forward(self.spec, query, key, value, cache, metadata)
