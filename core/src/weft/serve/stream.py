"""Server-sent events shared by the chat and text completion APIs: the chunk stream of one request's
choices, and the error event that ends a failed one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from weft.engine.api.streams import Delta
from weft.serve import fields
from weft.serve import protocol as p
from weft.serve.body import error_type
from weft.serve.server import Server, sse

logger = logging.getLogger("weft.serve")

LOWEST_LOGPROB = -9999.0
"""What a log-probability below it (a token a mask or bias removed: -inf) is sent as: JSON has no
infinity, and vLLM's API sends the same floor."""


def finite(logprob: float) -> float:
    return logprob if logprob >= LOWEST_LOGPROB else LOWEST_LOGPROB  # NaN fails the comparison too


def sse_error(message: str, status: int) -> bytes:
    """The event that ends a failed stream (``[DONE]`` follows), shaped like OpenAI's error body."""
    return sse(p.ErrorResponse(p.ErrorBody(message=message, type=error_type(status), code=str(status))))


async def sse_stream(
    server: Server,
    output: asyncio.Queue,
    ids: list[str],
    prompts: list[list[int]],
    head: dict[str, Any],
    include_usage: bool,
    opening: list[dict[str, Any]],
    render: Callable[[Delta], dict[str, Any] | None],
) -> AsyncIterator[bytes]:
    """Chunks of a chat or text completion stream: ``opening`` choices, one per delta ``render`` keeps,
    the usage chunk, ``[DONE]``; or up to an error event, then ``[DONE]``. Leaving early (a disconnect)
    aborts the requests.

    Each chunk is ``head``'s JSON, then its choice's, then ``"usage":null`` where usage was asked for: the
    two ends are encoded once per stream. The events of the deltas already queued when this stream wakes go
    out in one write (several choices, or a stream that fell behind)."""
    start, end = _chunk_ends(head, include_usage)
    encode = msgspec.json.encode
    last: list[list[Delta]] = [[] for _ in ids]
    events: list[bytes] = []
    try:
        for choice in opening:
            yield start + encode(choice) + end
        pending = len(ids)
        failed = False
        while pending and not failed:
            delta: Delta = await output.get()
            while True:
                if delta.error:
                    events.append(sse_error(delta.error, delta.error_status))
                    failed = True
                    break
                last[delta.index] = [delta]
                pending -= delta.finish_reason is not None
                choice = render(delta)
                if choice is not None:
                    events.append(start + encode(choice) + end)
                if not pending or output.empty():
                    break
                delta = output.get_nowait()
            if events:
                batch, events = b"".join(events), []
                yield batch
        if include_usage and not pending:
            yield sse({**head, "choices": [], "usage": msgspec.to_builtins(fields.usage(prompts, last))})
    except Exception:  # after the headers went out: the client gets an error event, the log the details
        logger.exception("internal error in stream %s", head["id"])
        server.metrics.failed("internal")
        yield b"".join(events) + sse_error(
            f"internal error in request {head['id']}; the server log has the details", 500
        )
    finally:
        for engine_request_id in ids:
            server.engine.abort(engine_request_id)
    yield b"data: [DONE]\n\n"


def _chunk_ends(head: dict[str, Any], include_usage: bool) -> tuple[bytes, bytes]:
    """The bytes before and after the choice in ``sse({**head, "choices": [choice], "usage": None})``
    (without ``usage`` unless ``include_usage``)."""
    start = b"data: " + msgspec.json.encode(head)[:-1] + b',"choices":['
    return start, b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
