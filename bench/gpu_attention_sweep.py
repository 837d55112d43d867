"""The decode attention kernel's tiles on an NVIDIA GPU, at the engine benchmarks' decode shapes.

For the two workloads of ``bench/gpu_engine.py`` at their decode phase (Qwen3-0.6B: 256 requests,
16 query / 8 KV heads; Llama-3-8B: 512 requests, 32 / 8; head_dim 128, bf16, cache block 16,
contexts drawn from 513-768 tokens as in the middle of the 256-token decode), one layer's
``_paged_attention_kernel`` is timed for each (keys per tile, warps, pipeline stages), against the
KV bytes read at the copy bandwidth measured in the same run. Every variant's output is compared
with the engine's current choice (it must agree to bf16 rounding).

Usage: PYTHONPATH=bench python bench/gpu_attention_sweep.py
"""

from __future__ import annotations

import itertools

import torch
import triton

from gpu_common import copy_bandwidth, cuda_time

SHAPES = {"qwen3-0.6b": (256, 16, 8), "llama3-8b": (512, 32, 8)}
"""Requests, query heads, KV heads."""
HEAD_DIM, BLOCK = 128, 16


def timed(launch, repeats: int = 30) -> float:
    for _ in range(3):
        launch()
    return cuda_time(launch, repeats)


def sweep(name: str, bandwidth: float) -> None:
    from weft_triton.paged_attention import _paged_attention_kernel

    requests, heads, kv_heads = SHAPES[name]
    generator = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(513, 769, (requests,), generator=generator, dtype=torch.int32)
    per_request = -(-768 // BLOCK)
    num_blocks = requests * per_request
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(requests, per_request)
    query = torch.randn(requests, heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    query_start = torch.arange(requests + 1, dtype=torch.int32, device="cuda")
    lens = seq_lens.cuda()
    key_cache, value_cache = cache[0], cache[1]
    kv_bytes = int(seq_lens.sum()) * kv_heads * HEAD_DIM * 2 * 2
    floor = kv_bytes / bandwidth
    print(
        f"{name}: {requests} requests x {heads}/{kv_heads} heads, {kv_bytes / 1e6:.0f} MB of KV a layer, "
        f"{floor * 1e6:.1f} us at the copy bandwidth",
        flush=True,
    )

    def launcher(block_m: int, block_n: int, warps: int, stages: int, output: torch.Tensor):
        grid = (requests, triton.cdiv(heads // kv_heads, block_m), kv_heads)

        def launch() -> None:
            _paged_attention_kernel[grid](
                query,
                key_cache,
                value_cache,
                output,
                table,
                lens,
                query_start,
                HEAD_DIM**-0.5,
                0,
                query.stride(0),
                query.stride(1),
                key_cache.stride(0),
                key_cache.stride(1),
                key_cache.stride(2),
                output.stride(0),
                output.stride(1),
                table.stride(0),
                GROUP=heads // kv_heads,
                HEAD_DIM=HEAD_DIM,
                BLOCK_SIZE=BLOCK,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                HAS_WINDOW=False,
                IEEE=False,
                num_warps=warps,
                num_stages=stages,
            )

        return launch

    reference = torch.empty_like(query)
    launcher(16, 64, 4, 3, reference)()
    results = []
    for block_n, warps, stages in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3, 4, 5)):
        output = torch.zeros_like(query)
        launch = launcher(16, block_n, warps, stages, output)
        try:
            seconds = timed(launch)
        except Exception as error:  # noqa: BLE001 - out of shared memory or registers: skip the variant
            print(f"  BLOCK_N={block_n} warps={warps} stages={stages}: {type(error).__name__}", flush=True)
            continue
        error = (output.float() - reference.float()).abs().max().item()
        results.append((seconds, block_n, warps, stages, error))
    results.sort()
    current = next(r for r in results if r[1:4] == (64, 4, 3))
    print(
        f"  current (64 keys, 4 warps, 3 stages): {current[0] * 1e6:.1f} us = {floor / current[0]:.0%} of the copy "
        "bandwidth",
        flush=True,
    )
    for seconds, block_n, warps, stages, error in results[:12]:
        print(
            f"  BLOCK_N={block_n:3d} warps={warps} stages={stages}: {seconds * 1e6:7.1f} us, {floor / seconds:.0%} of "
            f"copy bandwidth, {current[0] / seconds:.2f}x current, max |diff| {error:.3g}",
            flush=True,
        )


def main() -> None:
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    for name in SHAPES:
        sweep(name, bandwidth)


if __name__ == "__main__":
    main()
