r"""``weft proxy epd`` (msgspec, response bytes passed through) against a proxy that decodes and re-encodes JSON.

Both proxies run the same legs (:mod:`weft_disagg.epd`: an encode leg per image part, a prefill leg, a decode leg)
against fake upstreams (:func:`serve_upstream`, each a process of its own: a few lines of asyncio that write canned
bytes at once; the encode and prefill instances answer one token, whole, as real ones do), and the clients read with
aiohttp, so that what is measured is the proxies' own cost. The baseline, :class:`ReencodingProxy`, differs only
where the vLLM proxy that the reference change replaced did: it reads the request with the standard library's
``json`` and decodes every response (each SSE event of a stream, or the whole JSON) and encodes it again before
sending it on.

The load: ``--clients`` (64) concurrent clients, each sending chat requests with ``--images`` image parts, streamed
(``--stream``, the default: the decode upstream answers ``--events`` chat.completion.chunk events) or not, for
``--seconds`` per round; the proxies take turns for ``--rounds`` rounds, and the median requests/s of each is
compared. On a loaded machine the rounds vary: the ratio of medians is the figure::

    python bench/epd.py --clients 64 --seconds 10 --rounds 3

It prints one line per round and proxy, then ``requests/s: msgspec pass-through X, re-encoding Y, ratio X/Y``, and
the proxies' own CPU time per request (user + system seconds of the proxy process, from ``/proc``) with the
requests per CPU-second each could serve on a core of its own. On a machine shared with other work, where the
proxy is not what limits the load, the second ratio is the one that shows the proxies' difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp
import httpx

IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "iVBORw0KGgo" * 40}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chunk_events(count: int) -> list[bytes]:
    """A chat stream as ``weft serve`` writes it: ``count`` chat.completion.chunk events, then ``[DONE]``."""
    events = []
    for index in range(count):
        event = {
            "id": "chatcmpl-0123456789abcdef",
            "object": "chat.completion.chunk",
            "created": 1765000000,
            "model": "llava",
            "choices": [
                {"index": 0, "delta": {"content": f" token{index} 图片🌍"}, "logprobs": None, "finish_reason": None}
            ],
        }
        events.append(b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


def whole_answer(count: int) -> list[bytes]:
    body = {
        "id": "chatcmpl-0123456789abcdef",
        "object": "chat.completion",
        "created": 1765000000,
        "model": "llava",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": " ".join(f"token{index} 图片🌍" for index in range(count))},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 600, "completion_tokens": count, "total_tokens": 600 + count},
    }
    return [json.dumps(body, ensure_ascii=False).encode()]


def canned(status: str, content_type: str, chunks: list[bytes], stream: bool) -> bytes:
    """One whole HTTP/1.1 response: ``chunks`` as chunked transfer encoding (one chunk each, as ``weft serve``
    writes a stream's events) when ``stream``, else one body with its length."""
    head = f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n".encode()
    if not stream:
        body = b"".join(chunks)
        return head + f"content-length: {len(body)}\r\n\r\n".encode() + body
    body = b"".join(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for chunk in chunks)
    return head + b"transfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"


def serve_upstream(port: int, chunks: list[bytes], stream: bool) -> None:
    """A fake instance that answers every completion with the same bytes, written at once, on kept-alive connections:
    a few lines of asyncio, so that on a small machine the upstreams cost little beside the proxy measured (a
    Starlette app relaying 256 chunks costs about what the proxy does)."""
    kv_transfer = json.dumps({"kv_connector": "nixl", "role": "kv_producer", "side_channel_host": "127.0.0.1"})
    kv_transfer = kv_transfer[:-1] + ', "side_channel_port": 1, "tensor_parallel_size": 1}'
    completion = canned("200 OK", "text/event-stream" if stream else "application/json", chunks, stream)
    answers = {
        "/health": canned("200 OK", "text/plain", [b"ok"], False),
        "/kv_transfer": canned("200 OK", "application/json", [kv_transfer.encode()], False),
        "/v1/chat/completions": completion,
        "/v1/completions": completion,
    }
    missing = canned("404 Not Found", "text/plain", [b"not found"], False)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *headers = head.decode("latin-1").split("\r\n")
                for header in headers:
                    name, _, value = header.partition(":")
                    if name.lower() == "content-length" and int(value):
                        await reader.readexactly(int(value))
                writer.write(answers.get(request_line.split(" ")[1], missing))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(connection, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def reencoding_app(encode: list[str], prefill: list[str], decode: list[str]) -> Any:
    """The baseline proxy: :class:`weft_disagg.epd.EPDProxy`'s legs, with JSON decoded and encoded again."""
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse

    from weft_disagg.epd import EPDProxy
    from weft_disagg.pd import ProxyError, create_app

    class ReencodingProxy(EPDProxy):
        async def _completion(self, request: Request) -> Response:
            try:
                body = json.loads(await request.body())
            except ValueError as error:
                raise ProxyError(400, f"malformed JSON body: {error}", "invalid_request_error") from None
            headers = {"content-type": "application/json"}
            decode, response, prefill_task, _ = await self._send(request.url.path, body, headers, [])

            async def close() -> None:
                decode.in_flight -= 1
                response.release()
                if prefill_task is not None:
                    prefill_task.cancel()
                    await asyncio.gather(prefill_task, return_exceptions=True)

            if not body.get("stream"):
                try:
                    answer = json.loads(await response.read())
                finally:
                    await close()
                return Response(json.dumps(answer), status_code=response.status, media_type="application/json")

            async def events():
                buffer = b""
                try:
                    async for chunk, _ in response.content.iter_chunks():
                        buffer += chunk
                        while b"\n\n" in buffer:
                            event, buffer = buffer.split(b"\n\n", 1)
                            data = event.removeprefix(b"data: ")
                            if data == b"[DONE]":
                                yield b"data: [DONE]\n\n"
                            else:
                                yield b"data: " + json.dumps(json.loads(data)).encode() + b"\n\n"
                finally:
                    await close()

            return StreamingResponse(events(), status_code=response.status, media_type="text/event-stream")

    return create_app(ReencodingProxy(encode, prefill, decode, health_interval=60.0))


def serve_baseline(port: int, encode: list[str], prefill: list[str], decode: list[str]) -> None:
    import uvicorn

    uvicorn.run(reencoding_app(encode, prefill, decode), host="127.0.0.1", port=port, log_level="warning")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_up(url: str, path: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited while starting")
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not start")


async def load(url: str, clients: int, seconds: float, images: int, stream: bool) -> tuple[int, int]:
    """Requests answered (whole and well-formed) and failed, by ``clients`` concurrent clients for ``seconds``."""
    body = {
        "model": "llava",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "compare"}, *[IMAGE_PART] * images]}],
        "max_tokens": 32,
        "stream": stream,
    }
    content = json.dumps(body).encode()
    done, failed = 0, 0
    deadline = time.monotonic() + seconds
    # aiohttp (its HTTP parser is C) rather than httpx: the clients should cost little beside the proxy measured.
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def one_client() -> None:
            nonlocal done, failed
            while time.monotonic() < deadline:
                try:
                    async with session.post(
                        f"{url}/v1/chat/completions", data=content, headers={"content-type": "application/json"}
                    ) as answer:
                        received = await answer.read()
                    ok = answer.status == 200 and (received.endswith(b"[DONE]\n\n") or not stream)
                except (TimeoutError, aiohttp.ClientError):
                    ok = False
                done, failed = done + ok, failed + (not ok)

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return done, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=1, help="image parts per request (encode legs)")
    parser.add_argument("--events", type=int, default=32, help="tokens of each answer (SSE events when streamed)")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-baseline", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--urls", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        chunks = chunk_events(args.events) if args.stream else whole_answer(args.events)
        serve_upstream(args.serve_upstream, chunks, args.stream)
        return
    if args.serve_baseline:
        encode, prefill, decode = args.urls
        serve_baseline(args.serve_baseline, [encode], [prefill], [decode])
        return

    processes: list[subprocess.Popen] = []
    try:
        urls = {}
        for role in ("encode", "prefill", "decode"):
            port = free_port()
            urls[role] = f"http://127.0.0.1:{port}"
            # The encode and prefill legs ask for one token, not streamed: their instances answer a short whole body.
            shape = ["--events", str(args.events), "--stream" if args.stream else "--no-stream"]
            if role != "decode":
                shape = ["--events", "1", "--no-stream"]
            processes.append(start([sys.executable, __file__, "--serve-upstream", str(port), *shape]))
            wait_up(urls[role], "/health", processes[-1])
        proxies = {}
        port = free_port()
        proxies["msgspec pass-through"] = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "weft.cli", "proxy", "epd", "--encode", urls["encode"]]
        command += ["--prefill", urls["prefill"], "--decode", urls["decode"], "--port", str(port)]
        processes.append(start([*command, "--log-level", "warning", "--health-interval", "60"]))
        wait_up(proxies["msgspec pass-through"], "/health", processes[-1])
        port = free_port()
        proxies["re-encoding"] = f"http://127.0.0.1:{port}"
        baseline = [sys.executable, __file__, "--serve-baseline", str(port), "--urls"]
        processes.append(start([*baseline, urls["encode"], urls["prefill"], urls["decode"]]))
        wait_up(proxies["re-encoding"], "/health", processes[-1])

        rates: dict[str, list[float]] = {name: [] for name in proxies}
        per_cpu: dict[str, list[float]] = {name: [] for name in proxies}
        pids = dict(zip(proxies, (processes[-2].pid, processes[-1].pid), strict=True))
        for url in proxies.values():  # warm-up: connections, imports
            asyncio.run(load(url, args.clients, 1.0, args.images, args.stream))
        for round_index in range(args.rounds):
            for name, url in proxies.items():
                started, cpu = time.monotonic(), cpu_seconds(pids[name])
                done, failed = asyncio.run(load(url, args.clients, args.seconds, args.images, args.stream))
                rate = done / (time.monotonic() - started)
                used = cpu_seconds(pids[name]) - cpu
                rates[name].append(rate)
                per_cpu[name].append(done / max(used, 1e-9))
                print(
                    f"round {round_index + 1} {name}: {rate:.1f} requests/s ({done} answered, {failed} failed), "
                    f"proxy CPU {1000 * used / max(done, 1):.2f} ms per request"
                )
        fast, slow = (statistics.median(rates[name]) for name in proxies)
        print(
            f"requests/s ({args.clients} clients, {args.images} image(s), {'streamed' if args.stream else 'whole'}, "
            f"{args.events} tokens): msgspec pass-through {fast:.1f}, re-encoding {slow:.1f}, ratio {fast / slow:.2f}"
        )
        fast, slow = (statistics.median(per_cpu[name]) for name in proxies)
        print(
            f"requests per proxy CPU-second: msgspec pass-through {fast:.1f}, re-encoding {slow:.1f}, "
            f"ratio {fast / slow:.2f}"
        )
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
