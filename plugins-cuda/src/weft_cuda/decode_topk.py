"""``decode_topk.triton``: the decode block top-k (reference: ``weft.builtins.decode_topk``) as one Triton kernel.

Each block's score becomes one int64 sort key: the float's bits mapped to a signed integer in
score order (NaN first replaced by -1e30, -0.0 by +0.0), shifted up 32 bits, with
``0xFFFFFFFF - block_id`` below so that equal scores put the smaller block first. Blocks a
row may not see get the smallest key. Sorting keys descending gives the op's order exactly.

Grid: ``(heads * total_q, chunks)``, fixed for a given shape. A program sorts one chunk of one
row. Programs whose chunk lies past the row's visible blocks exit at once. With one busy
chunk the program writes the row's output; otherwise each busy program leaves its best
``topk`` keys in a workspace and increments the row's completion counter, and the last to
arrive merges the candidates, writes the output and sets the counter back to zero, so a
CUDA-graph replay starts from the same state and gives the same result.

Runs on NVIDIA GPUs, and on the CPU under ``TRITON_INTERPRET=1`` for tests.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import triton
import triton.language as tl

from weft.contracts.ops import OpImplementation
from weft.builtins.decode_topk import check_inputs

MAX_CHUNKS = 16
MIN_CHUNK = 128


@triton.jit
def _sort_keys(scores_row, offsets, visible):
    valid = offsets < visible
    x = tl.load(scores_row + offsets, mask=valid, other=0.0).to(tl.float32)
    x = tl.where(x != x, -1e30, x) + 0.0
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
    scores, seq_lens, output, workspace, counters,
    total_q, decode_query_len, block_size, max_block, topk,
    stride_sh, stride_sq, stride_oh, stride_oq,
    CHUNK: tl.constexpr, TOPK_PAD: tl.constexpr, CHUNKS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    head = row // total_q
    query = row % total_q
    seq_len = tl.load(seq_lens + query // decode_query_len).to(tl.int64)
    position = seq_len - decode_query_len + query % decode_query_len
    visible = tl.minimum((tl.maximum(position + 1, 0) + block_size - 1) // block_size, max_block)
    busy = tl.maximum((visible + CHUNK - 1) // CHUNK, 1)
    if chunk >= busy:
        return
    scores_row = scores + head * stride_sh + query * stride_sq
    output_row = output + head * stride_oh + query * stride_oq
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    keys = tl.sort(_sort_keys(scores_row, offsets, visible), descending=True)
    if busy == 1:
        _write_output(output_row, keys, tl.arange(0, CHUNK), topk, visible)
    else:
        candidates = workspace + (row * CHUNKS + chunk) * TOPK_PAD
        tl.store(candidates + tl.arange(0, CHUNK), keys, mask=tl.arange(0, CHUNK) < TOPK_PAD)
        arrived = tl.atomic_add(counters + row, 1, sem="acq_rel")
        if arrived == busy - 1:
            slots = tl.arange(0, CHUNKS * TOPK_PAD)
            merged = tl.load(
                workspace + row * CHUNKS * TOPK_PAD + slots, mask=slots // TOPK_PAD < busy,
                other=-9223372036854775807 - 1, volatile=True,
            )
            merged = tl.sort(merged, descending=True)
            _write_output(output_row, merged, slots, topk, visible)
            tl.atomic_xchg(counters + row, 0, sem="acq_rel")


def launch_shape(max_block: int, topk: int) -> tuple[int, int, int]:
    """``(chunk, topk_pad, chunks)``: at most 16 chunks, each at least as long as the padded topk."""
    topk_pad = triton.next_power_of_2(topk)
    chunk = max(MIN_CHUNK, topk_pad, triton.next_power_of_2(-(-max(max_block, 1) // MAX_CHUNKS)))
    chunks = -(-max(max_block, 1) // chunk)
    return chunk, topk_pad, triton.next_power_of_2(chunks)


class DecodeTopKTriton(OpImplementation):
    """One Triton launch per call; keeps its workspace and completion counters between calls."""

    op: ClassVar[str] = "decode_topk"
    platforms: ClassVar[frozenset[str]] = frozenset({"cuda"})
    priority: ClassVar[int] = 10
    tolerance: ClassVar[tuple[float, float]] = (0.0, 0.0)

    def __init__(self, platform) -> None:
        super().__init__(platform)
        self._workspace: torch.Tensor | None = None
        self._counters: torch.Tensor | None = None

    @classmethod
    def is_available(cls, platform) -> bool:
        return torch.cuda.is_available()

    def buffers(self, rows: int, chunks: int, topk_pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Workspace and zeroed counters for a launch; grown (outside graph capture) when too small."""
        need = rows * chunks * topk_pad
        if self._workspace is None or self._workspace.numel() < need or self._workspace.device != device:
            self._workspace = torch.empty(need, dtype=torch.int64, device=device)
        if self._counters is None or self._counters.numel() < rows or self._counters.device != device:
            self._counters = torch.zeros(rows, dtype=torch.int32, device=device)
        return self._workspace, self._counters

    @property
    def counters(self) -> torch.Tensor | None:
        """The completion counters (all zero between launches)."""
        return self._counters

    def __call__(
        self, scores: torch.Tensor, seq_lens: torch.Tensor, decode_query_len: int, block_size: int, topk: int
    ) -> torch.Tensor:
        check_inputs(scores, seq_lens, decode_query_len, block_size, topk)
        heads, total_q, max_block = scores.shape
        output = torch.empty((heads, total_q, topk), dtype=torch.int32, device=scores.device)
        if heads * total_q == 0:
            return output
        if max_block == 0:
            return output.fill_(-1)
        scores = scores if scores.stride(-1) == 1 else scores.contiguous()
        chunk, topk_pad, chunks = launch_shape(max_block, topk)
        workspace, counters = self.buffers(heads * total_q, chunks, topk_pad, scores.device)
        output.fill_(-1)  # slots past CHUNK * CHUNKS (topk larger than any row) stay -1
        _decode_topk_kernel[(heads * total_q, chunks)](
            scores, seq_lens, output, workspace, counters,
            total_q, decode_query_len, block_size, max_block, topk,
            scores.stride(0), scores.stride(1), output.stride(0), output.stride(1),
            CHUNK=chunk, TOPK_PAD=topk_pad, CHUNKS=chunks,
            num_warps=8 if max(chunk, chunks * topk_pad) >= 4096 else 4,
        )
        return output
