"""Prefill of one 8k-token prompt on a Llama-3-8B shape (random bf16 weights) against the bf16 matmul rate.

The work counted is the model's matmul FLOPs, ``2 x (non-embedding weights) x
tokens`` for the projections (the LM head only for the one sampled row) plus
the causal attention (``4 x layers x heads x head_dim x T(T+1)/2``). It is timed
as the engine's step that computes the whole prompt and samples its first token
(prefix caching off, so every run recomputes), and compared with the rate of
one large bf16 matmul measured in this run.

Usage: python bench/gpu_prefill.py --tokenizer DIR [--tokens 8192]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from gpu_common import LLAMA3_8B, MemoryLoader, matmul_rate, random_weights, registry_with_memory_loader
from weft import LLM, SamplingParams


def prefill_flops(shape: dict, tokens: int) -> float:
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads, dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    per_layer = hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden + 3 * hidden * inter
    projections = 2 * layers * per_layer * tokens + 2 * hidden * shape["vocab_size"]
    attention = 4 * layers * heads * dim * tokens * (tokens + 1) / 2
    return projections + attention


def attention_sweep(tokens: int) -> None:
    """One Llama-3-8B attention layer over a ``tokens``-long prefill: Triton tile choices, in TFLOP/s."""
    import itertools

    from gpu_common import cuda_time
    from weft_triton.paged_attention import _paged_attention_kernel

    heads, kv_heads, dim, block = 32, 8, 128, 16
    blocks = -(-tokens // block)
    cache = torch.randn(2, blocks, block, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    table = torch.arange(blocks, dtype=torch.int32, device="cuda")[None]
    query = torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device="cuda")
    output = torch.empty_like(query)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    query_start = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    flops = 4 * heads * dim * tokens * (tokens + 1) / 2
    results = []
    for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):

        def launch(block_m=block_m, block_n=block_n, warps=warps, stages=stages):
            grid = (1, -(-tokens * (heads // kv_heads) // block_m), kv_heads)
            _paged_attention_kernel[grid](
                query,
                cache[0],
                cache[1],
                output,
                table,
                seq_lens,
                query_start,
                dim**-0.5,
                0,
                query.stride(0),
                query.stride(1),
                cache[0].stride(0),
                cache[0].stride(1),
                cache[0].stride(2),
                output.stride(0),
                output.stride(1),
                table.stride(0),
                GROUP=heads // kv_heads,
                HEAD_DIM=dim,
                BLOCK_SIZE=block,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                HAS_WINDOW=False,
                IEEE=False,
                num_warps=warps,
                num_stages=stages,
            )

        try:
            launch()
            results.append((flops / cuda_time(launch, 5) / 1e12, block_m, block_n, warps, stages))
        except Exception as error:
            print(f"  tiles {block_m}x{block_n} {warps}w {stages}s failed: {type(error).__name__}", flush=True)
    results.sort(reverse=True)
    print(
        f"attention of one layer, {tokens}-token prefill (TFLOP/s, BLOCK_M, BLOCK_N, warps, stages): "
        + ", ".join("/".join(map(str, (f"{r[0]:.0f}",) + r[1:])) for r in results[:6])
        + f"; current default 64/64/4/3: {next((r[0] for r in results if r[1:] == (64, 64, 4, 3)), 0):.0f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="also time attention tile choices")
    args = parser.parse_args()
    print(f"# gpu_prefill: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rate = matmul_rate()
    print(f"bf16 matmul rate (8192^3, cuBLAS): {rate / 1e12:.0f} TFLOP/s", flush=True)
    if args.sweep:
        attention_sweep(args.tokens)
    shape = LLAMA3_8B
    model = MemoryLoader.add("llama3-8b", shape, random_weights(shape, torch.bfloat16), args.tokenizer)
    llm = LLM(
        model=model,
        registry=registry_with_memory_loader(),
        use={"platform": "cuda"},
        engine={
            "dtype": "bfloat16",
            "max_num_seqs": 4,
            "max_model_len": args.tokens + 16,
            "max_num_batched_tokens": args.tokens,
            "enable_prefix_caching": False,
            "num_kv_blocks": 2048,
        },
    )
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    flops = prefill_flops(shape, args.tokens)
    times = []
    for repeat in range(args.repeats + 1):
        prompt = torch.randint(10, 120000, (args.tokens,), generator=generator).tolist()
        torch.cuda.synchronize()
        started = time.perf_counter()
        llm.generate([prompt], params)
        torch.cuda.synchronize()
        if repeat:  # the first run warms up
            times.append(time.perf_counter() - started)
    best, median = min(times), sorted(times)[len(times) // 2]
    print(
        f"prefill {args.tokens} tokens: median {median * 1e3:.1f} ms, best {best * 1e3:.1f} ms; "
        f"{flops / 1e12:.1f} TFLOP -> {flops / median / 1e12:.0f} TFLOP/s median = {flops / median / rate:.1%} "
        f"of the matmul rate (best {flops / best / rate:.1%})",
        flush=True,
    )


if __name__ == "__main__":
    main()
