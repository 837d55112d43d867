"""CPU the API server process spends per streamed token, against the engine core's in the same run.

Starts ``weft serve`` on tests/conftest.py's random 2-layer Llama (hidden size 64) with SmolLM2's
tokenizer, so that the forward costs little and the serving path dominates, then runs ``--clients``
concurrent streaming ``/v1/completions`` clients (spread over ``--client-processes`` processes, each
client a raw HTTP/1.1 connection so that the clients' own parsing stays cheap) sending
``--requests-per-client`` requests each (``max_tokens`` fixed, EOS ignored, usage included). It reports,
over the load alone, the API process's and the engine core's CPU seconds (user + system, all threads)
per streamed token, and the SSE chunks that carried them (a lagging consumer gets several tokens per
chunk). The baseline is the engine core's CPU per token in the same run: the API process should cost
less than the core it feeds.

``--profile FILE``: sample the API process with py-spy during the load (the thread holding the GIL,
flame-graph text).

On a CPU the engine core is slower than the API process, so each chunk carries about one token and the
per-chunk path (asyncio, starlette, h11, the socket) dominates. On a GPU the API process falls behind and
a chunk carries about a dozen tokens: the per-token receive path dominates. ``--receive-path`` measures
that path alone, in this process: the engine core's step outputs for 256 requests (msgpack, as the core
sends them) decoded and turned into text, stop checks and deltas by the API side's reader code, 12
steps per batch, with torch and transformers imported (a heap like a GPU server's); ``--freeze`` first
does what ``weft serve`` does after start-up (``gc.freeze()``).

Usage::

    python bench/serve_api_cpu.py [--clients 128] [--max-tokens 128] [--client-processes 2] [--profile api.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from structured_output import tiny_model  # noqa: E402


async def _one_stream(port: int, body: bytes) -> tuple[int, int, str]:
    """One streamed completion over a fresh connection: (completion tokens, data chunks, text)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    raw = await reader.read(-1)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(raw[:500].decode(errors="replace"))
    tokens, chunks, text = 0, 0, []
    for line in payload.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        chunks += 1
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            text.append(choice["text"])
    return tokens, chunks, "".join(text)


