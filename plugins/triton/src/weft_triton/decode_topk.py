"""The decode block top-k (reference: ``weft.builtins.decode_topk``) as one Triton kernel, for any launch geometry.

Each block's score becomes one int64 sort key: the float's bits mapped to a signed integer in
score order (NaN first replaced by -1e30, -0.0 by +0.0), shifted up 32 bits, with
``0xFFFFFFFF - block_id`` below so that equal scores put the smaller block first. Blocks a
row may not see get the smallest key. Keys are unique, so "the largest ``topk`` keys, in
descending order" is the op's output exactly, whichever way the work is split.

Grid: ``(heads * total_q, chunks)``, fixed for a given shape (graph-safe). A row's visible
blocks are cut into ``chunks`` equal spans (a multiple of the tile); the CTA of a span sorts its
first tile of ``BLOCK`` keys and folds in each further tile: the tile sorted ascending against
the running best sorted descending, element-wise maximum, sorted again (a bitonic merge: the
maxima are the best ``BLOCK`` of both). CTAs whose span starts past the row's visible
blocks exit at once. With one busy span its CTA writes the output; otherwise each busy CTA
leaves its best ``TOPK_PAD`` keys in a workspace and increments the row's completion counter,
and the last to arrive merges the candidates, writes the output and sets the counter back to
zero, so a CUDA/HIP-graph replay starts from the same state and gives the same result.

The geometry comes from :func:`weft_triton.decode_topk_policy.decode_topk_launch`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weft_triton.decode_topk_policy import DecodeTopKLaunch, ceil_power_of_two

INT64_MIN = -9223372036854775807 - 1


@triton.jit
def _sort_keys(scores_row, offsets, end):
    valid = offsets < end
    x = tl.load(scores_row + offsets, mask=valid, other=0.0).to(tl.float32)
    x = tl.where(x != x, -1e30, x)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0: one bit pattern for both
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    keys = (ordered.to(tl.int64) << 32) | (4294967295 - offsets.to(tl.int64))
    return tl.where(valid, keys, -9223372036854775807 - 1)


@triton.jit
def _write_output(output_row, keys, positions, topk, visible):
    ids = (4294967295 - (keys & 4294967295)).to(tl.int32)
    ids = tl.where(positions < visible, ids, -1)
    tl.store(output_row + positions, ids, mask=positions < topk)


@triton.jit
def _decode_topk_kernel(
    scores,
    seq_lens,
    output,
    workspace,
    counters,
    total_q,
    decode_query_len,
    block_size,
    max_block,
    topk,
    span,
    stride_sh,
    stride_sq,
    stride_oh,
    stride_oq,
    BLOCK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    head = row // total_q
    query = row % total_q
    seq_len = tl.load(seq_lens + query // decode_query_len).to(tl.int64)
    position = seq_len - decode_query_len + query % decode_query_len
    visible = tl.minimum((tl.maximum(position + 1, 0) + block_size - 1) // block_size, max_block)
    busy = tl.maximum((visible + span - 1) // span, 1)
    if chunk >= busy:
        return
    scores_row = scores + head * stride_sh + query * stride_sq
    output_row = output + head * stride_oh + query * stride_oq
    lanes = tl.arange(0, BLOCK)
    low = chunk * span
    high = tl.minimum(low + span, visible)
    best = tl.sort(_sort_keys(scores_row, low + lanes, high), descending=True)
    for start in range(low + BLOCK, high, BLOCK):
        tile = tl.sort(_sort_keys(scores_row, start + lanes, high))
        best = tl.sort(tl.maximum(best, tile), descending=True)
    if busy == 1:
        _write_output(output_row, best, lanes, topk, visible)
    else:
        candidates = workspace + (row * CHUNKS + chunk) * TOPK_PAD
        tl.store(candidates + lanes, best, mask=lanes < TOPK_PAD)
        arrived = tl.atomic_add(counters + row, 1, sem="acq_rel")
        if arrived == busy - 1:
            slots = tl.arange(0, CHUNKS * TOPK_PAD)
            merged = tl.load(
                workspace + row * CHUNKS * TOPK_PAD + slots,
                mask=slots // TOPK_PAD < busy,
                other=-9223372036854775807 - 1,
                volatile=True,
            )
            merged = tl.sort(merged, descending=True)
            _write_output(output_row, merged, slots, topk, visible)
            tl.atomic_xchg(counters + row, 0, sem="acq_rel")


def chunk_span(capacity: int, launch: DecodeTopKLaunch) -> int:
    """Blocks per chunk: the capacity over the chunks, rounded up to whole tiles."""
    per_chunk = -(-max(capacity, 1) // launch.chunks)
    return -(-per_chunk // launch.block) * launch.block


class DecodeTopKLauncher:
    """Launches the kernel; keeps its workspace and completion counters between launches.

    Grow the buffers outside graph capture (the first launch of a shape does): a captured launch
    must find them allocated. A grown buffer replaces the old one for later launches, but the old one
    is kept: a graph captured before holds its address and replays into it (graphs are captured
    largest batch first, yet the workspace a launch needs, rows times chunks, need not fall with the
    rows once the policy picks fewer chunks for more rows). A buffer grows to at least twice its size, so
    those kept hold at most as much as the one in use. The counters are zero between launches.
    """

    def __init__(self) -> None:
        self.workspace: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None
        self._superseded: list[torch.Tensor] = []
        """Buffers grown out of, alive for the graphs captured over them."""

    def _buffers(
        self, rows: int, chunks: int, topk_pad: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.workspace = self._grown(self.workspace, rows * chunks * topk_pad, torch.int64, device)
        self.counters = self._grown(self.counters, rows, torch.int32, device)
        return self.workspace, self.counters

    def _grown(self, buffer: torch.Tensor | None, need: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``buffer`` if it holds ``need`` elements on ``device``, else a zeroed one at least twice as large
        (the old one kept alive, see the class)."""
        if buffer is not None and buffer.device == device and buffer.numel() >= need:
            return buffer
        if buffer is not None and buffer.device == device:
            self._superseded.append(buffer)
            need = max(need, 2 * buffer.numel())
        return torch.zeros(need, dtype=dtype, device=device)

    def __call__(
        self,
        scores: torch.Tensor,
        seq_lens: torch.Tensor,
        decode_query_len: int,
        block_size: int,
        topk: int,
        launch: DecodeTopKLaunch,
    ) -> torch.Tensor:
        """The op's output for inputs already checked (``weft.builtins.decode_topk.check_inputs``)."""
        heads, total_q, max_block = scores.shape
        topk_pad = ceil_power_of_two(topk)
        if launch.block < topk_pad or launch.block & (launch.block - 1) or launch.chunks & (launch.chunks - 1):
            raise ValueError(
                f"decode_topk launch {launch}: block and chunks must be powers of two and the block must hold "
                f"topk ({topk}) rounded up to a power of two ({topk_pad})"
            )
        output = torch.empty((heads, total_q, topk), dtype=torch.int32, device=scores.device)
        rows = heads * total_q
        if rows == 0:
            return output
        scores = scores if scores.stride(-1) == 1 else scores.contiguous()
        workspace, counters = self._buffers(rows, launch.chunks, topk_pad, scores.device)
        _decode_topk_kernel[(rows, launch.chunks)](
            scores,
            seq_lens,
            output,
            workspace,
            counters,
            total_q,
            decode_query_len,
            block_size,
            max_block,
            topk,
            chunk_span(max_block, launch),
            scores.stride(0),
            scores.stride(1),
            output.stride(0),
            output.stride(1),
            BLOCK=launch.block,
            TOPK_PAD=topk_pad,
            CHUNKS=launch.chunks,
            num_warps=launch.warps,
            num_stages=launch.stages,
        )
        return output
