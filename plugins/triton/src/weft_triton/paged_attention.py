"""Paged attention for mixed prefill/decode steps in one Triton kernel (the ``triton`` backend's kernels).

The cache layout is the torch backend's, ``[2, num_blocks, block_size, kv_heads,
head_dim]``. A program owns one request, one KV head and a tile of ``BLOCK_M``
rows, where a row is one (query position, query head) pair of that KV head's
group (GQA packing: decode steps fill the tile with the group's heads instead of
padding). It walks the request's blocks through the block table in tiles of
``BLOCK_N`` keys (each key's cache block looked up, so any block size works)
with an online softmax, masking causally (the queries are the last
``query_len`` positions of the context) and by the sliding window, skipping
tiles wholly before the window. Decode steps of few requests split each
request's keys over several programs and merge the partial softmaxes
(:func:`weft_triton.attention.decode_splits`).

An fp8 cache (``engine.kv_cache_dtype = "fp8"``) holds float8_e4m3 keys and values: the store kernel
rounds them (saturating at +-448, a per-tensor scale of 1) and the attention kernels convert each
tile they load to the query's dtype, so the tiles' products run as with a bf16 cache, on half the bytes.

Runs wherever Triton has a backend for the device (NVIDIA, AMD, Intel XPU), and
on the CPU under ``TRITON_INTERPRET=1`` for tests.

The kernel goes through core's warm-up contract (:mod:`weft.kernels.warmup`):
its compile key holds the dtype, the cache's element type, the layer's head shape and window flag, the
cache block size and the tile height; the backend registers it with every layer
shape and the cache block sizes, so warm-up compiles each variant the model will
launch before the first request. Values that change from step to step (the block
table's row stride, the window length) are not specialised on.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from weft.api import Choice, CompileKey, InputSpace, Kernel, Zipped
from weft.contracts.attention import AttentionBatch, AttentionLayer
from weft_triton.attention import DECODE_BLOCK_M, MAX_SPLITS, PREFILL_BLOCK_M
from weft_triton.runtime import interpreting

BLOCK_N = 64
"""Keys per inner iteration, independent of the cache's block size."""
PREFILL_BLOCK_N = 32
PREFILL_STAGES = 2
"""Prefill tiles: 64 rows against 32-key tiles, two pipeline stages. On an H200 a tile sweep of an
8k-token Llama-3-8B prefill measured 253 TFLOP/s for these against 214 for 64x64 with 3 stages."""


