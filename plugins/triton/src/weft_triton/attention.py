"""The ``triton`` attention backend: paged attention for mixed prefill/decode steps in one Triton launch.

New keys and values are stored by one launch of a store kernel (rounded to float8 in an fp8
cache, ``engine.kv_cache_dtype = "fp8"``), then one launch of
:mod:`weft_triton.paged_attention` attends every query of the step (two for
decode steps of few requests, whose keys are split over several programs).
The backend chooses the tiles per step and registers the kernel with core's
warm-up contract: :meth:`TritonAttention.prepare` with every layer shape, and
:meth:`TritonAttention.kv_cache_shape` with the cache block sizes, so warm-up
compiles each variant the model will launch before the first request.

Importing this module imports no Triton: the kernels load when the backend is
built, which fails with the fix when Triton is missing.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

import msgspec
import torch

from weft.api import register
from weft.contracts.attention import AttentionBackend, AttentionBatch, AttentionLayer
from weft.contracts.kv_cache import FullAttentionSpec, SlidingWindowSpec
from weft_triton.runtime import MISSING_TRITON, interpreting, runs_on

DECODE_BLOCK_M = 16
"""Rows per program when every request decodes (rows are query heads of one KV head)."""
PREFILL_BLOCK_M = 64
"""Rows per program when a prefill chunk is present."""
MAX_SPLITS = 16
"""Most key ranges one decode request's keys are split into (flash-decoding)."""


def decode_splits(num_requests: int) -> int:
    """Key ranges per request for a decode-only step of ``num_requests``: few requests leave most of
    the GPU idle (one program per request and KV head), so their keys are split across programs
    and the partial softmaxes merged by a second kernel. Depends only on the batch size, so a
    captured graph keeps it."""
    return 16 if num_requests <= 2 else 8 if num_requests <= 8 else 4 if num_requests <= 16 else 1


class TritonAttentionMetadata(msgspec.Struct):
    batch: AttentionBatch
    block_m: int
    """Rows per program: small for decode-only steps, large when a prefill chunk is present."""
    splits: int = 1
    """Key ranges per request on decode-only steps of few requests (:func:`decode_splits`)."""


class TritonAttention(AttentionBackend):
    """Paged attention in one Triton kernel for any mix of prefill chunks and decodes; GQA; sliding windows;
    soft-capped logits."""

    name: ClassVar[str] = "triton"
    supported_head_dims: ClassVar[tuple[int, ...]] = (16, 32, 64, 128, 256)
    supports_graph_capture: ClassVar[bool] = True
    supports_verify_graph_capture: ClassVar[bool] = True
    """A verify graph captures the multi-query launch (``PREFILL_BLOCK_M`` rows a program), its grid from the
    static row count and ``1 + k``; each program reads its request's query range on the device and returns at once
    for a request of no query token; the store kernel writes every token at its slot."""
    supports_logits_soft_cap: ClassVar[bool] = True
    kv_cache_dtypes: ClassVar[frozenset[str]] = frozenset({"float8_e4m3fn"})
    supports_sinks: ClassVar[bool] = True

    def __init__(self, options: msgspec.Struct | None, platform: Any) -> None:
        super().__init__(options, platform)
        # Refuse before importing the kernels: Triton decides at import whether they are interpreted.
        if importlib.util.find_spec("triton") is not None and not (interpreting() or runs_on(platform)):
            backend = getattr(platform, "triton_backend", None)
            raise RuntimeError(
                f"attention backend 'triton' cannot run on platform {platform.name!r}: "
                + (f"the installed triton has no {backend!r} backend" if backend else "Triton has no backend for it")
                + "; set use.attention = 'torch' (or TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter)"
            )
        try:
            from weft_triton.paged_attention import PagedAttentionKernel, StoreKVKernel
        except ModuleNotFoundError as error:
            if (error.name or "").partition(".")[0] != "triton":
                raise
            raise RuntimeError(
                f"attention backend 'triton' {MISSING_TRITON}; or set use.attention = 'torch'"
            ) from error
        self.kernel = PagedAttentionKernel()
        self.store = StoreKVKernel()
        self.store.cache_dtypes = self.kernel.cache_dtypes

    def check_layer(self, layer: AttentionLayer) -> None:
        super().check_layer(layer)
        group = layer.num_heads // layer.num_kv_heads
        if group > DECODE_BLOCK_M:
            raise ValueError(
                f"attention backend 'triton': {layer.num_heads} query heads over {layer.num_kv_heads} KV heads "
                f"(group of {group}) is not supported; groups up to {DECODE_BLOCK_M} are; set use.attention = 'torch'"
            )

    def prepare(self, layers: list[AttentionLayer], dtype: str) -> None:
        super().prepare(layers, dtype)
        self.kernel.layers = list(dict.fromkeys(layers))
        self.kernel.dtypes = [getattr(torch, dtype)]
        self.store.layers, self.store.dtypes = self.kernel.layers, self.kernel.dtypes
        register(self.kernel)
        register(self.store)

    def kv_cache_shape(self, num_blocks: int, spec: FullAttentionSpec | SlidingWindowSpec) -> tuple[int, ...]:
        if spec.block_size not in self.kernel.block_sizes:
            self.kernel.block_sizes.append(spec.block_size)
        if spec.dtype in self.kv_cache_dtypes and getattr(torch, spec.dtype) not in self.kernel.cache_dtypes:
            self.kernel.cache_dtypes.append(getattr(torch, spec.dtype))
        return super().kv_cache_shape(num_blocks, spec)

    def build_metadata(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        if batch.max_query_len == 1:
            return TritonAttentionMetadata(
                batch=batch, block_m=DECODE_BLOCK_M, splits=decode_splits(batch.seq_lens.shape[0])
            )
        return TritonAttentionMetadata(batch=batch, block_m=PREFILL_BLOCK_M)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch = metadata.batch
        cache_dtype = kv_cache.dtype if kv_cache.dtype != query.dtype else None
        if (
            key.stride(-1) == value.stride(-1) == 1
            and key.dtype == value.dtype == query.dtype
            and kv_cache.is_contiguous()
        ):
            self.store(
                dtype=key.dtype,
                num_kv_heads=layer.num_kv_heads,
                head_dim=layer.head_dim,
                key=key,
                value=value,
                kv_cache=kv_cache,
                slot_mapping=batch.slot_mapping,
                cache_dtype=cache_dtype,
            )
        else:
            self.store_kv(kv_cache, key, value, batch.slot_mapping)
        query = query.contiguous()
        output = torch.empty_like(query)
        self.kernel(
            dtype=query.dtype,
            layer=layer,
            block_size=batch.block_size,
            block_m=metadata.block_m,
            splits=metadata.splits,
            query=query,
            kv_cache=kv_cache,
            output=output,
            batch=batch,
            cache_dtype=cache_dtype,
            sinks=sinks,
        )
        return output
