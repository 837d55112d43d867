"""Two Triton kernels for a DeepSeek V4 layer's attention, decode and prefill: per query row and block of heads,
the softmax over the row's window keys, its compressed entries (CSA: the indexer's picks; HCA: every visible one)
and the per-head sink, and the weighted sum of the same vectors (keys are the values), in fp32 with an online
softmax.

Decode reads keys and entries in place through slots into the flat caches (``[slots, head_dim]``): the ring's
slots of positions ``p - window + 1 .. p`` and the entry cache's slots of the row's entries, ``-1`` where a
key or an entry is masked (a position before 0, an entry not yet visible, a top-k pick of -1). Counts come
from tensor shapes and masking from the slots, so a decode graph replays it as is.

Prefill reads the step's padded batch (:class:`weft_dsv4.step.PrefillBatch`): each request's window keys
``[requests, keys, head_dim]``, of which a query at position ``p`` sees the contiguous run of positions
``p - window + 1 .. p``; HCA: each request's entries ``[requests, entries, head_dim]``, of which it sees the
first ``(p + 1) // ratio``; CSA: the same entries through its row of top-k picks (``-1``: masked). The masks
are computed from the positions, not read: they are the einsum path's ``window_bias`` and entry bias. One
program per real query, so the batch's padding costs nothing.

Shared-KV MQA: one tile of vectors is loaded once and scored against a block of heads; a tile with no valid
vector is skipped. The softmax starts from the sink (running max = sink, running sum = 1), which is the
reference's ``softmax([logits, sink])[:-1]`` (:meth:`weft_dsv4.attention.DeepseekV4Attention._attend`).
Everything is fp32: the vectors are widened as they are loaded, and the dots are IEEE in an fp32 model, TF32
otherwise (whose 10-bit mantissa holds a bf16 or fp16 operand exactly, so the scores are as exact as a bf16
dot's and the weights are rounded less than the reference's cast to the activation dtype). Triton's
interpreter has no bf16 dot, so this also runs a bf16 model on the CPU.

Both go through core's warm-up contract with the activation dtype, head size and heads per block as their
compile key; every integer argument is unspecialised so that a warm-up compile serves any batch, any prompt
length and any layer kind. Imported only where Triton runs.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from weft.api import CompileKey, InputSpace, Kernel, Zipped

BLOCK_HEADS = 16
"""Heads scored against one tile of keys (the smallest M of a tensor-core dot)."""


@triton.jit
def _fold(
    q,
    source,
    index,
    valid,
    dims,
    dim_ok,
    scale,
    running_max,
    running_sum,
    accumulator,
    HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Fold the vectors ``source[index]`` where ``valid`` into the running softmax; a tile with none is skipped."""
    if tl.max(valid.to(tl.int32), 0) > 0:
        vectors = tl.load(
            source + index.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :],
            mask=valid[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        if IEEE:
            scores = tl.dot(q, tl.trans(vectors), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(vectors))
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))  # finite: the running max starts at the sink
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, 1)
        if IEEE:
            update = tl.dot(weights, vectors, input_precision="ieee")
        else:
            update = tl.dot(weights, vectors)
        accumulator = accumulator * correction[:, None] + update
        running_max = new_max
    return running_max, running_sum, accumulator


