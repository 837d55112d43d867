"""The attention slot: the paged KV-cache layout and the attention forward over it.

One backend serves every attention layer of a model. Per engine step the model
runner describes the flat batch once (:class:`AttentionBatch`), the backend
turns it into its own metadata once (:meth:`AttentionBackend.build_metadata`),
and every layer then calls :meth:`AttentionBackend.forward` with that metadata.

A step mixes requests in prefill (several new tokens, possibly a chunk of a
longer prompt) and in decode (one new token). Tokens are laid out request after
request; request ``i`` owns query rows ``query_start[i]:query_start[i+1]``,
whose positions are the last ``query_len`` of its ``seq_lens[i]`` tokens. The
backend must be correct for any such mix.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from weft.contracts.plugin import PluginBase

if TYPE_CHECKING:
    import torch

    from weft.contracts.kv_cache import FullAttentionSpec, SlidingWindowSpec
    from weft.contracts.platform import Platform


FLOAT8_MAX = 448.0
"""The largest finite float8_e4m3fn."""


def to_float8(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` rounded to float8_e4m3fn, saturating at +-:data:`FLOAT8_MAX` (a plain cast may give NaN beyond)."""
    import torch

    return tensor.clamp(-FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn)


class AttentionLayer(msgspec.Struct, frozen=True):
    """The static shape of one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    """Keys visible to a query at position t: ``t - sliding_window + 1 .. t`` (None: all)."""
    logits_soft_cap: float | None = None
    """Scores become ``cap * tanh(score / cap)`` (after the scale, before the mask) when set (Gemma 2)."""
    sinks: bool = False
    """Each query head has a learned sink logit (gpt-oss): one more term in the softmax's denominator, with no
    value. The layer passes the ``[num_heads]`` logits as :meth:`AttentionBackend.forward`'s ``sinks``."""


class AttentionBatch(msgspec.Struct, frozen=True):
    """The flat batch of one step, as int32 tensors on the model's device."""

    query_start: torch.Tensor
    """``[num_reqs + 1]`` cumulative query lengths; row ranges per request."""
    seq_lens: torch.Tensor
    """``[num_reqs]`` tokens in context for each request after this step (cached + new)."""
    block_table: torch.Tensor
    """``[num_reqs, max_blocks]`` KV-cache block ids per request (padding is unspecified)."""
    slot_mapping: torch.Tensor
    """``[num_tokens]`` flat cache slot (``block * block_size + offset``) of each new token's K/V."""
    max_query_len: int
    max_seq_len: int
    block_size: int


