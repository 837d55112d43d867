"""One Triton kernel for a DeepSeek V4 layer's decode attention: per decoding row and block of heads, the
softmax over the row's window keys, its compressed entries (CSA: the indexer's picks; HCA: every visible one)
and the per-head sink, and the weighted sum of the same vectors (keys are the values), in fp32 with an online
softmax.

Keys and entries are read in place through slots into the flat caches (``[slots, head_dim]``): the ring's
slots of positions ``p - window + 1 .. p`` and the entry cache's slots of the row's entries, ``-1`` where a
key or an entry is masked (a position before 0, an entry not yet visible, a top-k pick of -1). Shared-KV MQA:
one tile of vectors is loaded once and scored against a block of heads; a tile with no valid slot is
skipped. Counts come from tensor shapes and masking from the slots, so a decode graph replays it as is.

The softmax starts from the sink (running max = sink, running sum = 1), which is the reference's
``softmax([logits, sink])[:-1]`` (:meth:`weft_dsv4.attention.DeepseekV4Attention._attend`). Everything is
fp32: the vectors are widened as they are loaded, and the dots are IEEE in an fp32 model, TF32 otherwise
(whose 10-bit mantissa holds a bf16 or fp16 operand exactly, so the scores are as exact as a bf16 dot's and
the weights are rounded less than the reference's cast to the activation dtype). Triton's interpreter has no
bf16 dot, so this also runs a bf16 model on the CPU.

Goes through core's warm-up contract with the activation dtype, head size and heads per block as its compile
key; every integer argument is unspecialised so that a warm-up compile serves any batch. Imported only where
Triton runs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from weft.kernels.warmup import CompileKey, InputSpace, Kernel, Zipped

BLOCK_HEADS = 16
"""Heads scored against one tile of keys (the smallest M of a tensor-core dot)."""


@triton.jit
def _fold_tile(
    q, source, slot_row, count, start, dims, dim_ok, scale, running_max, running_sum, accumulator,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    """Fold the vectors of slots ``start .. start + BLOCK_N`` of one row into the running softmax."""
    index = start + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_row + index, mask=index < count, other=-1)
    valid = slot >= 0
    if tl.max(valid.to(tl.int32), 0) > 0:
        vectors = tl.load(
            source + slot.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None] & dim_ok[None, :], other=0.0,
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


@triton.jit(do_not_specialize=[
    "heads", "window_count", "window_stride", "entry_count", "entry_stride", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
])
def _decode_attention_kernel(
    query, rows, output, sinks, ring, window_slots, entries, entry_slots,
    heads, window_count, window_stride, entry_count, entry_stride, scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    number = tl.program_id(0)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = head < heads
    dims = tl.arange(0, PADDED_DIM)
    dim_ok = dims < HEAD_DIM
    row = tl.load(rows + number).to(tl.int64)
    tile = head_ok[:, None] & dim_ok[None, :]
    q = tl.load(query + row * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=tile, other=0.0).to(tl.float32)
    running_max = tl.load(sinks + head, mask=head_ok, other=0.0).to(tl.float32)
    running_sum = tl.full([BLOCK_H], 1.0, tl.float32)
    accumulator = tl.zeros([BLOCK_H, PADDED_DIM], tl.float32)
    window_row = window_slots + number.to(tl.int64) * window_stride
    for start in range(0, window_count, BLOCK_N):
        running_max, running_sum, accumulator = _fold_tile(
            q, ring, window_row, window_count, start, dims, dim_ok, scale, running_max, running_sum, accumulator,
            HEAD_DIM, BLOCK_N, IEEE,
        )
    entry_row = entry_slots + number.to(tl.int64) * entry_stride
    for start in range(0, entry_count, BLOCK_N):
        running_max, running_sum, accumulator = _fold_tile(
            q, entries, entry_row, entry_count, start, dims, dim_ok, scale, running_max, running_sum, accumulator,
            HEAD_DIM, BLOCK_N, IEEE,
        )
    result = accumulator / running_sum[:, None]
    tl.store(output + row * stride_ot + head[:, None] * stride_oh + dims[None, :], result.to(output.dtype.element_ty), mask=tile)


class DecodeAttentionKey(CompileKey, frozen=True):
    dtype: str
    head_dim: int
    block_heads: int


class DecodeAttentionKernel(Kernel):
    """Writes ``output[rows]`` ``[rows, heads, head_dim]``: the attention of ``query[rows]`` over the vectors
    of ``ring`` at ``window_slots`` ``[rows, window]`` and of ``entries`` at ``entry_slots`` ``[rows, k]``
    (``-1``: masked; no entries on a sliding layer), with the fp32 ``sinks`` ``[heads]``."""

    name: ClassVar[str] = "weft_dsv4.decode_attention"

    def __init__(self, block_heads: int = BLOCK_HEADS) -> None:
        super().__init__()
        self.block_heads = block_heads
        self.shapes: list[tuple[torch.dtype, int]] = []

    def add(self, dtype: torch.dtype, head_dim: int) -> None:
        """A model launches it in activation dtype ``dtype`` on heads of ``head_dim``."""
        if (dtype, head_dim) not in self.shapes:
            self.shapes.append((dtype, head_dim))

    def dispatch(
        self, query: torch.Tensor | None = None, dtype: torch.dtype | None = None, head_dim: int | None = None,
    ) -> DecodeAttentionKey:
        if query is not None:
            dtype, head_dim = query.dtype, query.shape[-1]
        return DecodeAttentionKey(dtype=str(dtype).removeprefix("torch."), head_dim=head_dim, block_heads=self.block_heads)

    def input_space(self) -> InputSpace | None:
        if not self.shapes:
            return None
        return Zipped(dtype=[dtype for dtype, _ in self.shapes], head_dim=[head_dim for _, head_dim in self.shapes])

    def compile(self, key: DecodeAttentionKey) -> Any:
        from weft_triton.runtime import interpreting

        if interpreting():
            return key
        dtype = getattr(torch, key.dtype)
        # Pointers as dtypes (16-byte aligned, as at runtime); the integers are unspecialised, any value serves.
        return _decode_attention_kernel.warmup(
            dtype, torch.int64, dtype, torch.float32, dtype, torch.int64, dtype, torch.int64,
            1, 1, 1, 1, 1, 1.0, 1, 1, 1, 1,
            grid=(1,), **_constants(key),
        )

    def launch(
        self, compiled: Any, *, query: torch.Tensor, rows: torch.Tensor, sinks: torch.Tensor, ring: torch.Tensor,
        window_slots: torch.Tensor, output: torch.Tensor, scale: float,
        entries: torch.Tensor | None = None, entry_slots: torch.Tensor | None = None,
    ) -> None:
        heads, head_dim = query.shape[1], query.shape[2]
        if query.stride(2) != 1 or output.stride(2) != 1 or output.dtype != query.dtype:
            raise ValueError(f"decode attention needs query and output of one dtype with unit-stride heads, got {query.dtype} "
                             f"strides {query.stride()} and {output.dtype} strides {output.stride()}")
        for name, index in (("rows", rows), ("window_slots", window_slots), ("entry_slots", entry_slots)):
            if index is not None and index.dtype != torch.int64:
                raise ValueError(f"decode attention takes {name} as int64 (the compiled variants' type), got {index.dtype}")
        if entries is None:  # a sliding layer: no entries, the window's slots stand in as an empty row
            entries, entry_slots, entry_count = ring, window_slots, 0
        else:
            entry_count = entry_slots.shape[1]
        for name, source in (("ring", ring), ("entries", entries)):
            if source.dtype != query.dtype or tuple(source.stride()) != (head_dim, 1):
                raise ValueError(f"decode attention reads {name} as contiguous [slots, {head_dim}] rows of {query.dtype}, "
                                 f"got {source.dtype} of shape {tuple(source.shape)}, strides {source.stride()}")
        if rows.shape[0] == 0:
            return
        key = self.dispatch(query)
        _decode_attention_kernel[(rows.shape[0], triton.cdiv(heads, key.block_heads))](
            query, rows, output, sinks, ring, window_slots, entries, entry_slots,
            heads, window_slots.shape[1], window_slots.stride(0), entry_count, entry_slots.stride(0), scale,
            query.stride(0), query.stride(1), output.stride(0), output.stride(1),
            **_constants(key),
        )


def _constants(key: DecodeAttentionKey) -> dict[str, Any]:
    padded = triton.next_power_of_2(key.head_dim)
    return dict(
        HEAD_DIM=key.head_dim, PADDED_DIM=padded, BLOCK_H=key.block_heads, BLOCK_N=32 if padded <= 256 else 16,
        IEEE=key.dtype == "float32",
        num_warps=8 if padded >= 256 else 4,
    )
