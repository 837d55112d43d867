"""GPU memory returned by ``LLM.close()`` and by a start that failed, without the garbage collector.

The automatic collector is off from before the engine starts until the figures are read, so what comes back
comes back through ``close()`` itself (``Worker.shutdown``). Prints ``torch.cuda.memory_allocated()`` and
``memory_reserved()`` before the engine, while it runs (Llama-3-8B's shape, random bf16 weights, the KV cache
sized to the default memory fraction, decode graphs captured) and after ``close()``; then the same for an engine
whose start fails once its model is loaded (a KV cache too small for one request).

    python bench/gpu_close.py --tokenizer .whl/tokenizer
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from gpu_common import LLAMA3_8B, MemoryLoader, random_weights, registry_with_memory_loader
from weft import LLM, SamplingParams


def gib(value: int) -> str:
    return f"{value / (1 << 30):.2f} GiB"


def figures(label: str) -> tuple[int, int]:
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    print(f"{label}: allocated {gib(allocated)}, reserved {gib(reserved)}", flush=True)
    return allocated, reserved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    args = parser.parse_args()
    model = MemoryLoader.add("llama3-8b-close", LLAMA3_8B, random_weights(LLAMA3_8B, torch.bfloat16), args.tokenizer)
    gc.collect()
    gc.disable()
    before, _ = figures("before the engine")
    llm = LLM(
        model=model, registry=registry_with_memory_loader(), use={"platform": "cuda"}, engine={"dtype": "bfloat16"}
    )
    llm.generate([[1, 2, 3, 4]] * 8, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    running, _ = figures("engine running")
    llm.close()
    closed, reserved = figures("after close(), collector off")
    print(
        f"close(): returned {gib(running - closed)} of {gib(running - before)} allocated by the engine; "
        f"{gib(closed - before)} still allocated, {gib(reserved)} reserved",
        flush=True,
    )
    try:
        LLM(
            model=model,
            registry=registry_with_memory_loader(),
            use={"platform": "cuda"},
            engine={"dtype": "bfloat16", "num_kv_blocks": 2},
        )
    except ValueError as error:
        print(f"failed start (as intended): {str(error)[:120]}", flush=True)
    failed, reserved = figures("after the failed start, collector off")
    print(f"failed start: {gib(failed - before)} still allocated, {gib(reserved)} reserved", flush=True)
    gc.enable()


if __name__ == "__main__":
    main()
