"""The experts of a mixture-of-experts block as two grouped GEMMs over tokens sorted by expert.

A step's ``T`` tokens each choose ``k`` experts: ``T * k`` (token, expert) pairs. :func:`sort_pairs` orders
the pairs by expert and pads every expert's run to a multiple of the M tile, so that each tile of
``BLOCK_M`` sorted pairs belongs to one expert; it runs on the device with fixed sizes (the most tiles
``T * k`` pairs can fill), no count goes to the host and a decode graph can capture it. Then:

1. ``gate_up[p] = hidden[token(p)] @ w13[e].T (+ b13[e])`` for every pair ``p`` of expert ``e``: one program
   per (tile of pairs, tile of ``2I`` columns), reading the tile's weights once for all its rows;
2. the gated activation (:class:`~weft.layers.moe.MoEActivation`) on ``[T*k, 2I]``;
3. ``out[p] = weight(p) * (act[p] @ w2[e].T (+ b2[e]))`` in float32, the same kernel;
4. a sum over each token's ``k`` rows, in a fixed order, then the activations' dtype.

Tiles that fall past the last expert's run, and pairs routed to experts this rank does not hold (expert
parallelism), exit without work. Tile sizes depend on the GEMM's shape and on how many rows an expert
gets on average (:func:`tile_config`); the variants are compile keys of :class:`FusedMoEKernel`, all
compiled at warm-up for the shapes the model declares.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from weft.api import Choice, CompileKey, InputSpace, Kernel, RuntimeMonitor, Zipped
from weft_triton.runtime import interpreting

ROW_BUCKETS = (1, 4, 16, 64, 256, 1 << 30)
"""Average rows per expert (``T * k / E``) that pick a tile configuration: each bucket covers up to its value."""


@triton.jit(do_not_specialize=["num_pairs", "top_k"])
def _grouped_gemm_kernel(
    a,
    b,
    bias,
    c,
    pair_weights,
    sorted_pairs,
    tile_experts,
    num_pairs,
    top_k,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS_PER_TOKEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    IEEE: tl.constexpr,
):
    """``c[p, :] = (a[row(p)] @ b[e].T + bias[e]) (* pair_weights[p])`` for the pairs ``p`` of one M tile, whose
    expert is ``e``; ``row(p) = p // top_k`` when ``a`` holds one row per token, else ``p``. Every tensor is
    contiguous: ``a`` ``[rows, K]``, ``b`` ``[E, N, K]``, ``bias`` ``[E, N]``, ``c`` ``[pairs, N]``."""
    tile = tl.program_id(0)
    expert = tl.load(tile_experts + tile)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    if ROWS_PER_TOKEN:
        rows = pairs // top_k
    else:
        rows = pairs
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    b_tile = b + expert.to(tl.int64) * (N * K) + columns[None, :] * K
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + ks
        inputs = tl.load(
            a + rows[:, None].to(tl.int64) * K + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0
        )
        weights = tl.load(b_tile + k[:, None], mask=(k[:, None] < K) & (columns[None, :] < N), other=0.0)
        if IEEE:
            accumulator += tl.dot(inputs, weights, input_precision="ieee")
        else:
            accumulator += tl.dot(inputs, weights)
    if HAS_BIAS:
        accumulator += tl.load(bias + expert * N + columns, mask=columns < N, other=0.0).to(tl.float32)[None, :]
    if WEIGHTED:
        accumulator *= tl.load(pair_weights + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c + pairs[:, None].to(tl.int64) * N + columns[None, :],
        accumulator.to(c.dtype.element_ty),
        mask=valid[:, None] & (columns[None, :] < N),
    )


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most M tiles ``num_pairs`` pairs can fill when every expert's run is padded to ``block_m``."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def sort_pairs(
    experts: torch.Tensor,
    num_experts: int,
    first_expert: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, tile_experts)``: the pair indices (``t * k + j``) ordered by expert, each expert's run
    padded with ``T * k`` (no pair) to a multiple of ``block_m``, ``[max_tiles * block_m]``; and each tile's
    expert, relative to ``first_expert`` (-1: a tile past the last run). Pairs routed outside ``first_expert ..
    first_expert + num_experts - 1`` are left out. Fixed sizes, no host synchronisation."""
    flat = experts.flatten()
    num_pairs, device = flat.numel(), flat.device
    local = flat - first_expert
    held = (local >= 0) & (local < num_experts)
    local = torch.where(held, local, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    padded_starts = padded_ends - padded
    starts = counts.cumsum(0) - counts
    order = local.argsort(stable=True)
    sorted_experts = local[order]
    held_sorted = sorted_experts < num_experts
    clamped = sorted_experts.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=device) - starts[clamped]
    tiles = max_tiles(num_pairs, num_experts, block_m)
    # Pairs of no held expert go to a dump slot past the tiles, cut off below.
    destination = torch.where(held_sorted, padded_starts[clamped] + rank, tiles * block_m)
    sorted_pairs = torch.full((tiles * block_m + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, destination, order.to(torch.int32))
    tile_starts = torch.arange(tiles, device=device) * block_m
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return sorted_pairs[: tiles * block_m], tile_experts


def row_bucket(num_pairs: int, num_experts: int) -> int:
    average = num_pairs / max(num_experts, 1)
    return next(bucket for bucket in ROW_BUCKETS if average <= bucket)


def tile_config(bucket: int, n: int, k: int, dtype: str) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` for a GEMM of ``n`` output columns over ``k``.

    Few rows per expert (decode): the GEMM streams the experts' weights, so the M tile is the smallest
    ``tl.dot`` takes (16) and wide K tiles keep many weight bytes in flight. Many rows (prefill): larger
    square-ish tiles for the tensor cores, as in the tuned configurations published for Hopper.
    """
    wide = 4 if dtype == "float32" else 2  # bytes: float32 tiles half as deep for the same shared memory
    if bucket <= 4:
        return 16, 64, 256 // (wide // 2), 4, 3
    if bucket <= 16:
        return 16, 128, 128 // (wide // 2), 4, 3
    if bucket <= 64:
        return 64, 128, 64 // (wide // 2), 4, 3
    if bucket <= 256:
        return 64, 128, 64 // (wide // 2), 4, 4
    return 128, 128, 64 // (wide // 2), 8, 3


class FusedMoEKey(CompileKey, frozen=True):
    dtype: str
    out_dtype: str
    n: int
    k: int
    bucket: int
    rows_per_token: bool
    has_bias: bool
    weighted: bool


class FusedMoEKernel(Kernel):
    """Both grouped GEMMs of :func:`fused_moe` (one Triton kernel, two specialisations per shape)."""

    name: ClassVar[str] = "weft_triton.fused_moe"

    def __init__(self, monitor: RuntimeMonitor | None = None) -> None:
        super().__init__(monitor)
        self.shapes: list[tuple[str, int, int, int, int, bool]] = []
        """Declared ``(dtype, experts, top_k, hidden, intermediate, bias)``."""

    def add(self, dtype: torch.dtype, experts: int, top_k: int, hidden: int, intermediate: int, bias: bool) -> None:
        shape = (str(dtype).removeprefix("torch."), experts, top_k, hidden, intermediate, bias)
        if shape not in self.shapes:
            self.shapes.append(shape)

    def dispatch(
        self,
        dtype: torch.dtype | str,
        out_dtype: torch.dtype | str,
        n: int,
        k: int,
        num_pairs: int,
        num_experts: int,
        rows_per_token: bool,
        has_bias: bool,
        weighted: bool,
    ) -> FusedMoEKey:
        return FusedMoEKey(
            dtype=str(dtype).removeprefix("torch."),
            out_dtype=str(out_dtype).removeprefix("torch."),
            n=n,
            k=k,
            bucket=row_bucket(num_pairs, num_experts),
            rows_per_token=rows_per_token,
            has_bias=has_bias,
            weighted=weighted,
        )

    def input_space(self) -> InputSpace | None:
        if not self.shapes:
            return None
        # Each declared shape's two GEMMs: gate/up (rows per token, out in the dtype) and down (per pair, weighted,
        # float32 out); one representative pair count per row bucket.
        columns: dict[str, list[Any]] = {
            name: []
            for name in ("dtype", "out_dtype", "n", "k", "num_experts", "rows_per_token", "has_bias", "weighted")
        }
        for dtype, experts, _, hidden, intermediate, bias in self.shapes:
            for n, k, first in ((2 * intermediate, hidden, True), (hidden, intermediate, False)):
                for name, value in zip(
                    columns, (dtype, dtype if first else "float32", n, k, experts, first, bias, not first), strict=False
                ):
                    columns[name].append(value)
        counts = [max(1, bucket if bucket < ROW_BUCKETS[-1] else 1024) for bucket in ROW_BUCKETS]
        return Zipped(**columns) * Choice("rows_per_expert", counts)

    def warmup_keys(self) -> list[CompileKey]:
        space = self.input_space()
        if space is None:
            return []
        keys = []
        for point in space.points():
            rows = point.pop("rows_per_expert")
            keys.append(self.dispatch(num_pairs=rows * point["num_experts"], **point))
        return list(dict.fromkeys(keys))

    def compile(self, key: FusedMoEKey) -> Any:
        if interpreting():
            return key
        dtype, out = getattr(torch, key.dtype), getattr(torch, key.out_dtype)
        block_m, block_n, block_k, warps, stages = tile_config(key.bucket, key.n, key.k, key.dtype)
        return _grouped_gemm_kernel.warmup(
            dtype,
            dtype,
            dtype,
            out,
            torch.float32,
            torch.int32,
            torch.int32,
            1,
            1,
            N=key.n,
            K=key.k,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            ROWS_PER_TOKEN=key.rows_per_token,
            HAS_BIAS=key.has_bias,
            WEIGHTED=key.weighted,
            IEEE=key.dtype == "float32",
            num_warps=warps,
            num_stages=stages,
            grid=(1,),
        )

    def launch(
        self,
        compiled: Any,
        *,
        a: torch.Tensor,
        b: torch.Tensor,
        bias: torch.Tensor | None,
        c: torch.Tensor,
        pair_weights: torch.Tensor | None,
        experts: torch.Tensor,
        first_expert: int,
        top_k: int,
        n: int,
        k: int,
        num_pairs: int,
        num_experts: int,
        rows_per_token: bool,
        weighted: bool,
        sorted_cache: dict,
        **_: Any,
    ) -> torch.Tensor:
        block_m, block_n, block_k, warps, stages = tile_config(
            row_bucket(num_pairs, num_experts), n, k, str(a.dtype).removeprefix("torch.")
        )
        if block_m not in sorted_cache:
            sorted_cache[block_m] = sort_pairs(experts, num_experts, first_expert, block_m)
        sorted_pairs, tile_experts = sorted_cache[block_m]
        grid = (tile_experts.numel(), triton.cdiv(n, block_n))
        _grouped_gemm_kernel[grid](
            a,
            b,
            bias if bias is not None else b,
            c,
            pair_weights if pair_weights is not None else c,
            sorted_pairs,
            tile_experts,
            num_pairs,
            top_k,
            N=n,
            K=k,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            ROWS_PER_TOKEN=rows_per_token,
            HAS_BIAS=bias is not None,
            WEIGHTED=weighted,
            IEEE=a.dtype == torch.float32,
            num_warps=warps,
            num_stages=stages,
        )
        return c


def fused_moe(
    kernel: FusedMoEKernel,
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    activation: Any,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    first_expert: int,
) -> torch.Tensor:
    """:func:`weft.layers.moe.fused_experts` through the grouped GEMMs (same arguments, same result)."""
    tokens, top_k = experts.shape
    count, intermediate = w13.shape[0], w2.shape[2]
    hidden_size, num_pairs = hidden.shape[1], tokens * top_k
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_cache: dict = {}
    common = dict(
        experts=experts,
        first_expert=first_expert,
        top_k=top_k,
        num_pairs=num_pairs,
        num_experts=count,
        sorted_cache=sorted_cache,
    )
    gate_up = torch.empty((num_pairs, 2 * intermediate), dtype=hidden.dtype, device=hidden.device)
    kernel(
        dtype=hidden.dtype,
        out_dtype=hidden.dtype,
        n=2 * intermediate,
        k=hidden_size,
        rows_per_token=True,
        has_bias=w13_bias is not None,
        weighted=False,
        a=hidden,
        b=w13,
        bias=w13_bias,
        c=gate_up,
        pair_weights=None,
        **common,
    )
    gate, up = gate_up.chunk(2, dim=-1)
    activated = activation(gate, up).contiguous()
    # Pairs of no held expert are never written: zeros, so that they add nothing to the sum.
    products = torch.zeros((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    kernel(
        dtype=hidden.dtype,
        out_dtype=torch.float32,
        n=hidden_size,
        k=intermediate,
        rows_per_token=False,
        has_bias=w2_bias is not None,
        weighted=True,
        a=activated,
        b=w2,
        bias=w2_bias,
        c=products,
        pair_weights=weights.float().contiguous(),
        **common,
    )
    return products.view(tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
