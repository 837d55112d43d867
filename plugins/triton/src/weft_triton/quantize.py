"""Activations to float8_e4m3 with one scale per row, in one launch (weft-cuda's ``fp8`` quantization).

Before each fp8 GEMM (``torch._scaled_mm``) the activations ``x[M, K]`` become codes and a float32 scale per row:
``scale = max |row| / 448`` (``1 / 448`` for a row of zeros), ``code = x / scale`` rounded to nearest-even on
float8_e4m3's grid. In torch that is some seven element-wise launches over float32 copies of ``x`` per GEMM (by their
bytes, about what the fp8 GEMMs save at a 512-row 8B decode step: an estimate, not a measurement); here one
program per row reads the row twice (its maximum, then its codes: the second read hits the cache) and writes one
byte an element. The division is IEEE
round-to-nearest and the rounding that of :func:`weft_triton.paged_attention._round_to_float8`, so the codes and
scales are torch's (:func:`weft_cuda.fp8.quantize_rows`) bit for bit, on every Triton backend and in the
interpreter.

The kernel goes through core's warm-up contract: its compile key is the activations' dtype and the row width; the
quantization method registers every input width of the model's linear layers.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from weft.api import Choice, CompileKey, InputSpace, Kernel
from weft_triton.paged_attention import _round_to_float8
from weft_triton.runtime import interpreting

FLOAT8_MAX = 448.0
BLOCK_K = 1024
"""Elements of a row each iteration loads: 2 KiB of bf16, eight per thread of four warps."""


@triton.jit
def _quantize_rows_kernel(x, codes, scales, K: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK_K)
    largest = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, K, BLOCK_K):
        values = tl.load(x + row * K + start + columns, mask=start + columns < K, other=0.0)
        largest = tl.maximum(largest, tl.abs(values.to(tl.float32)))
    row_max = tl.max(largest, 0)
    scale = tl.math.div_rn(tl.where(row_max > 0.0, row_max, 1.0), 448.0)
    tl.store(scales + row, scale)
    for start in range(0, K, BLOCK_K):
        mask = start + columns < K
        values = tl.load(x + row * K + start + columns, mask=mask, other=0.0).to(tl.float32)
        rounded = _round_to_float8(tl.math.div_rn(values, tl.full([BLOCK_K], 1.0, tl.float32) * scale))
        tl.store(codes + row * K + start + columns, rounded.to(codes.dtype.element_ty), mask=mask)


class QuantizeKey(CompileKey, frozen=True):
    dtype: str
    k: int


class Fp8QuantizeRowsKernel(Kernel):
    """``(codes, scales)`` of ``x`` ``[M, K]`` (contiguous, bf16/fp16/fp32): float8_e4m3fn codes ``[M, K]`` and float32
    scales ``[M]`` with ``x ~ codes * scales[:, None]``."""

    name: ClassVar[str] = "weft_triton.quantize_fp8_rows"

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []
        self.dtypes: list[torch.dtype] = []

    def add_shape(self, k: int, dtype: torch.dtype) -> None:
        if k not in self.widths:
            self.widths.append(k)
        if dtype not in self.dtypes:
            self.dtypes.append(dtype)

    def dispatch(self, dtype: torch.dtype, k: int) -> QuantizeKey:
        return QuantizeKey(dtype=str(dtype).removeprefix("torch."), k=k)

    def input_space(self) -> InputSpace | None:
        if not self.widths:
            return None
        return Choice("dtype", self.dtypes) * Choice("k", self.widths)

    def compile(self, key: QuantizeKey) -> Any:
        if interpreting():
            return key
        return _quantize_rows_kernel.warmup(
            getattr(torch, key.dtype), torch.float8_e4m3fn, torch.float32, K=key.k, BLOCK_K=BLOCK_K, grid=(1,)
        )

    def launch(self, compiled: Any, *, x: torch.Tensor, k: int, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.shape[0]
        codes = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            _quantize_rows_kernel[(rows,)](x, codes, scales, K=k, BLOCK_K=BLOCK_K)
        return codes, scales
