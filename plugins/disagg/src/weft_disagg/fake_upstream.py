"""An upstream that answers completions with fixed bytes: for measuring the proxy's own overhead
(``bench/pd.py``) and checking that it passes bytes through untouched.

It plays both roles: ``GET /kv_transfer`` names a side channel (nothing listens there; the
proxy only passes the address on), and ``POST /v1/completions`` or ``/v1/chat/completions``
streams ``chunks`` (a list of byte strings; each is written as one body chunk) with status 200.
A request body may steer the answer of a decode leg (or a direct request), for tests:
``"fake_status": 503`` answers that status with an OpenAI error body, ``"fake_fail_times": n``
only the first ``n`` times, counted over every fake upstream of the process by ``"fake_key"``;
``"fake_prefill_status": 503`` answers a prefill leg so; ``"fake_delay": seconds`` holds a decode
leg's answer back, ``"fake_prefill_delay": seconds`` a prefill leg's. ``POST /kv_transfer/abandon``
bodies are recorded in ``app.state.abandoned``. ``"fake_await_prefill": true`` makes a decode leg behave as a
real decode instance does: it answers only once its transfer's KV "arrived", i.e. the prefill leg with its
``transfer_id`` was answered 200 by a fake upstream of the process, or the transfer was abandoned (then a real
instance computes the prompt itself), waiting at most :data:`AWAIT_PREFILL_SECONDS`. Tests that count legs use it
instead of a delay: a delay only makes it likely that the prefill leg arrives before the decode answer ends (the
proxy cancels a prefill leg still on its way then), and on a loaded machine it sometimes did not.

Run it alone with ``python -m weft_disagg.fake_upstream --port 9000 --chunk-bytes 64 --chunks 1000``.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

_failures: dict[str, int] = {}
"""Answers failed so far per ``fake_key``, over every fake upstream of the process."""

AWAIT_PREFILL_SECONDS = 30.0
"""How long a decode leg with ``fake_await_prefill`` waits for its transfer at most (then it answers anyway)."""

KEPT_TRANSFERS = 10_000
"""Transfers remembered at most (the oldest are forgotten: a benchmark sends many)."""

_transfers: OrderedDict[str, threading.Event] = OrderedDict()
"""Transfer id -> set once its KV "arrived" (prefill answered 200, or abandoned), over every fake upstream of the
process; the upstreams run on their own threads and event loops."""
_transfers_lock = threading.Lock()


def _transfer(transfer_id: str) -> threading.Event:
    with _transfers_lock:
        event = _transfers.setdefault(transfer_id, threading.Event())
        if len(_transfers) > KEPT_TRANSFERS:
            _transfers.popitem(last=False)
        return event


async def _await_transfer(transfer_id: str) -> None:
    arrived, deadline = _transfer(transfer_id), time.monotonic() + AWAIT_PREFILL_SECONDS
    while not arrived.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


def create_app(chunks: Sequence[bytes], side_channel_port: int = 1) -> Starlette:
    seen: list[dict] = []
    abandoned: list[dict] = []

    async def completion(request: Request) -> Response:
        body = msgspec.json.decode(await request.body())
        seen.append(body)
        transfer = body.get("kv_transfer_params") or {}
        prefill_leg = transfer.get("do_remote_decode")
        status = body.get("fake_prefill_status") if prefill_leg else body.get("fake_status")
        if status is not None:
            key = str(body.get("fake_key", ""))
            _failures[key] = _failures.get(key, 0) + 1
            if _failures[key] <= body.get("fake_fail_times", 1 << 30):
                error = {
                    "error": {"message": f"fake upstream answers {status}", "type": "server_error", "code": str(status)}
                }
                return JSONResponse(error, status_code=status)

        delay = body.get("fake_prefill_delay") if prefill_leg else body.get("fake_delay")
        if delay:
            await asyncio.sleep(float(delay))
        if prefill_leg and "transfer_id" in transfer:
            _transfer(transfer["transfer_id"]).set()
        elif body.get("fake_await_prefill") and transfer.get("do_remote_prefill") and "transfer_id" in transfer:
            await _await_transfer(transfer["transfer_id"])

        if not body.get("stream") and len(chunks) == 1:  # a whole answer, with its length, as weft serve sends one
            return Response(chunks[0], media_type="application/json")

        async def stream() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        return StreamingResponse(stream(), media_type="text/event-stream" if body.get("stream") else "application/json")

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def abandon(request: Request) -> Response:
        abandoned.append(msgspec.json.decode(await request.body()))
        if isinstance(abandoned[-1].get("transfer_id"), str):
            _transfer(abandoned[-1]["transfer_id"]).set()
        return JSONResponse({"abandoned": abandoned[-1].get("transfer_id")})

    async def kv_transfer(request: Request) -> Response:
        return JSONResponse(
            {
                "kv_connector": "nixl",
                "role": "kv_producer",
                "side_channel_host": "127.0.0.1",
                "side_channel_port": side_channel_port,
                "tensor_parallel_size": 1,
            }
        )

    app = Starlette(
        routes=[
            Route("/v1/completions", completion, methods=["POST"]),
            Route("/v1/chat/completions", completion, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/kv_transfer", kv_transfer, methods=["GET"]),
            Route("/kv_transfer/abandon", abandon, methods=["POST"]),
        ]
    )
    app.state.seen = seen
    app.state.abandoned = abandoned
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--chunk-bytes", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=1000)
    args = parser.parse_args(argv)
    chunk = (b"data: " + b"x" * max(args.chunk_bytes - 8, 0) + b"\n\n")[: args.chunk_bytes]
    uvicorn.run(create_app([chunk] * args.chunks), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
