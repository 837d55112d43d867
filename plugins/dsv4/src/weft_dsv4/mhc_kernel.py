"""One Triton kernel for mHC's weights after the ``fn`` projection: ``pre``, ``post`` and the
Sinkhorn-normalised ``comb`` of a block of tokens, in registers.

In plain torch each hyper-connection is about 80 small launches (sigmoids, a softmax, then
``hc_sinkhorn_iters - 1`` rounds of two sums and two divisions over an ``n x n`` matrix per
token); at decode they dominate a layer's launch count. The kernel computes in fp32 exactly the
reference's order of operations (:func:`weft_dsv4.mhc.mhc_weights`) and goes through core's
warm-up contract with ``hc_mult`` as its compile key. Imported only where Triton runs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from weft.api import Choice, CompileKey, InputSpace, Kernel

BLOCK_TOKENS = 16


@triton.jit
def _mhc_weights_kernel(
    mixes,
    base,
    scale,
    pre_out,
    post_out,
    comb_out,
    tokens,
    eps,
    iterations,
    N: tl.constexpr,
    PADDED: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, PADDED)
    token_ok = t < tokens
    lane_ok = i < N
    row = mixes + t.to(tl.int64) * ((2 + N) * N)
    pre_scale, post_scale, comb_scale = tl.load(scale), tl.load(scale + 1), tl.load(scale + 2)

    vector = token_ok[:, None] & lane_ok[None, :]
    pre = tl.load(row[:, None] + i[None, :], mask=vector, other=0.0)
    pre = tl.sigmoid(pre * pre_scale + tl.load(base + i, mask=lane_ok, other=0.0)[None, :]) + eps
    tl.store(pre_out + t[:, None].to(tl.int64) * N + i[None, :], pre, mask=vector)
    post = tl.load(row[:, None] + N + i[None, :], mask=vector, other=0.0)
    post = 2.0 * tl.sigmoid(post * post_scale + tl.load(base + N + i, mask=lane_ok, other=0.0)[None, :])
    tl.store(post_out + t[:, None].to(tl.int64) * N + i[None, :], post, mask=vector)

    # comb[t, r, c]: softmax over c, + eps, column-normalise, then (iterations - 1) rounds of rows then columns.
    cell = i[:, None] * N + i[None, :]
    cell_ok = lane_ok[:, None] & lane_ok[None, :]
    matrix = token_ok[:, None, None] & cell_ok[None, :, :]
    logits = tl.load(row[:, None, None] + 2 * N + cell[None, :, :], mask=matrix, other=0.0)
    logits = logits * comb_scale + tl.load(base + 2 * N + cell, mask=cell_ok, other=0.0)[None, :, :]
    logits = tl.where(matrix, logits, float("-inf"))
    largest = tl.max(logits, axis=2)
    largest = tl.where(largest == float("-inf"), 0.0, largest)
    exps = tl.where(matrix, tl.exp(logits - largest[:, :, None]), 0.0)
    total = tl.sum(exps, axis=2)
    total = tl.where(total == 0.0, 1.0, total)
    comb = tl.where(matrix, exps / total[:, :, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in range(iterations - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    tl.store(comb_out + t[:, None, None].to(tl.int64) * (N * N) + cell[None, :, :], comb, mask=matrix)


class MhcKey(CompileKey, frozen=True):
    hc_mult: int


class MhcWeightsKernel(Kernel):
    """``(pre, post, comb)`` from the ``fn`` projection ``mixes`` ``[T, (2 + n) * n]`` (fp32), ``base``, ``scale``."""

    name: ClassVar[str] = "weft_dsv4.mhc_weights"

    def __init__(self) -> None:
        super().__init__()
        self.hc_mults: list[int] = []

    def add(self, hc_mult: int) -> None:
        if hc_mult not in self.hc_mults:
            self.hc_mults.append(hc_mult)

    def dispatch(self, mixes: Any = None, hc_mult: int | None = None) -> MhcKey:
        return MhcKey(hc_mult=hc_mult if hc_mult is not None else _hc_mult(mixes.shape[-1]))

    def input_space(self) -> InputSpace | None:
        return Choice("hc_mult", self.hc_mults) if self.hc_mults else None

    def compile(self, key: MhcKey) -> Any:
        from weft_triton.runtime import interpreting

        if interpreting():
            return key
        n = key.hc_mult
        return _mhc_weights_kernel.warmup(
            torch.float32,
            torch.float32,
            torch.float32,
            torch.float32,
            torch.float32,
            torch.float32,
            1,
            1e-6,
            20,
            N=n,
            PADDED=triton.next_power_of_2(n),
            BLOCK_T=BLOCK_TOKENS,
            grid=(1,),
        )

    def launch(
        self,
        compiled: Any,
        *,
        mixes: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        eps: float,
        iterations: int,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, n = mixes.shape[0], _hc_mult(mixes.shape[-1])
        pre = torch.empty(tokens, n, dtype=torch.float32, device=mixes.device)
        post = torch.empty_like(pre)
        comb = torch.empty(tokens, n, n, dtype=torch.float32, device=mixes.device)
        if tokens:
            _mhc_weights_kernel[(triton.cdiv(tokens, BLOCK_TOKENS),)](
                mixes.contiguous(),
                base,
                scale,
                pre,
                post,
                comb,
                tokens,
                eps,
                iterations,
                N=n,
                PADDED=triton.next_power_of_2(n),
                BLOCK_T=BLOCK_TOKENS,
            )
        return pre, post, comb


def _hc_mult(width: int) -> int:
    """``n`` from the projection's width ``(2 + n) * n``."""
    n = int((width + 1) ** 0.5) - 1
    if (2 + n) * n != width:
        raise ValueError(f"mHC projection width {width} is not (2 + n) * n for any n")
    return n
