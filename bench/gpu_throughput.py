"""Offline throughput on a Qwen3-0.6B shape: 256 requests of 512 prompt and 256 output tokens.

Baselines measured in the same run, with identical random bf16 weights (Weft
loads the Hugging Face model's own state dict):

* Hugging Face transformers ``generate()``, all 256 prompts in one batch
  (equal lengths, so no padding), greedy, EOS disabled;
* the roofline of the decode phase: per step, the weight bytes plus the KV
  bytes of every running request, over the copy bandwidth measured here.

Usage: python bench/gpu_throughput.py --tokenizer DIR [--requests 256] [--prompt 512] [--output 256]
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from gpu_common import (
    QWEN3_0_6B,
    MemoryLoader,
    copy_bandwidth,
    hf_config,
    hf_generate,
    registry_with_memory_loader,
)
from weft import LLM, SamplingParams


def decode_roofline(shape: dict, requests: int, prompt: int, output: int, bandwidth: float) -> float:
    """Seconds to stream weights and KV for every decode step at the measured bandwidth."""
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads, dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    weights = 2 * (
        layers * (hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden + 3 * hidden * inter)
        + shape["vocab_size"] * hidden
    )
    kv_per_token = 2 * 2 * layers * kv_heads * dim
    total = 0.0
    for step in range(output - 1):
        total += weights + requests * kv_per_token * (prompt + step + 1)
    return total / bandwidth


def main() -> None:
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--hf-requests", type=int, default=None, help="HF batch (default: all requests)")
    parser.add_argument("--profile", action="store_true", help="also profile the host side of a second Weft run")
    args = parser.parse_args()
    print(f"# gpu_throughput: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bandwidth = copy_bandwidth()
    shape = QWEN3_0_6B
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, 150000, (args.requests, args.prompt), generator=generator)
    output_tokens = args.requests * args.output

    hf_batch = args.hf_requests or args.requests
    # Twice, the faster counting: HF's first full-size run pays one-time costs (on one H200 a Qwen3-0.6B run of
    # 256 x (512, 256) gave 3,356 tok/s, then 9,212; bench/gpu_engine.py).
    hf_seconds = (
        min(hf_generate(hf, prompts[:hf_batch].cuda(), args.output) for _ in range(2)) * args.requests / hf_batch
    )
    hf_rate = output_tokens / hf_seconds
    print(
        f"HF transformers generate(): {hf_rate:,.0f} output tokens/s (batch {hf_batch}, the faster of two runs)",
        flush=True,
    )
    gc.collect()
    torch.cuda.empty_cache()

    state = {name: tensor for name, tensor in hf.state_dict().items()}
    model = MemoryLoader.add("qwen3-0.6b", shape, lambda: iter(state.items()), args.tokenizer)
    llm = LLM(
        model=model,
        registry=registry_with_memory_loader(),
        use={"platform": "cuda"},
        engine={
            "dtype": "bfloat16",
            "max_num_seqs": args.requests,
            "max_num_batched_tokens": 8192,
            "max_model_len": args.prompt + args.output + 16,
        },
    )
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    llm.generate(prompts[:8].tolist(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm
    lists = prompts.tolist()
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.generate(lists, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    if args.profile:  # where the host time of a second, identical run goes
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(llm.generate, lists, params)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == output_tokens
    rate = output_tokens / seconds
    roofline = decode_roofline(shape, args.requests, args.prompt, args.output, bandwidth)
    print(
        f"Weft: {rate:,.0f} output tokens/s ({seconds:.2f} s) = {rate / hf_rate:.1f}x HF; decode roofline "
        f"{output_tokens / roofline:,.0f} tokens/s at {bandwidth / 1e12:.2f} TB/s (Weft at {roofline / seconds:.0%} "
        f"of it, prefill included in Weft's time)",
        flush=True,
    )


if __name__ == "__main__":
    main()
