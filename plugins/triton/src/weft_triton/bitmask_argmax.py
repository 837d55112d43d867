"""The greedy token of a step under grammar bitmasks in one kernel (core's ``bitmask_argmax`` op).

One program per logits row walks the vocabulary in blocks: it reads the row's bitmask words beside the
logits (a row without a mask reads none), makes each disallowed logit ``logit + (-inf)`` and keeps the
first index of the maximum, the first NaN, and whether the maximum is finite. The logits are not
written. It replaces the chain the unfused path launches (the bitmask's bytes widened, a table gather,
the add, the max, the finiteness test), whose host time sat on the structured-output step's
critical path (docs/benchmarks.md). The reference and the semantics: :mod:`weft.builtins.bitmask_argmax`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from weft.api import Choice, CompileKey, InputSpace, Kernel
from weft_triton.runtime import interpreting

BLOCK = 2048


@triton.jit(do_not_specialize=["vocab", "words", "stride"])
def _bitmask_argmax_kernel(logits, mask_rows, bitmask, tokens, healthy, vocab, words, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    mask_row = tl.load(mask_rows + row).to(tl.int64)
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int64)
    first_nan = tl.full([], 0, tl.int64) + vocab
    for start in range(0, vocab, BLOCK):
        columns = start + tl.arange(0, BLOCK).to(tl.int64)
        inside = columns < vocab
        x = tl.load(logits + row * stride + columns, mask=inside, other=float("-inf")).to(tl.float32)
        reads_mask = inside & (columns * 0 + mask_row >= 0)  # (a scalar condition broadcast over the block)
        word = tl.load(bitmask + mask_row * words + columns // 32, mask=reads_mask, other=-1)
        allowed = ((word >> (columns % 32).to(tl.int32)) & 1) != 0
        x = tl.where(allowed, x, x + float("-inf"))  # -inf, or NaN from a NaN or +inf logit
        nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, columns, vocab), 0))
        ranked = tl.where(nan, float("-inf"), x)
        block_best = tl.max(ranked, 0)
        block_index = start + tl.argmax(ranked, 0, tie_break_left=True).to(tl.int64)
        better = block_best > best  # strictly: an earlier block keeps a tie
        best_index = tl.where(better, block_index, best_index)
        best = tl.where(better, block_best, best)
    has_nan = first_nan < vocab
    tl.store(tokens + row, tl.where(has_nan, first_nan, best_index))
    finite = (best < float("inf")) & (best > float("-inf")) & (first_nan >= vocab)
    tl.store(healthy + row, finite)


class BitmaskArgmaxKey(CompileKey, frozen=True):
    dtype: str


class BitmaskArgmaxKernel(Kernel):
    """The kernel, one variant per logits dtype (the runner declares the ones its model's logits come in)."""

    name: ClassVar[str] = "weft_triton.bitmask_argmax"

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[str] = []

    def add(self, dtype: torch.dtype) -> None:
        name = str(dtype).removeprefix("torch.")
        if name not in self.dtypes:
            self.dtypes.append(name)

    def dispatch(self, dtype: Any) -> BitmaskArgmaxKey:
        return BitmaskArgmaxKey(dtype=dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."))

    def input_space(self) -> InputSpace | None:
        return Choice("dtype", tuple(self.dtypes)) if self.dtypes else None

    def compile(self, key: BitmaskArgmaxKey) -> Any:
        if interpreting():
            return key
        return _bitmask_argmax_kernel.warmup(
            getattr(torch, key.dtype),
            torch.int32,
            torch.int32,
            torch.int64,
            torch.bool,
            1,
            1,
            1,
            BLOCK=BLOCK,
            grid=(1,),
        )

    def launch(
        self, compiled: Any, *, logits: torch.Tensor, mask_rows: torch.Tensor, bitmask: torch.Tensor, **_: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, vocab = logits.shape
        tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
        healthy = torch.empty(rows, dtype=torch.bool, device=logits.device)
        if rows:
            words = bitmask.shape[1] if bitmask.shape[0] else 1
            _bitmask_argmax_kernel[(rows,)](
                logits, mask_rows, bitmask, tokens, healthy, vocab, words, logits.stride(0), BLOCK=BLOCK
            )
        return tokens, healthy
