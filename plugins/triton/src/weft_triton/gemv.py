"""Skinny matrix products for decode: ``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)`` for one row.

At batch 1 a decode step streams every weight once, so its time is the weights'
bytes over the memory bandwidth. cuBLAS reaches that only on large matrices; on
a Llama-3-8B layer it streams o_proj (4096x4096) at about a third of the
bandwidth. This kernel gives every program a strip of ``BLOCK_N`` output
columns and walks K in ``BLOCK_K`` tiles, multiplying in float32 (the same
accumulation cuBLAS uses for bf16); the strip height is chosen per shape so
the grid fills the GPU. It goes through core's warm-up contract: every
(shape, M tile) a model's linear layers need is compiled before serving.

:class:`Fp8GemvKernel` is the same kernel over float8_e4m3 weights with one scale per output
column (weft-cuda's ``fp8`` quantization at one row): the weights are converted in registers and
the activations stay in bf16, so a decode step streams half the bytes and rounds nothing but
the weights.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from weft.api import Choice, CompileKey, InputSpace, IntRange, Kernel, Zipped
from weft_triton.runtime import interpreting

MAX_ROWS = 1
"""Rows this kernel takes. Measured on an H200 (docs/benchmarks.md): at one row it streams every
Llama-3-8B projection faster than cuBLAS; at two and four rows cuBLAS is faster, so those go there."""


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x,
    w,
    scale,
    bias,
    y,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    accumulator = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + ks
        weights = tl.load(
            w + columns[:, None] * K + k[None, :], mask=(columns[:, None] < N) & (k[None, :] < K), other=0.0
        )
        inputs = tl.load(x + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        accumulator += tl.sum(inputs.to(tl.float32)[:, None, :] * weights.to(tl.float32)[None, :, :], axis=2)
    if HAS_SCALE:
        accumulator *= tl.load(scale + columns, mask=columns < N, other=0.0)[None, :]
    if HAS_BIAS:
        accumulator += tl.load(bias + columns, mask=columns < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y + rows[:, None] * N + columns[None, :],
        accumulator.to(y.dtype.element_ty),
        mask=(rows[:, None] < M) & (columns[None, :] < N),
    )


def block_rows(m: int) -> int:
    """The M tile: 1, 2 or 4."""
    return 1 if m <= 1 else 2 if m == 2 else 4


def pays(n: int, k: int) -> bool:
    """Whether this kernel beats cuBLAS for an ``N x K`` weight at one row.

    Measured in CUDA graphs on an H200 (docs/benchmarks.md): on Llama-3-8B's
    qkv_proj (6144x4096) and o_proj (4096x4096) it streams 3.5-3.7 TB/s where
    cuBLAS gives 3.2-3.3; on gate_up (28672x4096), down (4096x14336) and the LM
    head cuBLAS is level or faster. So: matrices up to 32M elements.
    """
    return n * k <= 32 << 20


def tile_config(n: int, k: int, block_m: int, weight_bytes: int = 2) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)``: from a tile sweep on an H200, strips of 8 columns walking
    K in tiles of 1024 (the most bytes in flight per program) with 4 warps were best for the
    bf16 matrices this kernel takes; one-byte weights walk twice as many per tile, for the same bytes
    in flight (not swept)."""
    return 8, (1024 * 2 // weight_bytes if block_m == 1 else 256), 4


class GemvKey(CompileKey, frozen=True):
    dtype: str
    n: int
    k: int
    block_m: int
    has_bias: bool


class GemvKernel(Kernel):
    name: ClassVar[str] = "weft_triton.gemv"
    weight_dtype: ClassVar[torch.dtype | None] = None
    """The weights' dtype where it is not the activations' (:class:`Fp8GemvKernel`)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int, bool]] = []
        self.dtypes: list[torch.dtype] = []

    def add_shape(self, n: int, k: int, has_bias: bool, dtype: torch.dtype) -> None:
        if (n, k, has_bias) not in self.shapes:
            self.shapes.append((n, k, has_bias))
        if dtype not in self.dtypes:
            self.dtypes.append(dtype)

    def dispatch(self, dtype: torch.dtype, n: int, k: int, m: int, has_bias: bool) -> GemvKey:
        return GemvKey(dtype=str(dtype).removeprefix("torch."), n=n, k=k, block_m=block_rows(m), has_bias=has_bias)

    def input_space(self) -> InputSpace | None:
        if not self.shapes:
            return None
        n, k, has_bias = zip(*self.shapes, strict=False)
        return Choice("dtype", self.dtypes) * Zipped(n=n, k=k, has_bias=has_bias) * IntRange("m", 1, MAX_ROWS + 1)

    def compile(self, key: GemvKey) -> Any:
        if interpreting():
            return key
        dtype = getattr(torch, key.dtype)
        weight_dtype = self.weight_dtype or dtype
        block_n, block_k, warps = tile_config(key.n, key.k, key.block_m, weight_dtype.itemsize)
        return _gemv_kernel.warmup(
            dtype,
            weight_dtype,
            torch.float32,
            dtype,
            dtype,
            1,
            N=key.n,
            K=key.k,
            BLOCK_M=key.block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            HAS_SCALE=self.weight_dtype is not None,
            HAS_BIAS=key.has_bias,
            num_warps=warps,
            grid=(1,),
        )

    def launch(
        self,
        compiled: Any,
        *,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        m: int,
        n: int,
        k: int,
        scale: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        block_m = block_rows(m)
        block_n, block_k, warps = tile_config(n, k, block_m, weight.element_size())
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x,
            weight,
            scale if scale is not None else x,
            bias if bias is not None else x,
            y,
            m,
            N=n,
            K=k,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            HAS_SCALE=scale is not None,
            HAS_BIAS=bias is not None,
            num_warps=warps,
        )
        return y


class Fp8GemvKernel(GemvKernel):
    """``y = (x @ codes^T) * scale (+ bias)`` for float8_e4m3fn ``codes`` ``[N, K]`` and float32 ``scale`` ``[N]``
    (one per output column), ``x`` in bf16/fp16; ``launch`` takes ``scale``."""

    name: ClassVar[str] = "weft_triton.gemv_fp8"
    weight_dtype: ClassVar[torch.dtype | None] = torch.float8_e4m3fn
