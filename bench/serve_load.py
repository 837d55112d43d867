"""Load on the OpenAI-compatible server with the default model, against offline LLM.generate in the same run.

For 1, 16 and 64 concurrent clients, each client sends streaming chat completions
back to back (64 new tokens, EOS ignored); the script reports requests/s, output
tokens/s, and the p50/p90/p99 of time to first token and inter-token latency. The
baseline is the engine's own ceiling: offline ``LLM.generate`` of the same requests
in batches of the same size, measured after the server stops (one machine, shared
cores). With ``--health``, it instead measures ``/health`` latency (p50, p99, max), with the server idle and
then while 64 clients stream and a prompt of about 8,000 tokens is tokenized and prefilled (the
engine core runs in its own process, so HTTP keeps answering; the goal is a p99 under 100 ms).
With ``--health-8mb``, the load is 16 streaming clients and four 8 MB prompts (two chat, two
completions; each is refused as too long for the context, after its body is read, parsed and
checked off the event loop): the goal is again a p99 under 100 ms.
Usage::

    python bench/serve_load.py [--requests-per-client 2] [--port 8765] [--health | --health-8mb]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

MODEL = "smollm2-135m-instruct"
NEW_TOKENS = 64


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def question(index: int) -> str:
    return f"Question {index}: write one sentence about the number {index * 7 + 3}."


async def one_request(http: httpx.AsyncClient, url: str, index: int) -> tuple[float, list[float], int]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question(index)}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    ttft = arrivals[0] - start
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return ttft, gaps, tokens


async def load(url: str, clients: int, per_client: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        counter = iter(range(clients * per_client))

        async def client() -> list[tuple[float, list[float], int]]:
            return [await one_request(http, url, next(counter)) for _ in range(per_client)]

        start = time.perf_counter()
        results = [item for batch in await asyncio.gather(*(client() for _ in range(clients))) for item in batch]
        elapsed = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    gaps = [gap for r in results for gap in r[1]]
    return {
        "requests_per_s": len(results) / elapsed,
        "tokens_per_s": sum(r[2] for r in results) / elapsed,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "ttft_p99": percentile(ttfts, 0.99),
        "itl_p50": percentile(gaps, 0.5),
        "itl_p90": percentile(gaps, 0.9),
        "itl_p99": percentile(gaps, 0.99),
    }


async def health_latencies(url: str, until: asyncio.Event | None, count: int = 0) -> list[float]:
    """``/health`` round trips every 20 ms, until ``until`` is set (or ``count`` of them)."""
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=30) as http:
        while (until is not None and not until.is_set()) or len(latencies) < count:
            started = time.perf_counter()
            (await http.get(f"{url}/health")).raise_for_status()
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.02)
    return latencies


async def health_under_load(url: str) -> tuple[list[float], list[float]]:
    """``/health`` latencies idle, then under 64 streaming clients and one ~8,000-token prompt."""
    idle = await health_latencies(url, None, count=100)
    done = asyncio.Event()
    probe = asyncio.create_task(health_latencies(url, done))
    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=80)) as http:
        long = http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "apple " * 7900, "max_tokens": 1})
        streams = [one_request(http, url, index) for index in range(64)]
        responses = await asyncio.gather(long, *streams)
        responses[0].raise_for_status()
    done.set()
    return idle, await probe


async def health_during_8mb_prompts(url: str) -> tuple[list[float], list[float]]:
    """``/health`` latencies idle, then while 16 clients stream and four 8 MB prompts arrive."""
    idle = await health_latencies(url, None, count=100)
    text = "The quick brown fox jumps over the lazy dog. " * (((8 << 20) - 4096) // 45)
    done = asyncio.Event()
    probe = asyncio.create_task(health_latencies(url, done))
    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=32)) as http:
        big = [
            http.post(
                f"{url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": text}]}
            )
            for _ in range(2)
        ]
        big += [http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": text}) for _ in range(2)]
        streams = [one_request(http, url, index) for index in range(16)]
        responses = await asyncio.gather(*big, *streams)
        for response in responses[:4]:
            assert response.status_code == 400, response.text[:300]
    done.set()
    return idle, await probe


def offline_tokens_per_s(clients: int, per_client: int) -> float:
    from weft import LLM, SamplingParams

    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    conversations = [[{"role": "user", "content": question(i)}] for i in range(clients * per_client)]
    llm.chat(conversations[:2], params, use_tqdm=False)
    start = time.perf_counter()
    for first in range(0, len(conversations), clients):
        llm.chat(conversations[first : first + clients], params, use_tqdm=False)
    return len(conversations) * NEW_TOKENS / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--health", action="store_true", help="measure /health latency under load instead")
    parser.add_argument("--health-8mb", action="store_true", help="measure /health latency during 8 MB prompts instead")
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "weft.cli", "serve", "--port", str(args.port), "--max-num-seqs", str(max(levels))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ),
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server did not start: {server.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        asyncio.run(load(url, 1, 1))  # warm-up
        if args.health:
            idle, loaded = asyncio.run(health_under_load(url))
        elif args.health_8mb:
            idle, loaded = asyncio.run(health_during_8mb_prompts(url))
        else:
            served = {level: asyncio.run(load(url, level, args.requests_per_client)) for level in levels}
    finally:
        server.terminate()
        server.wait(timeout=60)
    if args.health or args.health_8mb:
        flag, load_name = (
            ("--health-8mb", "16 streams + 4 8-MB prompts")
            if args.health_8mb
            else ("--health", "64 streams + 8k-token prompt")
        )
        print(f"# serve_load {flag}: {MODEL}, {os.cpu_count()} cpus, {time.strftime('%Y-%m-%d')}")
        for name, values in (("idle", idle), (load_name, loaded)):
            print(
                f"/health {name:30s} n={len(values):4d}  p50 {percentile(values, 0.5) * 1e3:7.1f} ms  "
                f"p99 {percentile(values, 0.99) * 1e3:7.1f} ms  max {max(values) * 1e3:7.1f} ms",
                flush=True,
            )
        print(
            f"p99 under load / p99 idle: {percentile(loaded, 0.99) / percentile(idle, 0.99):.1f}x (goal: p99 < 100 ms)"
        )
        return
    print(
        f"# serve_load: {MODEL}, {NEW_TOKENS} new tokens per request, {args.requests_per_client} requests per client, "
        f"{os.cpu_count()} cpus, {time.strftime('%Y-%m-%d')}"
    )
    for level in levels:
        result = served[level]
        ceiling = offline_tokens_per_s(level, args.requests_per_client)
        print(
            f"clients {level:3d}: {result['requests_per_s']:6.2f} req/s  {result['tokens_per_s']:7.1f} tok/s (offline "
            f"LLM.generate {ceiling:7.1f} tok/s, ratio {result['tokens_per_s'] / ceiling:4.2f})  TTFT p50/p90/p99 "
            f"{result['ttft_p50'] * 1e3:6.0f}/{result['ttft_p90'] * 1e3:6.0f}/{result['ttft_p99'] * 1e3:6.0f} ms  ITL "
            f"p50/p90/p99 {result['itl_p50'] * 1e3:5.0f}/{result['itl_p90'] * 1e3:5.0f}/{result['itl_p99'] * 1e3:5.0f} "
            "ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