@triton.jit
def _fold_slots(
    q,
    source,
    slot_row,
    count,
    start,
    dims,
    dim_ok,
    scale,
    running_max,
    running_sum,
    accumulator,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Fold the vectors at slots ``start .. start + BLOCK_N`` of one row of slots (``-1``: masked)."""
    index = start + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_row + index, mask=index < count, other=-1)
    return _fold(q, source, slot, slot >= 0, dims, dim_ok, scale, running_max, running_sum, accumulator, HEAD_DIM, IEEE)


@triton.jit
def _fold_run(
    q,
    source,
    start,
    end,
    dims,
    dim_ok,
    scale,
    running_max,
    running_sum,
    accumulator,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Fold the vectors ``start .. start + BLOCK_N`` of ``source``, those before ``end``."""
    index = start + tl.arange(0, BLOCK_N)
    return _fold(
        q, source, index, index < end, dims, dim_ok, scale, running_max, running_sum, accumulator, HEAD_DIM, IEEE
    )


@triton.jit
def _open_row(
    query,
    row,
    sinks,
    heads,
    stride_qt,
    stride_qh,
    HEAD_DIM: tl.constexpr,
    PADDED_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """This program's block of heads of query ``row`` (fp32), and a softmax started from their sinks."""
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = head < heads
    dims = tl.arange(0, PADDED_DIM)
    dim_ok = dims < HEAD_DIM
    tile = head_ok[:, None] & dim_ok[None, :]
    q = tl.load(query + row * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=tile, other=0.0).to(
        tl.float32
    )
    running_max = tl.load(sinks + head, mask=head_ok, other=0.0).to(tl.float32)
    running_sum = tl.full([BLOCK_H], 1.0, tl.float32)
    accumulator = tl.zeros([BLOCK_H, PADDED_DIM], tl.float32)
    return q, dims, dim_ok, running_max, running_sum, accumulator


@triton.jit
def _close_row(
    output,
    row,
    running_sum,
    accumulator,
    heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    PADDED_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Store the weighted sum of this program's block of heads at ``row`` of ``output``."""
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, PADDED_DIM)
    tile = (head < heads)[:, None] & (dims < HEAD_DIM)[None, :]
    result = accumulator / running_sum[:, None]
    tl.store(
        output + row * stride_ot + head[:, None] * stride_oh + dims[None, :],
        result.to(output.dtype.element_ty),
        mask=tile,
    )


@triton.jit(
    do_not_specialize=[
        "heads",
        "window_count",
        "window_stride",
        "entry_count",
        "entry_stride",
        "stride_qt",
        "stride_qh",
        "stride_ot",
        "stride_oh",
    ]
)
def _decode_attention_kernel(
    query,
    rows,
    output,
    sinks,
    ring,
    window_slots,
    entries,
    entry_slots,
    heads,
    window_count,
    window_stride,
    entry_count,
    entry_stride,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    PADDED_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    number = tl.program_id(0)
    row = tl.load(rows + number).to(tl.int64)
    q, dims, dim_ok, running_max, running_sum, accumulator = _open_row(
        query,
        row,
        sinks,
        heads,
        stride_qt,
        stride_qh,
        HEAD_DIM,
        PADDED_DIM,
        BLOCK_H,
    )
    window_row = window_slots + number.to(tl.int64) * window_stride
    for start in range(0, window_count, BLOCK_N):
        running_max, running_sum, accumulator = _fold_slots(
            q,
            ring,
            window_row,
            window_count,
            start,
            dims,
            dim_ok,
            scale,
            running_max,
            running_sum,
            accumulator,
            HEAD_DIM,
            BLOCK_N,
            IEEE,
        )
    entry_row = entry_slots + number.to(tl.int64) * entry_stride
    for start in range(0, entry_count, BLOCK_N):
        running_max, running_sum, accumulator = _fold_slots(
            q,
            entries,
            entry_row,
            entry_count,
            start,
            dims,
            dim_ok,
            scale,
            running_max,
            running_sum,
            accumulator,
            HEAD_DIM,
            BLOCK_N,
            IEEE,
        )
    _close_row(output, row, running_sum, accumulator, heads, stride_ot, stride_oh, HEAD_DIM, PADDED_DIM, BLOCK_H)


@triton.jit(
    do_not_specialize=[
        "heads",
        "rows",
        "window",
        "key_stride",
        "entry_count",
        "entry_stride",
        "ratio",
        "pick_count",
        "pick_stride",
        "stride_qt",
        "stride_qh",
        "stride_ot",
        "stride_oh",
    ]
)
def _prefill_attention_kernel(
    query,
    queries,
    query_rows,
    output,
    sinks,
    firsts,
    ends,
    keys,
    entries,
    picks,
    heads,
    rows,
    window,
    key_stride,
    entry_count,
    entry_stride,
    ratio,
    pick_count,
    pick_stride,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    PADDED_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    padded = tl.load(queries + tl.program_id(0)).to(tl.int64)  # request * rows + column of the padded batch
    request = padded // rows
    position = tl.load(ends + request).to(tl.int64) - rows + padded % rows  # padding comes first
    first = tl.load(firsts + request).to(tl.int64)
    row = tl.load(query_rows + padded).to(tl.int64)
    q, dims, dim_ok, running_max, running_sum, accumulator = _open_row(
        query,
        row,
        sinks,
        heads,
        stride_qt,
        stride_qh,
        HEAD_DIM,
        PADDED_DIM,
        BLOCK_H,
    )
    # Key j of the request is position first + j: the window is keys low .. position - first.
    key_row = keys + request * key_stride
    low = (tl.maximum(position - window + 1, first) - first).to(tl.int32)
    high = (position + 1 - first).to(tl.int32)
    for start in range(low, high, BLOCK_N):
        running_max, running_sum, accumulator = _fold_run(
            q,
            key_row,
            start,
            high,
            dims,
            dim_ok,
            scale,
            running_max,
            running_sum,
            accumulator,
            HEAD_DIM,
            BLOCK_N,
            IEEE,
        )
    entry_row = entries + request * entry_stride
    visible = tl.minimum((position + 1) // ratio, entry_count).to(tl.int32)  # HCA; 0 on CSA and sliding layers
    for start in range(0, visible, BLOCK_N):
        running_max, running_sum, accumulator = _fold_run(
            q,
            entry_row,
            start,
            visible,
            dims,
            dim_ok,
            scale,
            running_max,
            running_sum,
            accumulator,
            HEAD_DIM,
            BLOCK_N,
            IEEE,
        )
    pick_row = picks + padded * pick_stride
    for start in range(0, pick_count, BLOCK_N):  # CSA; none elsewhere
        running_max, running_sum, accumulator = _fold_slots(
            q,
            entry_row,
            pick_row,
            pick_count,
            start,
            dims,
            dim_ok,
            scale,
            running_max,
            running_sum,
            accumulator,
            HEAD_DIM,
            BLOCK_N,
            IEEE,
        )
    _close_row(output, row, running_sum, accumulator, heads, stride_ot, stride_oh, HEAD_DIM, PADDED_DIM, BLOCK_H)


class AttentionKey(CompileKey, frozen=True):
    dtype: str
    head_dim: int
    block_heads: int


class SharedKVAttentionKernel(Kernel):
    """What the decode and prefill kernels share: the compile key and the shapes a model declares."""

    def __init__(self, block_heads: int = BLOCK_HEADS) -> None:
        super().__init__()
        self.block_heads = block_heads
        self.shapes: list[tuple[torch.dtype, int]] = []

    def add(self, dtype: torch.dtype, head_dim: int) -> None:
        """A model launches it in activation dtype ``dtype`` on heads of ``head_dim``."""
        if (dtype, head_dim) not in self.shapes:
            self.shapes.append((dtype, head_dim))

    def dispatch(
        self,
        query: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        head_dim: int | None = None,
    ) -> AttentionKey:
        if query is not None:
            dtype, head_dim = query.dtype, query.shape[-1]
        return AttentionKey(dtype=str(dtype).removeprefix("torch."), head_dim=head_dim, block_heads=self.block_heads)

    def input_space(self) -> InputSpace | None:
        if not self.shapes:
            return None
        return Zipped(dtype=[dtype for dtype, _ in self.shapes], head_dim=[head_dim for _, head_dim in self.shapes])

    @abstractmethod
    def warmup_launch(self, dtype: torch.dtype) -> tuple[Any, tuple[Any, ...]]:
        """The Triton function and the arguments warm-up compiles it for in activation dtype ``dtype``: pointers as
        dtypes (16-byte aligned, as at runtime); the integers are unspecialised, so any value serves."""

    def compile(self, key: AttentionKey) -> Any:
        from weft_triton.runtime import interpreting

        if interpreting():
            return key
        function, arguments = self.warmup_launch(getattr(torch, key.dtype))
        return function.warmup(*arguments, grid=(1,), **_constants(key))

    def check(
        self,
        query: torch.Tensor,
        output: torch.Tensor,
        sources: dict[str, torch.Tensor],
        indices: dict[str, torch.Tensor | None],
    ) -> None:
        """Refuse operands the compiled variants cannot read: the dtypes and unit strides they were built for."""
        head_dim = query.shape[-1]
        if query.stride(-1) != 1 or output.stride(-1) != 1 or output.dtype != query.dtype:
            raise ValueError(
                f"{self.name} needs query and output of one dtype with unit-stride heads, got {query.dtype} "
                f"strides {query.stride()} and {output.dtype} strides {output.stride()}"
            )
        for name, index in indices.items():
            if index is not None and index.dtype != torch.int64:
                raise ValueError(f"{self.name} takes {name} as int64 (the compiled variants' type), got {index.dtype}")
        for name, source in sources.items():
            if source.dtype != query.dtype or tuple(source.stride()[-2:]) != (head_dim, 1):
                raise ValueError(
                    f"{self.name} reads {name} as contiguous rows of {head_dim} {query.dtype}, got "
                    f"{source.dtype} of shape {tuple(source.shape)}, strides {source.stride()}"
                )


class DecodeAttentionKernel(SharedKVAttentionKernel):
    """Writes ``output[rows]`` ``[rows, heads, head_dim]``: the attention of ``query[rows]`` over the vectors
    of ``ring`` at ``window_slots`` ``[rows, window]`` and of ``entries`` at ``entry_slots`` ``[rows, k]``
    (``-1``: masked; no entries on a sliding layer), with the fp32 ``sinks`` ``[heads]``."""

    name: ClassVar[str] = "weft_dsv4.decode_attention"

    def warmup_launch(self, dtype: torch.dtype) -> tuple[Any, tuple[Any, ...]]:
        return _decode_attention_kernel, (
            dtype,
            torch.int64,
            dtype,
            torch.float32,
            dtype,
            torch.int64,
            dtype,
            torch.int64,
            1,
            1,
            1,
            1,
            1,
            1.0,
            1,
            1,
            1,
            1,
        )

    def launch(
        self,
        compiled: Any,
        *,
        query: torch.Tensor,
        rows: torch.Tensor,
        sinks: torch.Tensor,
        ring: torch.Tensor,
        window_slots: torch.Tensor,
        output: torch.Tensor,
        scale: float,
        entries: torch.Tensor | None = None,
        entry_slots: torch.Tensor | None = None,
    ) -> None:
        if entries is None:  # a sliding layer: no entries, the window's slots stand in as an empty row
            entries, entry_slots, entry_count = ring, window_slots, 0
        else:
            entry_count = entry_slots.shape[1]
        self.check(
            query,
            output,
            {"ring": ring, "entries": entries},
            {"rows": rows, "window_slots": window_slots, "entry_slots": entry_slots},
        )
        if rows.shape[0] == 0:
            return
        key = self.dispatch(query)
        _decode_attention_kernel[(rows.shape[0], triton.cdiv(query.shape[1], key.block_heads))](
            query,
            rows,
            output,
            sinks,
            ring,
            window_slots,
            entries,
            entry_slots,
            query.shape[1],
            window_slots.shape[1],
            window_slots.stride(0),
            entry_count,
            entry_slots.stride(0),
            scale,
            query.stride(0),
            query.stride(1),
            output.stride(0),
            output.stride(1),
            **_constants(key),
        )


class PrefillAttentionKernel(SharedKVAttentionKernel):
    """Writes the step's prefilling rows of ``output`` ``[tokens, heads, head_dim]``: for each real query of the
    padded batch, ``queries`` (its index ``request * rows + column`` into ``query_rows`` ``[requests, rows]``, the
    step row of each padded query; padding first, so column ``c`` is position ``ends[request] - rows + c``), the
    attention of ``query`` at its row over the window keys ``keys`` ``[requests, keys, head_dim]`` (key ``j`` is
    position ``firsts[request] + j``; it sees the last ``window`` positions up to its own) and, on a compressed
    layer, over ``entries`` ``[requests, entries, head_dim]``: HCA the first ``(position + 1) // ratio``; CSA,
    with ``picks`` ``[requests, rows, k]``, the entries its row picks (``-1``: masked); with the fp32 ``sinks``."""

    name: ClassVar[str] = "weft_dsv4.prefill_attention"

    def warmup_launch(self, dtype: torch.dtype) -> tuple[Any, tuple[Any, ...]]:
        return _prefill_attention_kernel, (
            dtype,
            torch.int64,
            torch.int64,
            dtype,
            torch.float32,
            torch.int64,
            torch.int64,
            dtype,
            dtype,
            torch.int64,
            1,
            1,
            1,
            1,
            1,
            1,
            1,
            1,
            1,
            1.0,
            1,
            1,
            1,
            1,
        )

    def launch(
        self,
        compiled: Any,
        *,
        query: torch.Tensor,
        output: torch.Tensor,
        sinks: torch.Tensor,
        queries: torch.Tensor,
        query_rows: torch.Tensor,
        firsts: torch.Tensor,
        ends: torch.Tensor,
        keys: torch.Tensor,
        window: int,
        scale: float,
        entries: torch.Tensor | None = None,
        ratio: int = 1,
        picks: torch.Tensor | None = None,
    ) -> None:
        requests, rows = query_rows.shape
        if tuple(query_rows.stride()) != (rows, 1) or (picks is not None and not picks.is_contiguous()):
            raise ValueError(
                f"{self.name} indexes query_rows and picks as contiguous [requests, rows(, k)], got strides "
                f"{query_rows.stride()} and {None if picks is None else picks.stride()}"
            )
        entry_count = entries.shape[1] if entries is not None and picks is None else 0  # entries read in order: HCA's
        entries = keys if entries is None else entries  # a sliding layer reads none: the keys stand in
        pick_count = picks.shape[-1] if picks is not None else 0
        picks = queries if picks is None else picks
        self.check(
            query,
            output,
            {"keys": keys, "entries": entries},
            {"queries": queries, "query_rows": query_rows, "firsts": firsts, "ends": ends, "picks": picks},
        )
        if queries.shape[0] == 0:
            return
        key = self.dispatch(query)
        _prefill_attention_kernel[(queries.shape[0], triton.cdiv(query.shape[1], key.block_heads))](
            query,
            queries,
            query_rows,
            output,
            sinks,
            firsts,
            ends,
            keys,
            entries,
            picks,
            query.shape[1],
            rows,
            window,
            keys.stride(0),
            entry_count,
            entries.stride(0),
            ratio,
            pick_count,
            pick_count,
            scale,
            query.stride(0),
            query.stride(1),
            output.stride(0),
            output.stride(1),
            **_constants(key),
        )


def _constants(key: AttentionKey) -> dict[str, Any]:
    padded = triton.next_power_of_2(key.head_dim)
    return dict(
        HEAD_DIM=key.head_dim,
        PADDED_DIM=padded,
        BLOCK_H=key.block_heads,
        BLOCK_N=32 if padded <= 256 else 16,
        IEEE=key.dtype == "float32",
        num_warps=8 if padded >= 256 else 4,
    )