def _client_process(
    port: int,
    clients: int,
    per_client: int,
    first: int,
    max_tokens: int,
    start_at: float,
    results: multiprocessing.Queue,
) -> None:
    async def client(index: int) -> list[tuple[int, int, str]]:
        done = []
        for turn in range(per_client):
            body = json.dumps(
                {
                    # Token ids (a model with a cut vocabulary could not take every id the tokenizer makes).
                    "model": "tiny",
                    "prompt": [17 + (index * 31 + turn * 7 + k) % 900 for k in range(12)],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode()
            done.append(await _one_stream(port, body))
        return done

    async def all_clients() -> list[tuple[int, int, str]]:
        return [item for batch in await asyncio.gather(*(client(first + i) for i in range(clients))) for item in batch]

    time.sleep(max(0.0, start_at - time.time()))
    results.put(asyncio.run(all_clients()))


def _cpu_seconds(process: psutil.Process) -> tuple[float, float]:
    """(user, system) CPU seconds of every thread of ``process``."""
    times = process.cpu_times()
    return times.user, times.system


def _wait_ready(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
                connection.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                if connection.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the server did not start: {server.stderr.read().decode()[-3000:]}")
        time.sleep(0.3)


def run_load(
    port: int, clients: int, processes: int, per_client: int, max_tokens: int
) -> tuple[list[tuple[int, int, str]], float]:
    results: multiprocessing.Queue = multiprocessing.Queue()
    start_at = time.time() + 1.0  # every process imported and waiting
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    workers = [
        multiprocessing.Process(
            target=_client_process, args=(port, share, per_client, sum(shares[:i]), max_tokens, start_at, results)
        )
        for i, share in enumerate(shares)
    ]
    for worker in workers:
        worker.start()
    collected = [item for _ in workers for item in results.get(timeout=1200)]
    for worker in workers:
        worker.join()
    return collected, start_at


def receive_path(freeze: bool, requests: int = 256, steps: int = 128, steps_per_batch: int = 12) -> None:
    import asyncio
    import gc
    import random
    import threading

    import msgspec
    import torch  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401

    from weft.builtins.hf_tokenizer import HFTokenizer
    from weft.engine.api.async_engine import AsyncEngine
    from weft.engine.api.output_processor import OutputProcessor
    from weft.engine.api.streams import OutputStream
    from weft.engine.messages import CoreStats, EngineCoreOutput, FromCore, StepOutputs
    from weft.sampling_params import SamplingParams

    scratch = Path(tempfile.mkdtemp(prefix="weft-receive-"))
    try:
        tokenizer = HFTokenizer.from_folder(Path(tiny_model(scratch)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    random.seed(0)
    tokens = [[random.randrange(200, 20000) for _ in range(steps)] for _ in range(requests)]
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FromCore)
    messages = [
        encoder.encode(
            StepOutputs(
                [
                    EngineCoreOutput(f"r{r}", [tokens[r][step]], finish_reason="length" if step == steps - 1 else None)
                    for r in range(requests)
                ],
                CoreStats(),
            )
        )
        for step in range(steps)
    ]
    # The reader's side of an engine without a core process: its tables and lock, no observer.
    engine = AsyncEngine.__new__(AsyncEngine)
    engine.outputs, engine._streams, engine._lock, engine.observer = (
        OutputProcessor(tokenizer),
        {},
        threading.Lock(),
        None,
    )
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    for r in range(requests):
        engine.outputs.add(f"r{r}", [1, 2, 3], params)
        engine._streams[f"r{r}"] = OutputStream(asyncio.Queue(), 0)
    if freeze:
        gc.freeze()
    started, deliveries = time.process_time(), 0
    for first in range(0, steps, steps_per_batch):
        delivered, _ = engine._handle(
            [decoder.decode(message) for message in messages[first : first + steps_per_batch]]
        )
        deliveries += len(delivered)
    seconds = time.process_time() - started
    print(
        f"# serve_api_cpu --receive-path{' --freeze' if freeze else ''}: {requests} requests x {steps} tokens, "
        f"{steps_per_batch} steps per batch, {time.strftime('%Y-%m-%d')}"
    )
    print(f"receive path {seconds / (requests * steps) * 1e6:6.2f} us/token ({deliveries} deltas)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=49152,
        help="the model's vocabulary (SmolLM2's first ids): smaller makes the core's step cheaper, so "
        "that the API process falls behind it as on a GPU",
    )
    parser.add_argument("--profile", help="write a py-spy flame-graph text of the API process here")
    parser.add_argument("--receive-path", action="store_true", help="measure the per-token receive path alone (above)")
    parser.add_argument(
        "--freeze", action="store_true", help="with --receive-path: gc.freeze() first, as weft serve does"
    )
    args = parser.parse_args()
    if args.receive_path:
        receive_path(args.freeze)
        return
    scratch = Path(tempfile.mkdtemp(prefix="weft-serve-cpu-"))
    try:
        model = tiny_model(scratch, vocab_size=args.vocab_size)
        environment = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weft.cli",
                "serve",
                "--model",
                model,
                "--served-model-name",
                "tiny",
                "--port",
                str(args.port),
                "--max-num-seqs",
                str(args.clients),
                "--max-model-len",
                "512",
                "--max-num-batched-tokens",
                "4096",
                "--set",
                "server.max_queued_requests=4096",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=environment,
        )
        try:
            _wait_ready(args.port, server)
            api = psutil.Process(server.pid)
            core = next(child for child in api.children() if "spawn_main" in " ".join(child.cmdline()))
            run_load(args.port, min(8, args.clients), 1, 1, 8)  # warm-up
            api_before, core_before = _cpu_seconds(api), _cpu_seconds(core)
            profiler = None
            if args.profile:
                profiler = subprocess.Popen(
                    [
                        str(Path(sys.executable).parent / "py-spy"),
                        "record",
                        "-p",
                        str(server.pid),
                        "-f",
                        "raw",
                        "-r",
                        "200",
                        "-o",
                        args.profile,
                        "--nonblocking",
                        "--gil",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            results, started = run_load(
                args.port, args.clients, args.client_processes, args.requests_per_client, args.max_tokens
            )
            elapsed = time.time() - started
            (api_user, api_system), core_after = _cpu_seconds(api), _cpu_seconds(core)
            api_user, api_system = api_user - api_before[0], api_system - api_before[1]
            api_cpu, core_cpu = api_user + api_system, sum(core_after) - sum(core_before)
            if profiler is not None:
                profiler.send_signal(2)
                profiler.wait(timeout=60)
        finally:
            server.terminate()
            server.wait(timeout=60)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tokens = sum(result[0] for result in results)
    chunks = sum(result[1] for result in results)
    expected = len(results) * args.max_tokens
    assert tokens == expected, f"streamed {tokens} tokens, expected {expected}"
    print(
        f"# serve_api_cpu: tiny random Llama, {args.clients} streaming /v1/completions clients x "
        f"{args.requests_per_client} requests x {args.max_tokens} tokens, {os.cpu_count()} cpus, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(
        f"streamed {tokens} tokens in {chunks} chunks ({tokens / chunks:.2f} tokens/chunk) in {elapsed:.2f} s "
        f"({tokens / elapsed:.0f} tok/s)"
    )
    print(
        f"API process  {api_cpu:6.2f} CPU s  {api_cpu / tokens * 1e6:6.1f} us/token  {api_cpu / chunks * 1e6:6.1f} "
        f"us/chunk  (user {api_user:.2f} s, system {api_system:.2f} s)"
    )
    print(f"engine core  {core_cpu:6.2f} CPU s  {core_cpu / tokens * 1e6:6.1f} us/token")
    print(f"API / core CPU: {api_cpu / core_cpu:.2f}")


if __name__ == "__main__":
    main()