@triton.jit
def _load_key_tile(
    key_cache,
    value_cache,
    table_row,
    key_positions,
    loadable,
    kv_head,
    dims,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
):
    """Keys and values of one tile of positions; a tile may span several cache blocks, so each
    key's block is looked up in the request's block-table row."""
    physical = tl.load(table_row + key_positions // BLOCK_SIZE, mask=loadable, other=0)
    offsets = (
        (physical.to(tl.int64) * stride_cb + (key_positions % BLOCK_SIZE) * stride_cs)[:, None]
        + kv_head * stride_ch
        + dims[None, :]
    )
    k = tl.load(key_cache + offsets, mask=loadable[:, None], other=0.0)
    v = tl.load(value_cache + offsets, mask=loadable[:, None], other=0.0)
    return k, v


@triton.jit
def _online_softmax_step(
    q,
    k,
    v,
    visible,
    scale,
    soft_cap,
    running_max,
    running_sum,
    accumulator,
    IEEE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
):
    """Fold one key tile into the running (max, sum, unnormalised output); ``visible`` masks scores, which are
    first capped to ``soft_cap * tanh(score / soft_cap)`` when the layer has a cap (Gemma 2). Keys and values of
    an fp8 cache are converted to the query's dtype here (a no-op for a cache in that dtype)."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        scores = tl.dot(q, tl.trans(k)) * scale
    if HAS_SOFT_CAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp overflowing to inf gives 1, underflowing -1).
        scores = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / soft_cap) + 1.0))
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    correction = tl.exp(running_max - safe_max)
    weights = tl.exp(scores - safe_max[:, None])
    running_sum = running_sum * correction + tl.sum(weights, 1)
    if IEEE:
        accumulator = accumulator * correction[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
    else:
        accumulator = accumulator * correction[:, None] + tl.dot(weights.to(v.dtype), v)
    return new_max, running_sum, accumulator


@triton.jit
def _fold_sink(sinks, head, running_max, running_sum, accumulator):
    """Add each head's sink logit (gpt-oss) to the softmax's denominator: a key every query sees whose value is
    zero. Returns the sum and the output, both rescaled to the new maximum."""
    sink = tl.load(sinks + head).to(tl.float32)
    new_max = tl.maximum(running_max, sink)
    correction = tl.exp(running_max - new_max)
    return running_sum * correction + tl.exp(sink - new_max), accumulator * correction[:, None]


@triton.jit(do_not_specialize=["window", "soft_cap", "stride_bt"])
def _paged_attention_kernel(
    query,
    key_cache,
    value_cache,
    output,
    sinks,
    block_table,
    seq_lens,
    query_start,
    scale,
    window,
    soft_cap,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    request = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    first = tl.load(query_start + request)
    query_len = tl.load(query_start + request + 1) - first
    if tile * BLOCK_M >= query_len * GROUP:
        return
    seq_len = tl.load(seq_lens + request)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    query_index = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    valid = query_index < query_len
    positions = seq_len - query_len + query_index
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        query + (first + query_index)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    accumulator = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_position = seq_len - query_len + tl.minimum((tile + 1) * BLOCK_M // GROUP, query_len) - 1
    end_key = last_position + 1
    start_key = 0
    if HAS_WINDOW:
        first_position = seq_len - query_len + (tile * BLOCK_M) // GROUP
        start_key = (tl.maximum(first_position - window + 1, 0) // BLOCK_N) * BLOCK_N
    keys = tl.arange(0, BLOCK_N)
    for tile_start in range(start_key, end_key, BLOCK_N):
        key_positions = tile_start + keys
        in_context = key_positions < seq_len
        k, v = _load_key_tile(
            key_cache,
            value_cache,
            block_table + request * stride_bt,
            key_positions,
            in_context,
            kv_head,
            dims,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
        )
        visible = (key_positions[None, :] <= positions[:, None]) & in_context[None, :]
        if HAS_WINDOW:
            visible = visible & (key_positions[None, :] > positions[:, None] - window)
        running_max, running_sum, accumulator = _online_softmax_step(
            q,
            k,
            v,
            visible,
            scale,
            soft_cap,
            running_max,
            running_sum,
            accumulator,
            IEEE,
            HAS_SOFT_CAP,
        )
    if HAS_SINKS:
        running_sum, accumulator = _fold_sink(sinks, head, running_max, running_sum, accumulator)
    result = accumulator / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(
        output + (first + query_index)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        result.to(output.dtype.element_ty),
        mask=valid[:, None],
    )


@triton.jit(do_not_specialize=["window", "soft_cap", "stride_bt", "splits"])
def _decode_split_kernel(
    query,
    key_cache,
    value_cache,
    partial,
    partial_max,
    partial_sum,
    block_table,
    seq_lens,
    scale,
    window,
    soft_cap,
    splits,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
):
    """One (request, KV head, key range) of a decode step: an unnormalised partial softmax."""
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + request)
    rows = tl.arange(0, BLOCK_M)
    valid = rows < GROUP
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(query + request * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=valid[:, None], other=0.0)
    position = seq_len - 1
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(position - window + 1, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first_key, splits), BLOCK_N) * BLOCK_N
    low = first_key + split * per_split
    high = tl.minimum(low + per_split, seq_len)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    accumulator = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    keys = tl.arange(0, BLOCK_N)
    for tile_start in range(low, high, BLOCK_N):
        key_positions = tile_start + keys
        visible = (key_positions < high) & (key_positions >= first_key)
        k, v = _load_key_tile(
            key_cache,
            value_cache,
            block_table + request * stride_bt,
            key_positions,
            visible,
            kv_head,
            dims,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
        )
        running_max, running_sum, accumulator = _online_softmax_step(
            q,
            k,
            v,
            visible[None, :],
            scale,
            soft_cap,
            running_max,
            running_sum,
            accumulator,
            IEEE,
            HAS_SOFT_CAP,
        )
    slot = ((request * KV_HEADS + kv_head) * MAX_SPLITS + split) * BLOCK_M + rows
    tl.store(partial + slot[:, None] * HEAD_DIM + dims[None, :], accumulator, mask=valid[:, None])
    tl.store(partial_max + slot, running_max, mask=valid)
    tl.store(partial_sum + slot, running_sum, mask=valid)


@triton.jit(do_not_specialize=["splits"])
def _decode_merge_kernel(
    partial,
    partial_max,
    partial_sum,
    output,
    sinks,
    splits,
    stride_ot,
    stride_oh,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Merge one (request, query head)'s partial softmaxes into its attention output (and its sink logit)."""
    request = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    parts = tl.arange(0, MAX_SPLITS)
    used = parts < splits
    slot = ((request * KV_HEADS + kv_head) * MAX_SPLITS + parts) * BLOCK_M + head % GROUP
    maxima = tl.load(partial_max + slot, mask=used, other=float("-inf"))
    sums = tl.load(partial_sum + slot, mask=used, other=0.0)
    top = tl.max(maxima, 0)
    if HAS_SINKS:
        sink = tl.load(sinks + head).to(tl.float32)
        top = tl.maximum(top, sink)
    scale = tl.where(maxima == float("-inf"), 0.0, tl.exp(maxima - top))
    dims = tl.arange(0, HEAD_DIM)
    accumulators = tl.load(partial + slot[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None], other=0.0)
    total = tl.sum(sums * scale, 0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    result = tl.sum(accumulators * scale[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(output + request * stride_ot + head * stride_oh + dims, result.to(output.dtype.element_ty))


@triton.jit
def _round_to_float8(x):
    """``x`` (float32) rounded to nearest-even on float8_e4m3's grid, saturated at +-448, still as float32.

    The cast to the cache's float8 that follows is then exact. Rounding here rather than in the cast makes the
    result the same on every Triton backend and in the interpreter, whose float32 -> float8e4nv cast (Triton 3.9)
    drops the carry of a mantissa that rounds up into the next power of two (-0.486 becomes -0.25, not -0.5)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    magnitude = bits & 0x7FFFFFFF
    # Normal numbers (|x| >= 2^-6): three mantissa bits, ties to even; a carry moves into the exponent.
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -1048576
    # Subnormals: multiples of 2^-9, ties to even (adding and removing 2^23 rounds a float32 below it so).
    small = tl.abs(x) * 512.0
    subnormal = ((small + 8388608.0) - 8388608.0) * (1.0 / 512.0)
    rounded = tl.where(tl.abs(x) < 0.015625, subnormal.to(tl.int32, bitcast=True), normal)
    return (rounded | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_kv_kernel(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_slot,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    FLOAT8: tl.constexpr,
):
    """One token's keys and values into its cache slot (a negative slot is a padding row: skipped); rounded to
    float8 saturating at +-448 into an fp8 cache."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_HEADS)
        dims = tl.arange(0, HEAD_DIM)
        mask = (heads < KV_HEADS)[:, None]
        target = slot * stride_slot + heads[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(key + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(value + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        if FLOAT8:
            k = _round_to_float8(k.to(tl.float32)).to(key_cache.dtype.element_ty)
            v = _round_to_float8(v.to(tl.float32)).to(value_cache.dtype.element_ty)
        tl.store(key_cache + target, k, mask=mask)
        tl.store(value_cache + target, v, mask=mask)


class StoreKVKey(CompileKey, frozen=True):
    dtype: str
    num_kv_heads: int
    head_dim: int
    cache_dtype: str = ""
    """The cache's element type where it differs from ``dtype`` (``"float8_e4m3fn"``)."""


class StoreKVKernel(Kernel):
    """A step's new keys and values into the paged cache in one launch (two ``index_copy_`` and an index cast
    in torch); one instance per backend, warmed up for every layer shape."""

    name: ClassVar[str] = "weft_triton.store_kv"

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[AttentionLayer] = []
        self.dtypes: list[torch.dtype] = []
        self.cache_dtypes: list[torch.dtype | None] = [None]
        """The caches' element types (None: the activations' dtype), as :class:`PagedAttentionKernel` has them."""

    def dispatch(
        self, dtype: torch.dtype, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype | None = None
    ) -> StoreKVKey:
        return StoreKVKey(
            dtype=str(dtype).removeprefix("torch."),
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            cache_dtype=cache_dtype_name(dtype, cache_dtype),
        )

    def input_space(self) -> InputSpace | None:
        if not (self.layers and self.dtypes):
            return None
        shapes = list(dict.fromkeys((layer.num_kv_heads, layer.head_dim) for layer in self.layers))
        return (
            Choice("dtype", self.dtypes)
            * Choice("cache_dtype", self.cache_dtypes)
            * Zipped(num_kv_heads=[h for h, _ in shapes], head_dim=[d for _, d in shapes])
        )

    def compile(self, key: StoreKVKey) -> Any:
        if interpreting():
            return key
        dtype = getattr(torch, key.dtype)
        cache = getattr(torch, key.cache_dtype or key.dtype)
        row = key.num_kv_heads * key.head_dim
        return _store_kv_kernel.warmup(
            dtype,
            dtype,
            cache,
            cache,
            torch.int32,
            row,
            key.head_dim,
            row,
            key.head_dim,
            row,
            grid=(1,),
            **self._constants(key),
        )

    @staticmethod
    def _constants(key: StoreKVKey) -> dict[str, Any]:
        return dict(
            KV_HEADS=key.num_kv_heads,
            HEAD_DIM=key.head_dim,
            BLOCK_HEADS=triton.next_power_of_2(key.num_kv_heads),
            FLOAT8=key.cache_dtype.startswith("float8"),
        )

    def launch(
        self,
        compiled: Any,
        *,
        dtype: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        tokens = key.shape[0]
        if not tokens:
            return
        cache = kv_cache.view(2, -1, num_kv_heads, head_dim)
        _store_kv_kernel[(tokens,)](
            key,
            value,
            cache[0],
            cache[1],
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            cache.stride(1),
            **self._constants(self.dispatch(dtype, num_kv_heads, head_dim, cache_dtype)),
        )


class PagedAttentionKey(CompileKey, frozen=True):
    dtype: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    block_m: int
    has_window: bool
    split: bool = False
    """The two-kernel split-key decode path (:func:`decode_splits`)."""
    has_soft_cap: bool = False
    cache_dtype: str = ""
    """The cache's element type where it differs from ``dtype`` (``"float8_e4m3fn"``)."""
    has_sinks: bool = False


def cache_dtype_name(dtype: torch.dtype, cache_dtype: torch.dtype | None) -> str:
    """A compile key's ``cache_dtype``: empty for a cache in the activations' dtype."""
    return "" if cache_dtype is None or cache_dtype == dtype else str(cache_dtype).removeprefix("torch.")


class PagedAttentionKernel(Kernel):
    """The paged-attention kernel under the warm-up contract; one instance per backend."""

    name: ClassVar[str] = "weft_triton.paged_attention"

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[AttentionLayer] = []
        self.dtypes: list[torch.dtype] = []
        self.block_sizes: list[int] = []
        self.cache_dtypes: list[torch.dtype | None] = [None]
        """The caches' element types (None: the activations' dtype), from the specs the backend sized caches for."""

    def dispatch(
        self,
        dtype: torch.dtype,
        layer: AttentionLayer,
        block_size: int,
        block_m: int,
        splits: int = 1,
        cache_dtype: torch.dtype | None = None,
    ) -> PagedAttentionKey:
        return PagedAttentionKey(
            dtype=str(dtype).removeprefix("torch."),
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            block_size=block_size,
            block_m=block_m,
            has_window=layer.sliding_window is not None,
            split=splits > 1,
            has_soft_cap=layer.logits_soft_cap is not None,
            cache_dtype=cache_dtype_name(dtype, cache_dtype),
            has_sinks=layer.sinks,
        )

    def input_space(self) -> InputSpace | None:
        if not (self.layers and self.dtypes and self.block_sizes):
            return None
        return (
            Choice("dtype", self.dtypes)
            * Choice("cache_dtype", self.cache_dtypes)
            * Choice("layer", self.layers)
            * Choice("block_size", self.block_sizes)
            * Choice("block_m", (DECODE_BLOCK_M, PREFILL_BLOCK_M))
            * Choice("splits", (1, MAX_SPLITS))
        ).where(lambda block_m, splits: splits == 1 or block_m == DECODE_BLOCK_M)

    def compile(self, key: PagedAttentionKey) -> Any:
        if interpreting():
            return key
        dtype = getattr(torch, key.dtype)
        cache = getattr(torch, key.cache_dtype or key.dtype)
        heads, kv_heads, dim, block = key.num_heads, key.num_kv_heads, key.head_dim, key.block_size
        # The launch's signature with the runtime strides of contiguous query/output rows and of
        # the default cache layout; pointers are given as dtypes (16-byte aligned, as at runtime).
        if key.split:
            split = _decode_split_kernel.warmup(
                dtype,
                cache,
                cache,
                torch.float32,
                torch.float32,
                torch.float32,
                torch.int32,
                torch.int32,
                1.0,
                0,
                1.0,
                2,
                heads * dim,
                dim,
                block * kv_heads * dim,
                kv_heads * dim,
                dim,
                1,
                grid=(1,),
                **self._split_constants(key),
            )
            merge = _decode_merge_kernel.warmup(
                torch.float32,
                torch.float32,
                torch.float32,
                dtype,
                dtype,
                2,
                heads * dim,
                dim,
                grid=(1,),
                KV_HEADS=kv_heads,
                GROUP=heads // kv_heads,
                HEAD_DIM=dim,
                BLOCK_M=key.block_m,
                MAX_SPLITS=MAX_SPLITS,
                HAS_SINKS=key.has_sinks,
            )
            return split, merge
        return _paged_attention_kernel.warmup(
            dtype,
            cache,
            cache,
            dtype,
            dtype,
            torch.int32,
            torch.int32,
            torch.int32,
            1.0,
            0,
            1.0,
            heads * dim,
            dim,
            block * kv_heads * dim,
            kv_heads * dim,
            dim,
            heads * dim,
            dim,
            1,
            grid=(1,),
            **self._constants(key),
        )

    @staticmethod
    def _split_constants(key: PagedAttentionKey) -> dict[str, Any]:
        return dict(
            KV_HEADS=key.num_kv_heads,
            GROUP=key.num_heads // key.num_kv_heads,
            HEAD_DIM=key.head_dim,
            BLOCK_SIZE=key.block_size,
            BLOCK_M=key.block_m,
            BLOCK_N=BLOCK_N,
            MAX_SPLITS=MAX_SPLITS,
            HAS_WINDOW=key.has_window,
            IEEE=key.dtype == "float32",
            HAS_SOFT_CAP=key.has_soft_cap,
        )

    @staticmethod
    def _constants(key: PagedAttentionKey) -> dict[str, Any]:
        return dict(
            GROUP=key.num_heads // key.num_kv_heads,
            HEAD_DIM=key.head_dim,
            BLOCK_SIZE=key.block_size,
            BLOCK_M=key.block_m,
            BLOCK_N=BLOCK_N if key.block_m == DECODE_BLOCK_M else PREFILL_BLOCK_N,
            HAS_WINDOW=key.has_window,
            IEEE=key.dtype == "float32",
            HAS_SOFT_CAP=key.has_soft_cap,
            HAS_SINKS=key.has_sinks,
            num_stages=3 if key.block_m == DECODE_BLOCK_M else PREFILL_STAGES,
        )

    def launch(
        self,
        compiled: Any,
        *,
        dtype: torch.dtype,
        layer: AttentionLayer,
        block_size: int,
        block_m: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
        batch: AttentionBatch,
        splits: int = 1,
        cache_dtype: torch.dtype | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        key = self.dispatch(dtype, layer, block_size, block_m, splits, cache_dtype)
        # The sink logits in the activations' dtype (the warm-up's signature); a layer without them gets the
        # output as a pointer it never reads.
        sinks = output if sinks is None else sinks.to(output.dtype).contiguous()
        if key.split:
            self._launch_split(key, layer, splits, query, key_cache, value_cache, output, batch, sinks)
            return
        grid = (
            batch.seq_lens.shape[0],
            triton.cdiv(batch.max_query_len * (layer.num_heads // layer.num_kv_heads), block_m),
            layer.num_kv_heads,
        )
        _paged_attention_kernel[grid](
            query,
            key_cache,
            value_cache,
            output,
            sinks,
            batch.block_table,
            batch.seq_lens,
            batch.query_start,
            layer.scale,
            layer.sliding_window or 0,
            layer.logits_soft_cap or 1.0,
            query.stride(0),
            query.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            output.stride(0),
            output.stride(1),
            batch.block_table.stride(0),
            **self._constants(key),
        )

    def _launch_split(
        self,
        key: PagedAttentionKey,
        layer: AttentionLayer,
        splits: int,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        output: torch.Tensor,
        batch: AttentionBatch,
        sinks: torch.Tensor,
    ) -> None:
        requests, kv_heads = batch.seq_lens.shape[0], layer.num_kv_heads
        partial = torch.empty(
            requests, kv_heads, MAX_SPLITS, key.block_m, layer.head_dim, dtype=torch.float32, device=query.device
        )
        partial_max = torch.empty(requests, kv_heads, MAX_SPLITS, key.block_m, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
        _decode_split_kernel[(requests, kv_heads, splits)](
            query,
            key_cache,
            value_cache,
            partial,
            partial_max,
            partial_sum,
            batch.block_table,
            batch.seq_lens,
            layer.scale,
            layer.sliding_window or 0,
            layer.logits_soft_cap or 1.0,
            splits,
            query.stride(0),
            query.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            batch.block_table.stride(0),
            **self._split_constants(key),
        )
        _decode_merge_kernel[(requests, layer.num_heads)](
            partial,
            partial_max,
            partial_sum,
            output,
            sinks,
            splits,
            output.stride(0),
            output.stride(1),
            KV_HEADS=kv_heads,
            GROUP=layer.num_heads // kv_heads,
            HEAD_DIM=layer.head_dim,
            BLOCK_M=key.block_m,
            MAX_SPLITS=MAX_SPLITS,
            HAS_SINKS=key.has_sinks,
        )
