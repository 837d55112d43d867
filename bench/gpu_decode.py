"""Batch-1 decode on a Llama-3-8B shape (random bf16 weights made on the GPU) against the HBM roofline.

The roofline of one decode step is the bytes it must read, every weight except
the embedding table (one row of it is read) plus the KV cache of the context,
divided by the device-to-device copy bandwidth measured in this run.

Printed:
* the profile that decides which kernels pay: each projection of the model at
  one row inside CUDA graphs, cuBLAS against the Triton kernel (its chosen tiles
  and the best of a sweep), in TB/s of weight bytes;
* the step time the engine delivers (time per output token, host work included)
  and the GPU time of one captured decode graph replayed back to back, for three
  op choices: all plain torch, cuBLAS with the fused norm/rotary/SiLU kernels,
  and the default (Triton GEMV and the fused kernels); and the time of the
  default's step outside the projections.

Usage: python bench/gpu_decode.py --tokenizer DIR [--context 512] [--steps 128]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_common import LLAMA3_8B, MemoryLoader, copy_bandwidth, cuda_time, random_weights, registry_with_memory_loader
from weft import LLM, SamplingParams


def roofline_bytes(shape: dict, context: int) -> tuple[int, int]:
    """Weight bytes (bf16, embedding table excluded) and KV bytes at ``context`` tokens, per decode step."""
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads, dim, vocab = (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
        shape["vocab_size"],
    )
    per_layer = hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden + 3 * hidden * inter + 2 * hidden
    weights = layers * per_layer + hidden + vocab * hidden
    kv = 2 * layers * kv_heads * dim * context
    return 2 * weights, 2 * kv


def graph_time(fn, launches: int = 20) -> float:
    """Seconds per launch of ``fn`` captured ``launches`` times in one CUDA graph (as a decode step runs it)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return cuda_time(graph.replay, 10) / launches


def projection_profile(shape: dict, bandwidth: float) -> float:
    """Per projection at one row, inside CUDA graphs: cuBLAS against the Triton kernel; returns the
    step's projection time with the faster of the two for each."""
    from weft_triton.gemv import _gemv_kernel, tile_config

    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    projections = {
        "qkv_proj": (q + 2 * kv, hidden, layers),
        "o_proj": (hidden, q, layers),
        "gate_up_proj": (2 * inter, hidden, layers),
        "down_proj": (hidden, inter, layers),
        "lm_head": (shape["vocab_size"], hidden, 1),
    }
    print("projections at one row in CUDA graphs, TB/s of weight bytes (cuBLAS | Triton tiles N/K/warps)", flush=True)
    totals = {"cublas": 0.0, "triton": 0.0, "best": 0.0}
    for name, (n, k, count) in projections.items():
        weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        nbytes = n * k * 2
        cublas = graph_time(lambda x=x, weight=weight: F.linear(x, weight))
        chosen = tile_config(n, k, 1)
        results = {}
        for block_n, block_k, warps in dict.fromkeys(
            [chosen] + list(itertools.product((4, 8, 16), (512, 1024), (4, 8)))
        ):

            def launch(x=x, weight=weight, y=y, n=n, k=k, block_n=block_n, block_k=block_k, warps=warps):
                return _gemv_kernel[(-(-n // block_n),)](
                    x,
                    weight,
                    x,
                    x,
                    y,
                    1,
                    N=n,
                    K=k,
                    BLOCK_M=1,
                    BLOCK_N=block_n,
                    BLOCK_K=block_k,
                    HAS_SCALE=False,
                    HAS_BIAS=False,
                    num_warps=warps,
                )

            results[(block_n, block_k, warps)] = graph_time(launch)
        error = (y.float() - F.linear(x, weight).float()).abs().max().item()
        best = min(results, key=results.get)
        totals["cublas"] += count * cublas
        totals["triton"] += count * results[chosen]
        totals["best"] += count * min(cublas, results[chosen])
        print(
            f"  {name} {n}x{k}: cuBLAS {nbytes / cublas / 1e12:.2f} | Triton {nbytes / results[chosen] / 1e12:.2f} "
            f"({'/'.join(map(str, chosen))}, chosen) | best tiles {nbytes / results[best] / 1e12:.2f} "
            f"({'/'.join(map(str, best))}); max |error| {error:.1e}",
            flush=True,
        )
    print(
        f"  projections per step: cuBLAS {totals['cublas'] * 1e3:.3f} ms, Triton {totals['triton'] * 1e3:.3f} ms, "
        f"faster of each {totals['best'] * 1e3:.3f} ms (copy bandwidth {bandwidth / 1e12:.2f} TB/s)",
        flush=True,
    )
    return totals["triton"]


def measure(model: str, registry, tokenizer: Path, ops: dict, context: int, steps: int, bandwidth: float) -> dict:
    llm = LLM(
        model=model,
        registry=registry,
        use={"platform": "cuda", "ops": ops},
        engine={
            "dtype": "bfloat16",
            "max_num_seqs": 8,
            "max_model_len": 4096,
            "num_kv_blocks": 2048,
            "max_num_batched_tokens": 4096,
        },
    )
    engine = llm.engine
    prompt = torch.randint(10, 120000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
    request = engine.add_request("decode", prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    while not request.output_token_ids:
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
    step_seconds = (time.perf_counter() - started) / steps
    graph = engine.runner.graphs[1]
    replay_seconds = cuda_time(graph, 50)
    result = {"step": step_seconds, "replay": replay_seconds}
    del llm, engine, graph
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--skip-profile", action="store_true")
    args = parser.parse_args()
    print(f"# gpu_decode: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bandwidth = copy_bandwidth()
    shape = LLAMA3_8B
    projections = None if args.skip_profile else projection_profile(shape, bandwidth)
    registry = registry_with_memory_loader()
    model = MemoryLoader.add("llama3-8b", shape, random_weights(shape, torch.bfloat16), args.tokenizer)
    average_context = args.context + args.steps // 2
    weight_bytes, kv_bytes = roofline_bytes(shape, average_context)
    roofline = (weight_bytes + kv_bytes) / bandwidth
    print(
        f"roofline: {(weight_bytes + kv_bytes) / 1e9:.2f} GB per step ({weight_bytes / 1e9:.2f} weights + "
        f"{kv_bytes / 1e9:.3f} KV at {average_context} tokens) at {bandwidth / 1e12:.2f} TB/s = {roofline * 1e3:.3f} "
        "ms",
        flush=True,
    )
    variants = {
        "all torch (cuBLAS, unfused)": {
            "linear": "torch",
            "rms_norm": "torch",
            "rotary": "torch",
            "silu_and_mul": "torch",
        },
        "cuBLAS + fused norm/rotary/silu": {"linear": "torch"},
        "Triton GEMV + fused (default)": {},
    }
    for label, ops in variants.items():
        result = measure(model, registry, args.tokenizer, ops, args.context, args.steps, bandwidth)
        print(
            f"{label}: engine step {result['step'] * 1e3:.3f} ms ({roofline / result['step']:.1%} of roofline, "
            f"{1 / result['step']:.1f} tok/s); graph replay {result['replay'] * 1e3:.3f} ms "
            f"({roofline / result['replay']:.1%} of roofline); host share {1 - result['replay'] / result['step']:.1%}",
            flush=True,
        )
    if projections is not None:
        print(
            f"outside the projections (norms, rotary, attention, KV stores, residuals): "
            f"{(result['replay'] - projections) * 1e3:.3f} ms of the default's {result['replay'] * 1e3:.3f} ms replay",
            flush=True,
        )


if __name__ == "__main__":
    main()
