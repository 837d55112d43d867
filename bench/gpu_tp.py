"""Tensor parallelism on two GPUs against one, measured in the same run, on a Llama-3-8B shape with random bf16 weights.

* ``decode``: the batch-1 decode step. One request of 128 prompt tokens generates 513 tokens and,
  separately, 1 token; the step is the difference over 512 steps (``LLM.generate`` end to end:
  scheduler, step channel, workers, graphs). Target: TP=2's step at most 0.6x TP=1's.
* ``throughput``: 512 requests x (512 prompt, 256 output) tokens, greedy, EOS ignored, default
  engine settings. Target: TP=2 at least 1.6x TP=1's output tokens per second.

Both engines load the same weights (``random:llama3-8b``: seeded tensors made on each rank's GPU,
each rank keeping its shards). Run with NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1 (bench/gpu_session.sh sets them):

    python bench/gpu_tp.py --tokenizer DIR
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

import torch

from gpu_common import install_random_loader, out_path
from weft import LLM, SamplingParams


def timed(llm: LLM, prompts: list[list[int]], output: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * output
    return seconds


def measure(tensor_parallel_size: int, parts: list[str]) -> dict[str, float]:
    llm = LLM(
        model="random:llama3-8b",
        use={"platform": "cuda"},
        engine={"dtype": "bfloat16", "tensor_parallel_size": tensor_parallel_size, "max_model_len": 2048},
    )
    generator = torch.Generator().manual_seed(1)
    results: dict[str, float] = {}
    try:
        timed(llm, [list(range(100, 164))] * 8, 32)  # warm
        if "decode" in parts:
            prompt = [torch.randint(10, 120000, (128,), generator=generator).tolist()]
            first = min(timed(llm, prompt, 1) for _ in range(3))
            whole = min(timed(llm, prompt, 513) for _ in range(2))
            results["decode_step_ms"] = (whole - first) / 512 * 1e3
        if "throughput" in parts:
            prompts = torch.randint(10, 120000, (512, 512), generator=generator).tolist()
            results["throughput"] = 512 * 256 / timed(llm, prompts, 256)
        engine = llm.engine.config.engine
        print(
            f"TP={tensor_parallel_size}: max_num_seqs {engine.max_num_seqs}, max_num_batched_tokens "
            f"{engine.max_num_batched_tokens}, async scheduling {'on' if llm.engine.core.async_scheduling else 'off'}, "
            f"{results}",
            flush=True,
        )
    finally:
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="folder of SmolLM2's tokenizer files")
    parser.add_argument("--part", action="append", choices=("decode", "throughput"), help="default: both")
    args = parser.parse_args()
    parts = args.part or ["decode", "throughput"]
    os.environ["WEFT_TEST_TOKENIZER"] = str(Path(args.tokenizer).resolve())
    install_random_loader(Path(tempfile.mkdtemp(prefix="weft-bench-site-")))
    print(
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}",
        flush=True,
    )
    one = measure(1, parts)
    two = measure(2, parts)
    lines = []
    if "decode" in parts:
        ratio = two["decode_step_ms"] / one["decode_step_ms"]
        lines.append(
            f"batch-1 decode step: TP=1 {one['decode_step_ms']:.2f} ms, TP=2 {two['decode_step_ms']:.2f} ms: "
            f"{ratio:.2f}x TP=1's (target <= 0.60)"
        )
    if "throughput" in parts:
        ratio = two["throughput"] / one["throughput"]
        lines.append(
            f"512 x (512, 256): TP=1 {one['throughput']:,.0f} tok/s, TP=2 {two['throughput']:,.0f} tok/s: "
            f"{ratio:.2f}x TP=1's (target >= 1.60)"
        )
    print("\n".join(lines), flush=True)
    log = out_path("tp.txt")
    if log is not None:
        log.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
