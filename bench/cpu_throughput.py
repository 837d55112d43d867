"""The default model's CPU throughput figures of issue 47 beside bench/cpu_anchors.py's, each in a fresh process.

* batch 32: bench/cpu_generate.py's workload (32 prompts of 64-256 tokens, 128 new tokens each, greedy, EOS
  ignored) through ``LLM.generate``: output tokens/s, prefill included (the issue's "today": 119 tok/s);
* 16 served streams: ``weft serve`` in a subprocess, bench/serve_load.py's 16 clients (streaming chat completions,
  64 new tokens, 2 each): output tokens/s and TTFT p50 (2026-11-30's figures: 142 tok/s, 841 ms);
* batch 1 under contention: bench/cpu_anchors.py's batch-1 decode, quiet and then with a busy process
  (``while True: pass``) bound to the last CPU: the ratio of the two.

``--quantization`` picks Weft's path (``auto``: cpu_int4 on the default model; ``none``: dense float32) and
``--rounds`` repeats each measurement, alternating. vLLM's CPU build is the issue's other anchor; the script
says whether it is importable (it is not on the project's machines). Usage::

    python bench/cpu_throughput.py [--rounds 2] [--quantization auto] [--skip batch32,served,contended]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import cpu_anchors  # noqa: E402
import serve_load  # noqa: E402

BATCH32 = """
import json, sys, time
sys.path.insert(0, {bench!r})
from cpu_generate import workload, weft_generate, BATCH, NEW_TOKENS
from weft import LLM
llm = LLM(model="smollm2-135m-instruct", quantization=sys.argv[1])
_, batch = workload(llm.tokenizer)
weft_generate(llm, batch[:4])
print(json.dumps({{"tok_s": BATCH * NEW_TOKENS / weft_generate(llm, batch)}}))
"""


def batch32(quantization: str) -> float:
    return cpu_anchors.run(sys.executable, BATCH32.format(bench=str(BENCH)), quantization)


def served(quantization: str, port: int) -> dict[str, float]:
    """16 streaming clients against a fresh ``weft serve``: bench/serve_load.py's figures."""
    command = [sys.executable, "-m", "weft.cli", "serve", "--port", str(port), "--quantization", quantization]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"weft serve did not come up (exit {server.poll()})")
            time.sleep(1)
        asyncio.run(serve_load.load(url, 2, 1))  # warm the HTTP path
        return asyncio.run(serve_load.load(url, 16, 2))
    finally:
        server.terminate()
        server.wait(timeout=60)


def batch1(quantization: str, threads: int) -> float:
    code = cpu_anchors.WEFT.format(tokens=cpu_anchors.NEW_TOKENS, prompt=cpu_anchors.PROMPT)
    return cpu_anchors.run(sys.executable, code, quantization, str(threads))


def contended(quantization: str, threads: int) -> tuple[float, float]:
    """``(quiet, with a busy process on the last CPU)`` batch-1 decode tokens/s."""
    quiet = batch1(quantization, threads)
    last = max(os.sched_getaffinity(0))
    busy = subprocess.Popen(["taskset", "-c", str(last), sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1)
        loaded = batch1(quantization, threads)
    finally:
        busy.kill()
        busy.wait()
    return quiet, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--port", type=int, default=8771)
    parser.add_argument("--skip", default="", help="comma-separated: batch32, served, contended")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    with open("/proc/loadavg") as loadavg:
        print(f"load average at start: {' '.join(loadavg.read().split()[:3])}", flush=True)
    figures: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        if "batch32" not in skip:
            figures.setdefault("batch 32 tok/s", []).append(batch32(args.quantization))
        if "served" not in skip:
            result = served(args.quantization, args.port)
            figures.setdefault("16 served streams tok/s", []).append(result["tokens_per_s"])
            figures.setdefault("16 served streams TTFT p50 ms", []).append(1000 * result["ttft_p50"])
        if "contended" not in skip:
            quiet, loaded = contended(args.quantization, args.threads)
            figures.setdefault("batch 1 quiet tok/s", []).append(quiet)
            figures.setdefault("batch 1 with a busy process tok/s", []).append(loaded)
            figures.setdefault("batch 1 busy / quiet", []).append(loaded / quiet)
        print(f"round {round_index + 1}: " + json.dumps({k: round(v[-1], 3) for k, v in figures.items()}), flush=True)
    with open("/proc/loadavg") as loadavg:
        print(f"load average at end: {' '.join(loadavg.read().split()[:3])}")
    print(f"\nWeft quantization={args.quantization!r}, {args.rounds} rounds (median, min, max):")
    for name, values in figures.items():
        print(f"  {name:36s} {statistics.median(values):9.2f} {min(values):9.2f} {max(values):9.2f}")
    if "batch 32 tok/s" in figures:
        print(f"  batch 32 against the issue's 119 tok/s: {statistics.median(figures['batch 32 tok/s']) / 119:.2f}x")
    if importlib.util.find_spec("vllm") is None:
        print("  vLLM CPU build: not installed here (the issue's 251 batch-32 and 166 served tok/s are its figures)")


if __name__ == "__main__":
    main()
