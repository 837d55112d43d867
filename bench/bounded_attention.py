"""Decode attention launched on a bounded number of programs, for bench/gpu_decode_overlap.py's SM partitioning.

weft-triton's paged-attention kernel launches one program per (request, KV head) of a decode step, 4,096 at
batch 512 on the Llama-3-8B shape: whenever it runs it takes every SM it can get. This is the same decode
attention (one query position per request, the GQA group packed in a tile of ``BLOCK_M`` rows, the same key-tile
load and online-softmax step, imported from :mod:`weft_triton.paged_attention`) as a persistent kernel: a grid of
``programs`` programs, each walking (request, KV head) items with a stride of ``programs``, so that it occupies at
most that many CTA slots and leaves the other SMs to GEMMs running beside it. No sliding window, no soft cap: the
bench's layer has neither.

``python bench/bounded_attention.py`` checks it against weft-triton's kernel, on the GPU, or on the CPU with
``TRITON_INTERPRET=1`` at a small shape (the bench checks it again at its own shape before timing it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weft.contracts.attention import AttentionBatch, AttentionLayer
from weft_triton.paged_attention import BLOCK_N, _load_key_tile, _online_softmax_step


@triton.jit
def _bounded_decode_kernel(
    query,
    key_cache,
    value_cache,
    output,
    block_table,
    seq_lens,
    scale,
    items,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_ot,
    stride_oh,
    stride_bt,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    keys = tl.arange(0, BLOCK_N)
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        request = item // KV_HEADS
        kv_head = item % KV_HEADS
        seq_len = tl.load(seq_lens + request)
        head = kv_head * GROUP + rows % GROUP
        q = tl.load(
            query + request * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=valid[:, None], other=0.0
        )
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        accumulator = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for tile_start in range(0, seq_len, BLOCK_N):
            key_positions = tile_start + keys
            in_context = key_positions < seq_len
            k, v = _load_key_tile(
                key_cache,
                value_cache,
                block_table + request * stride_bt,
                key_positions,
                in_context,
                kv_head,
                dims,
                stride_cb,
                stride_cs,
                stride_ch,
                BLOCK_SIZE,
            )
            visible = in_context[None, :] & valid[:, None]
            running_max, running_sum, accumulator = _online_softmax_step(
                q, k, v, visible, scale, 1.0, running_max, running_sum, accumulator, False, False
            )
        result = accumulator / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(
            output + request * stride_ot + head[:, None] * stride_oh + dims[None, :],
            result.to(output.dtype.element_ty),
            mask=valid[:, None],
        )


def bounded_decode_attention(
    layer: AttentionLayer,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    batch: AttentionBatch,
    programs: int,
    block_m: int = 16,
) -> None:
    """One decode step's attention (``query`` ``[requests, heads, head_dim]``, one position per request) over the
    paged ``kv_cache`` ``[2, blocks, block_size, kv_heads, head_dim]`` into ``output``, on ``programs`` programs."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    items = batch.seq_lens.shape[0] * layer.num_kv_heads
    _bounded_decode_kernel[(min(programs, items),)](
        query,
        key_cache,
        value_cache,
        output,
        batch.block_table,
        batch.seq_lens,
        layer.scale,
        items,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        output.stride(0),
        output.stride(1),
        batch.block_table.stride(0),
        KV_HEADS=layer.num_kv_heads,
        GROUP=layer.num_heads // layer.num_kv_heads,
        HEAD_DIM=layer.head_dim,
        BLOCK_SIZE=batch.block_size,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        num_stages=3,
    )


def check(device: str, requests: int, layer: AttentionLayer, block_size: int, programs: int, dtype) -> float:
    """Largest |difference| between this kernel and weft-triton's paged attention on a random decode step."""
    from weft_triton.paged_attention import PagedAttentionKernel

    generator = torch.Generator().manual_seed(0)
    seq = torch.randint(1, 5 * block_size, (requests,), generator=generator, dtype=torch.int32)
    per = (seq + block_size - 1) // block_size
    table = torch.zeros(requests, int(per.max()), dtype=torch.int32)
    order = torch.randperm(int(per.sum()), generator=generator, dtype=torch.int32)
    offset = 0
    for row in range(requests):
        table[row, : per[row]] = order[offset : offset + per[row]]
        offset += int(per[row])
    cache = torch.randn(2, int(per.sum()), block_size, layer.num_kv_heads, layer.head_dim, generator=generator)
    cache = cache.to(device, dtype)
    query = torch.randn(requests, layer.num_heads, layer.head_dim, generator=generator).to(device, dtype)
    batch = AttentionBatch(
        query_start=torch.arange(requests + 1, dtype=torch.int32, device=device),
        seq_lens=seq.to(device),
        block_table=table.to(device),
        slot_mapping=torch.zeros(requests, dtype=torch.int64, device=device),
        max_query_len=1,
        max_seq_len=int(seq.max()),
        block_size=block_size,
    )
    expected, actual = torch.empty_like(query), torch.empty_like(query)
    PagedAttentionKernel()(
        dtype=dtype, layer=layer, block_size=block_size, block_m=16, splits=1, query=query, kv_cache=cache,
        output=expected, batch=batch,
    )  # fmt: skip
    bounded_decode_attention(layer, query, cache, actual, batch, programs)
    assert expected.abs().amax(dim=(1, 2)).min() > 0, "the reference wrote no output for some request"
    return (actual.float() - expected.float()).abs().max().item()


if __name__ == "__main__":
    import os

    on_cpu = os.environ.get("TRITON_INTERPRET") == "1"
    shape = AttentionLayer(num_heads=8, num_kv_heads=2, head_dim=32, scale=32**-0.5)
    difference = check("cpu" if on_cpu else "cuda", 5, shape, 16, 3, torch.float32 if on_cpu else torch.bfloat16)
    print(f"bounded decode attention against weft-triton's kernel: max |difference| {difference:.2e}")
    assert difference < (1e-4 if on_cpu else 2e-2), difference
