"""Reading a request body into its msgspec Struct, or an :class:`HTTPError` naming what is wrong.

Checks, in order: the media type (JSON, else 415), the size (``server.max_body_bytes``,
else 413), the time the client takes to send it (``server.body_timeout``, else 408),
then the JSON itself: malformed (400), nested too deeply (400), a field of the
wrong type or range (400 naming the field), a field Weft does not implement or
does not know (400 naming it, :mod:`weft.serve.unsupported`).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import msgspec
from starlette.requests import Request

from weft.serve.unsupported import UNSUPPORTED, explain

MAX_NESTING = 64
"""Deepest nesting of objects and arrays a body may have (tool schemas need a dozen levels)."""

_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]*)`")


class HTTPError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.kind = kind or error_type(status)


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status."""
    return {401: "authentication_error", 404: "not_found_error", 408: "timeout_error", 429: "rate_limit_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )


def check_media_type(request: Request) -> None:
    """JSON or nothing declared; anything else (a browser form, text/plain) is a 415."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise HTTPError(415, f"Content-Type {declared!r} is not accepted; send the body as JSON with "
                             f"'Content-Type: application/json'")


async def read_bytes(request: Request, limit: int, timeout: float) -> bytes:
    """The raw body, at most ``limit`` bytes, received within ``timeout`` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes (server.max_body_bytes)")
    body = bytearray()

    async def receive() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise HTTPError(413, f"request body exceeds the limit of {limit} bytes (server.max_body_bytes)")

    try:
        await asyncio.wait_for(receive(), timeout)
    except TimeoutError:
        raise HTTPError(408, f"the request body did not arrive within {timeout:g} s (server.body_timeout)",
                        headers={"Connection": "close"}) from None
    return bytes(body)


def decode(data: bytes, body_type: type[Any], endpoint: str) -> Any:
    """``data`` as ``body_type``; HTTPError 400 naming the field for anything malformed or unsupported."""
    try:
        body = msgspec.json.decode(data, type=body_type)
    except msgspec.ValidationError as error:
        if _UNKNOWN.match(str(error)) is None:
            raise _field_error(error) from None
        body = _without_noop_fields(data, body_type, endpoint)
    except msgspec.DecodeError as error:
        raise HTTPError(400, f"malformed JSON body: {error}") from None
    except RecursionError:
        raise HTTPError(400, f"the JSON body is nested too deeply (more than {MAX_NESTING} levels)") from None
    too_deep = _nested_too_deeply(msgspec.to_builtins(body))
    if too_deep is not None:
        shown = too_deep if len(too_deep) <= 80 else too_deep[:80] + "..."
        raise HTTPError(400, f"{shown}: nested more than {MAX_NESTING} levels deep", param=shown)
    return body


def _without_noop_fields(data: bytes, body_type: type[Any], endpoint: str) -> Any:
    """A body with unknown fields: refuse the first that matters, decode again without the no-op ones."""
    raw = msgspec.json.decode(data)
    declared = {field.encode_name for field in msgspec.structs.fields(body_type)}
    for name in [key for key in raw if key not in declared]:
        reason = explain(endpoint, name, raw[name])
        if reason is not None:
            raise HTTPError(400, reason, param=name)
        if name not in _noop_names(endpoint):
            raise HTTPError(400, f"{name}: unknown field; this endpoint accepts {', '.join(sorted(declared))} "
                                 f"(see docs/serving.md)", param=name)
        del raw[name]
    try:
        return msgspec.convert(raw, body_type)
    except msgspec.ValidationError as error:
        raise _field_error(error) from None


def _noop_names(endpoint: str) -> set[str]:
    return set(UNSUPPORTED.get(endpoint, {}))


def _field_error(error: msgspec.ValidationError) -> HTTPError:
    """A 400 naming the field msgspec's error points at (its ``$.messages[0].content`` as ``messages[0].content``)."""
    message, _, path = str(error).partition(" - at `$")
    field = path.rstrip("`").lstrip(".") or None
    return HTTPError(400, f"{field or 'body'}: {message.replace('`', '')}", param=field)


def _nested_too_deeply(value: Any) -> str | None:
    """The path of the first value nested more than :data:`MAX_NESTING` levels deep, or None."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_NESTING:
            return path.lstrip(".")
        if isinstance(node, dict):
            stack.extend((child, f"{path}.{key}", depth + 1) for key, child in node.items() if isinstance(child, (dict, list)))
        elif isinstance(node, list):
            stack.extend((child, f"{path}[{index}]", depth + 1) for index, child in enumerate(node)
                         if isinstance(child, (dict, list)))
    return None