class AttentionBackend(PluginBase):
    """Paged attention: owns the KV-cache tensor layout and the attention math.

    Instantiated once per engine: ``Backend(options, platform)``.
    """

    name: ClassVar[str]
    supported_head_dims: ClassVar[tuple[int, ...] | None] = None
    """Head dims this backend computes; None means any."""
    supports_sliding_window: ClassVar[bool] = True
    supports_sinks: ClassVar[bool] = False
    """Whether :meth:`forward` takes ``sinks`` (:attr:`AttentionLayer.sinks`); :meth:`check_layer` refuses a layer
    with sinks otherwise."""
    supports_logits_soft_cap: ClassVar[bool] = False
    """Whether :meth:`forward` applies :attr:`AttentionLayer.logits_soft_cap`; :meth:`check_layer` refuses a
    layer that sets it otherwise (a backend that ignored it would compute another model)."""
    kv_cache_dtypes: ClassVar[frozenset[str]] = frozenset()
    """Cache element types besides the model's dtype that :meth:`forward` stores and reads (``{"float8_e4m3fn"}``:
    ``engine.kv_cache_dtype = "fp8"``). An fp8 cache holds each key and value as its float8_e4m3 rounding,
    saturated at +-448 (:func:`to_float8`): a per-tensor scale of 1, as vLLM uses where a checkpoint gives no
    calibrated scales; attention reads them back in the query's dtype. Added in core API 1.15."""
    supports_graph_capture: ClassVar[bool] = False
    """Whether decode steps through this backend can be captured as graphs and replayed.

    True promises: :meth:`build_metadata` and :meth:`forward` read the batch's
    tensors only on the device (no ``.tolist()``, no host decisions on their
    values), so the metadata stays right when the tensors' contents change but
    not their shapes; ``max_query_len`` is 1 and ``max_seq_len`` is the
    context length for captured steps.
    """
    supports_verify_graph_capture: ClassVar[bool] = False
    """Whether speculating steps through this backend can be captured as graphs too
    (:class:`weft.runner.graphs.VerifyGraphs`; added in core API 1.17); read only where
    :attr:`supports_graph_capture` is true.

    True promises, besides what :attr:`supports_graph_capture` does: ``max_query_len`` is ``1 + k`` for such
    steps while each request's query length (``query_start``) varies from replay to replay between 0 and it; and
    tokens past ``query_start[-1]`` belong to no request: their keys and values are stored at their
    ``slot_mapping`` slots (a scratch block), and their outputs may be anything, as they are never read.
    """

    def __init__(self, options: msgspec.Struct | None, platform: Platform) -> None:
        self.options = options if options is not None else self.Options()
        self.platform = platform

    def prepare(self, layers: list[AttentionLayer], dtype: str) -> None:
        """Called once the model is built, with every attention layer and the runtime dtype.

        The default checks each layer with :meth:`check_layer`; a backend may also
        precompute what depends only on the model (window sizes, workspace).
        """
        for layer in layers:
            self.check_layer(layer)

    def check_layer(self, layer: AttentionLayer) -> None:
        """Raise ValueError naming the field if this backend cannot run ``layer``."""
        if self.supported_head_dims is not None and layer.head_dim not in self.supported_head_dims:
            raise ValueError(
                f"attention backend {self.name!r}: head_dim {layer.head_dim} is not supported; "
                f"supported: {list(self.supported_head_dims)}; choose another use.attention"
            )
        if layer.sliding_window is not None and not self.supports_sliding_window:
            raise ValueError(
                f"attention backend {self.name!r} does not support sliding windows; choose another use.attention"
            )
        if layer.sinks and not self.supports_sinks:
            raise ValueError(
                f"attention backend {self.name!r} does not support attention sinks (AttentionLayer.sinks); "
                f"choose another use.attention (the 'torch' backend does)"
            )
        if layer.logits_soft_cap is not None and not self.supports_logits_soft_cap:
            raise ValueError(
                f"attention backend {self.name!r} does not support logits_soft_cap ({layer.logits_soft_cap}); "
                f"choose another use.attention (the 'torch' backend does)"
            )

    def kv_cache_shape(self, num_blocks: int, spec: FullAttentionSpec | SlidingWindowSpec) -> tuple[int, ...]:
        """Shape of one layer's cache tensor. Default: ``[2, num_blocks, block_size, kv_heads, head_dim]``."""
        return (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    @staticmethod
    def store_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new keys and values into a cache of the default layout (:meth:`kv_cache_shape`), rounded to
        float8 (:func:`to_float8`) in an fp8 cache."""
        import torch

        heads, dim = key.shape[1], key.shape[2]
        slots = slot_mapping.long()
        if kv_cache.dtype == torch.float8_e4m3fn:
            # torch has no index_copy_ of float8 on every device: the same bytes as uint8.
            kv_cache, key, value = (tensor.view(torch.uint8) for tensor in (kv_cache, to_float8(key), to_float8(value)))
        kv_cache.view(2, -1, heads, dim)[0].index_copy_(0, slots, key)
        kv_cache.view(2, -1, heads, dim)[1].index_copy_(0, slots, value)

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch) -> Any:
        """Prepare whatever :meth:`forward` needs for this step; called once per step."""

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """Store this step's keys/values and attend.

        ``query`` is ``[num_tokens, num_heads, head_dim]``; ``key`` and ``value``
        are ``[num_tokens, num_kv_heads, head_dim]`` for the new tokens only. The
        backend writes them to ``kv_cache`` at ``slot_mapping``, then computes
        causal attention of each query row over its request's cached keys
        (respecting ``layer.sliding_window``) and returns
        ``[num_tokens, num_heads, head_dim]``.

        A layer with :attr:`AttentionLayer.sinks` is called with one more keyword argument,
        ``sinks`` (``[num_heads]``, the sink logit of each query head); others never are.
        """
