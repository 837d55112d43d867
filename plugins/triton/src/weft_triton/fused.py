"""Fused elementwise kernels for the layers around the matrix products: RMSNorm with the residual
add, rotary embedding of queries and keys (alone, or after a per-head RMSNorm of each, as Qwen3
has), and SiLU-and-mul.

At batch 1 a decode step is a chain of small kernels; in plain torch the norm
alone is seven (cast, square, mean, rsqrt, multiply, cast, weight), each a
separate launch of a few microseconds that moves almost nothing. One kernel
per operation removes that launch chain; see docs/benchmarks.md for the
profile. Each kernel computes in float32 and rounds once, and goes through
core's warm-up contract with a key of the dtype and the static widths.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from weft.api import Choice, CompileKey, InputSpace, Kernel, Zipped
from weft_triton.runtime import interpreting


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, residual_out, eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < N
    values = tl.load(x + row * N + columns, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the model's dtype first, as the unfused add would.
        values = values + tl.load(residual + row * N + columns, mask=mask, other=0.0)
        tl.store(residual_out + row * N + columns, values, mask=mask)
    values = values.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(values * values, 0) / N + eps)
    normed = (values * rstd).to(out.dtype.element_ty).to(tl.float32)
    w = tl.load(weight + columns, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * N + columns, (normed * w).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    source,
    weight,
    target,
    token,
    stride_source,
    c,
    s,
    eps,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    NORM: tl.constexpr,
):
    """Rotate the ``HEADS`` heads of one token (``rotate_half`` layout) into a contiguous target. With ``NORM``
    each head is RMS-normalised over its ``2 * HALF`` dims and multiplied by ``weight`` first, rounded as the
    unfused ops round: the normalised head to the model's dtype, its product with the weight again."""
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, HALF)
    mask = (heads < HEADS)[:, None]
    dtype = target.dtype.element_ty
    first = source + token * stride_source + heads[:, None] * 2 * HALF + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = (1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps))[:, None]
        w1 = tl.load(weight + dims).to(tl.float32)[None, :]
        w2 = tl.load(weight + HALF + dims).to(tl.float32)[None, :]
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    out = target + token * HEADS * 2 * HALF + heads[:, None] * 2 * HALF + dims[None, :]
    tl.store(out, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(out + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    query,
    key,
    cos,
    sin,
    query_out,
    key_out,
    stride_qt,
    stride_kt,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF)
    c = tl.load(cos + token * 2 * HALF + dims).to(tl.float32)[None, :]
    s = tl.load(sin + token * 2 * HALF + dims).to(tl.float32)[None, :]
    _rotate_heads(query, query, query_out, token, stride_qt, c, s, 0.0, HEADS, HALF, BLOCK_HEADS, False)
    _rotate_heads(key, key, key_out, token, stride_kt, c, s, 0.0, KV_HEADS, HALF, BLOCK_HEADS, False)


@triton.jit
def _qk_norm_rotary_kernel(
    query,
    key,
    query_weight,
    key_weight,
    cos,
    sin,
    query_out,
    key_out,
    stride_qt,
    stride_kt,
    eps,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF)
    c = tl.load(cos + token * 2 * HALF + dims).to(tl.float32)[None, :]
    s = tl.load(sin + token * 2 * HALF + dims).to(tl.float32)[None, :]
    _rotate_heads(query, query_weight, query_out, token, stride_qt, c, s, eps, HEADS, HALF, BLOCK_HEADS, True)
    _rotate_heads(key, key_weight, key_out, token, stride_kt, c, s, eps, KV_HEADS, HALF, BLOCK_HEADS, True)


@triton.jit
def _silu_and_mul_kernel(x, out, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < WIDTH
    gate = tl.load(x + row * 2 * WIDTH + columns, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * 2 * WIDTH + WIDTH + columns, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * WIDTH + columns, (gate / (1.0 + tl.exp(-gate)) * up).to(out.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024


class FusedKey(CompileKey, frozen=True):
    dtype: str
    shape: tuple[int, ...]
    """The static widths the kernel specialises on."""
    flag: bool = False


class _FusedKernel(Kernel):
    """A fused kernel whose variants are (dtype, static widths[, flag]) declared by the layers."""

    flags: ClassVar[tuple[bool, ...]] = (False,)

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def add(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if (_dtype_name(dtype), shape) not in self.shapes:
            self.shapes.append((_dtype_name(dtype), shape))

    def dispatch(self, dtype: Any, shape: tuple[int, ...], flag: bool = False) -> FusedKey:
        return FusedKey(dtype=dtype if isinstance(dtype, str) else _dtype_name(dtype), shape=tuple(shape), flag=flag)

    def input_space(self) -> InputSpace | None:
        if not self.shapes:
            return None
        dtypes, shapes = zip(*self.shapes, strict=False)
        return Zipped(dtype=dtypes, shape=shapes) * Choice("flag", self.flags)

    def compile(self, key: FusedKey) -> Any:
        return key if interpreting() else self._warm(key, getattr(torch, key.dtype))


class RmsNormKernel(_FusedKernel):
    name: ClassVar[str] = "weft_triton.rms_norm"
    flags: ClassVar[tuple[bool, ...]] = (False, True)

    def _warm(self, key: FusedKey, dtype: torch.dtype) -> Any:
        (n,) = key.shape
        return _rms_norm_kernel.warmup(
            dtype,
            dtype,
            dtype,
            dtype,
            dtype,
            1e-6,
            N=n,
            BLOCK=triton.next_power_of_2(n),
            HAS_RESIDUAL=key.flag,
            grid=(1,),
        )

    def launch(
        self,
        compiled: Any,
        *,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        **_: Any,
    ) -> Any:
        n = x.shape[-1]
        out = torch.empty_like(x)
        summed = torch.empty_like(x) if residual is not None else out
        _rms_norm_kernel[(x.numel() // n,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            summed,
            eps,
            N=n,
            BLOCK=triton.next_power_of_2(n),
            HAS_RESIDUAL=residual is not None,
        )
        return out if residual is None else (out, summed)


class RotaryKernel(_FusedKernel):
    name: ClassVar[str] = "weft_triton.rotary"

    def _warm(self, key: FusedKey, dtype: torch.dtype) -> Any:
        heads, kv_heads, dim = key.shape
        return _rotary_kernel.warmup(
            dtype,
            dtype,
            dtype,
            dtype,
            dtype,
            dtype,
            16,
            16,
            HEADS=heads,
            KV_HEADS=kv_heads,
            HALF=dim // 2,
            BLOCK_HEADS=triton.next_power_of_2(max(heads, kv_heads)),
            grid=(1,),
        )

    def launch(
        self, compiled: Any, *, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **_: Any
    ) -> Any:
        tokens, heads, dim = query.shape
        kv_heads = key.shape[1]
        query_out = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)
        key_out = torch.empty(tokens, kv_heads, dim, dtype=key.dtype, device=key.device)
        if tokens:
            _rotary_kernel[(tokens,)](
                query,
                key,
                cos,
                sin,
                query_out,
                key_out,
                query.stride(0),
                key.stride(0),
                HEADS=heads,
                KV_HEADS=kv_heads,
                HALF=dim // 2,
                BLOCK_HEADS=triton.next_power_of_2(max(heads, kv_heads)),
            )
        return query_out, key_out


class QkNormRotaryKernel(_FusedKernel):
    name: ClassVar[str] = "weft_triton.qk_norm_rotary"

    def _warm(self, key: FusedKey, dtype: torch.dtype) -> Any:
        heads, kv_heads, dim = key.shape
        return _qk_norm_rotary_kernel.warmup(
            dtype,
            dtype,
            dtype,
            dtype,
            dtype,
            dtype,
            dtype,
            dtype,
            16,
            16,
            1e-6,
            HEADS=heads,
            KV_HEADS=kv_heads,
            HALF=dim // 2,
            BLOCK_HEADS=triton.next_power_of_2(max(heads, kv_heads)),
            grid=(1,),
        )

    def launch(
        self,
        compiled: Any,
        *,
        query: torch.Tensor,
        key: torch.Tensor,
        query_weight: torch.Tensor,
        key_weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        **_: Any,
    ) -> Any:
        tokens, heads, dim = query.shape
        kv_heads = key.shape[1]
        query_out = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)
        key_out = torch.empty(tokens, kv_heads, dim, dtype=key.dtype, device=key.device)
        if tokens:
            _qk_norm_rotary_kernel[(tokens,)](
                query,
                key,
                query_weight,
                key_weight,
                cos,
                sin,
                query_out,
                key_out,
                query.stride(0),
                key.stride(0),
                eps,
                HEADS=heads,
                KV_HEADS=kv_heads,
                HALF=dim // 2,
                BLOCK_HEADS=triton.next_power_of_2(max(heads, kv_heads)),
            )
        return query_out, key_out


class SiluAndMulKernel(_FusedKernel):
    name: ClassVar[str] = "weft_triton.silu_and_mul"

    def _warm(self, key: FusedKey, dtype: torch.dtype) -> Any:
        (width,) = key.shape
        return _silu_and_mul_kernel.warmup(dtype, dtype, WIDTH=width, BLOCK=SILU_BLOCK, grid=(1,))

    def launch(self, compiled: Any, *, x: torch.Tensor, **_: Any) -> Any:
        width = x.shape[-1] // 2
        rows = x.numel() // x.shape[-1]
        out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
        if rows:
            _silu_and_mul_kernel[(rows, triton.cdiv(width, SILU_BLOCK))](x, out, WIDTH=width, BLOCK=SILU_BLOCK)
        return out
