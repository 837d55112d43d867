"""Reading a request body into its msgspec Struct, or an :class:`HTTPError` naming what is wrong.

Checks, in order: the media type (JSON, else 415), the size (``server.max_body_bytes``,
else 413), the time the client takes to send it (``server.body_timeout``, else 408),
then the JSON itself: more than :data:`MAX_CONTAINERS` objects and arrays (400),
malformed (400), a field of the wrong type or range (400 naming the field), a
field Weft does not implement (400 naming it, :mod:`weft.serve.unsupported`), a
field no API knows inside an object of the body (400 naming it), nested too deeply
(400). A top-level field no API knows is dropped and reported to the caller (as
vLLM does: clients send vendors' fields), or a 400 with ``server.strict_fields``.
Decoding runs on a worker thread (:meth:`weft.serve.server.Server.read`).
"""

from __future__ import annotations

import asyncio
import itertools
import re
from typing import Any

import msgspec
from starlette.requests import Request

from weft.serve.unsupported import UNSUPPORTED, explain

MAX_NESTING = 64
"""Deepest nesting of objects and arrays a body may have (tool schemas need a dozen levels)."""
MAX_CONTAINERS = 65536
"""Most objects and arrays a body may hold, counted before it is decoded: decoding a million tiny arrays
takes seconds, all of them holding the interpreter's lock (a 2,000-message conversation holds some thousands)."""

_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]*)`")


class HTTPError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.kind = kind or error_type(status)


class ClientGone(Exception):
    """The client of a request being collected disconnected: its engine requests were aborted and nothing is
    answered (raising ``asyncio.CancelledError`` instead had uvicorn log a 40-line traceback per disconnect)."""


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
        raise HTTPError(
            415,
            f"Content-Type {declared!r} is not accepted; send the body as JSON with 'Content-Type: application/json'",
        )


async def read_bytes(request: Request, limit: int, timeout: float) -> bytes:
    """The raw body, at most ``limit`` bytes, received within ``timeout`` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(
            413, f"request body of {declared} bytes exceeds the limit of {limit} bytes (server.max_body_bytes)"
        )
    body = bytearray()

    async def receive() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise HTTPError(413, f"request body exceeds the limit of {limit} bytes (server.max_body_bytes)")

    try:
        await asyncio.wait_for(receive(), timeout)
    except TimeoutError:
        raise HTTPError(
            408,
            f"the request body did not arrive within {timeout:g} s (server.body_timeout)",
            headers={"Connection": "close"},
        ) from None
    return bytes(body)


def decode(data: bytes, body_type: type[Any], endpoint: str, strict_fields: bool = True) -> tuple[Any, list[str]]:
    """``data`` as ``body_type``, and the top-level fields no API knows that were dropped (``strict_fields``: none
    are, each is a 400); HTTPError 400 naming the field for anything malformed or unsupported.
    Call it on a worker thread: a large body takes a while to check."""
    containers, depth = _containers_and_depth(data)
    if containers > MAX_CONTAINERS:
        raise HTTPError(
            400,
            f"the JSON body holds {containers} objects and arrays; at most {MAX_CONTAINERS} are "
            f"accepted (send long token lists as one array)",
        )
    ignored: list[str] = []
    try:
        body = _parse(data, body_type)
    except msgspec.ValidationError as error:
        if _UNKNOWN.match(str(error)) is None or _path_of(error):
            raise _field_error(error, body_type) from None
        body, ignored = _without_unknown_fields(data, body_type, endpoint, strict_fields)
    # The body's own object is a level of ``depth``, not of _nested_too_deeply's.
    too_deep = _nested_too_deeply(msgspec.to_builtins(body)) if depth > MAX_NESTING + 1 else None
    if too_deep is not None:
        shown = too_deep if len(too_deep) <= 80 else too_deep[:80] + "..."
        raise HTTPError(400, f"{shown}: nested more than {MAX_NESTING} levels deep", param=shown)
    return body, ignored


def _parse(data: bytes, body_type: Any) -> Any:
    """msgspec's decoding; malformed JSON and JSON nested deeper than msgspec goes are 400s (a
    ValidationError passes: the caller names the field)."""
    try:
        return msgspec.json.decode(data, type=body_type)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError as error:
        raise HTTPError(400, f"malformed JSON body: {error}") from None
    except RecursionError:
        raise HTTPError(400, f"the JSON body is nested too deeply (more than {MAX_NESTING} levels)") from None


def _without_unknown_fields(
    data: bytes, body_type: type[Any], endpoint: str, strict_fields: bool
) -> tuple[Any, list[str]]:
    """A body with top-level fields its Struct does not declare: refuse the first that matters (a feature Weft does
    not implement, or any unknown field with ``strict_fields``), decode again without the others; returns the
    body and the unknown fields dropped (the no-op values of :mod:`weft.serve.unsupported`'s rows are not
    listed: Weft knows them)."""
    raw = _parse(data, Any)
    declared = {field.encode_name for field in msgspec.structs.fields(body_type)}
    ignored = []
    for name in [key for key in raw if key not in declared]:
        reason = explain(endpoint, name, raw[name])
        if reason is not None:
            raise HTTPError(400, reason, param=name)
        if name not in _noop_names(endpoint):
            if strict_fields:
                raise HTTPError(
                    400,
                    f"{name}: unknown field; this endpoint accepts {', '.join(sorted(declared))} "
                    f"(see docs/serving.md; server.strict_fields is on)",
                    param=name,
                )
            ignored.append(name)
        del raw[name]
    try:
        return msgspec.convert(raw, body_type), ignored
    except msgspec.ValidationError as error:
        raise _field_error(error, body_type) from None


def _noop_names(endpoint: str) -> set[str]:
    return set(UNSUPPORTED.get(endpoint, {}))


def _field_error(error: msgspec.ValidationError, body_type: type[Any]) -> HTTPError:
    """A 400 naming the field msgspec's error points at (its ``$.messages[0].content`` as ``messages[0].content``);
    an unknown field inside an object is named with its path, and the object's fields are listed."""
    message = str(error).partition(" - at `$")[0]
    path = _path_of(error)
    unknown = _UNKNOWN.match(message)
    if unknown is not None:
        field = f"{path}.{unknown['field']}" if path else unknown["field"]
        accepted = _fields_at(msgspec.inspect.type_info(body_type), path)
        listed = f"; it accepts {', '.join(accepted)}" if accepted else ""
        return HTTPError(400, f"{field}: unknown field{listed} (see docs/serving.md)", param=field)
    return HTTPError(400, f"{path or 'body'}: {message.replace('`', '')}", param=path or None)


def _path_of(error: msgspec.ValidationError) -> str:
    """The location msgspec's error names, as ``messages[0].content`` ("" for the body itself)."""
    return str(error).partition(" - at `$")[2].rstrip("`").lstrip(".")


def _fields_at(info: msgspec.inspect.Type, path: str) -> list[str]:
    """The field names of the object at ``path`` of a body of type ``info`` (empty when not a Struct)."""
    for name, _index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        info = _member(info, msgspec.inspect.StructType if name else msgspec.inspect.ListType)
        if isinstance(info, msgspec.inspect.StructType):
            info = next((field.type for field in info.fields if field.encode_name == name), None)
        elif isinstance(info, msgspec.inspect.ListType):
            info = info.item_type
        if info is None:
            return []
    struct = _member(info, msgspec.inspect.StructType)
    return [field.encode_name for field in struct.fields] if struct is not None else []


def check_json_text(text: str, field: str) -> None:
    """A JSON document sent as a string (``structured_outputs.json`` as text) gets the body's own limits: at most
    :data:`MAX_CONTAINERS` objects and arrays, nested at most :data:`MAX_NESTING` levels deep. ValueError naming
    ``field`` otherwise (unchecked, a deep one reached the interpreter's recursion limit in the grammar compiler)."""
    containers, depth = _containers_and_depth(text.encode())
    if containers > MAX_CONTAINERS:
        raise ValueError(f"{field}: holds more than {MAX_CONTAINERS} objects and arrays; send a smaller schema")
    if depth > MAX_NESTING:
        raise ValueError(f"{field}: nested more than {MAX_NESTING} levels deep; send a flatter schema")


def _member(info: Any, kind: type) -> Any:
    """``info`` itself, or the member of its union, of the kind wanted (None if it has none)."""
    if isinstance(info, msgspec.inspect.UnionType):
        return next((member for member in info.types if isinstance(member, kind)), None)
    return info if isinstance(info, kind) else None


def _containers_and_depth(data: bytes) -> tuple[int, int]:
    """How many objects and arrays the JSON ``data`` holds, and how deep they nest (at most: brackets inside
    strings count until strings are cut out), in C (walking the decoded body, which names the value too
    deep, takes seconds for a large one)."""
    brackets = data.count(b"[") + data.count(b"{")
    if brackets <= MAX_NESTING + 1:
        return brackets, brackets
    structure = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    depth = max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, structure)), default=0)
    return structure.count(b"[") + structure.count(b"{"), depth


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_BRACKET_STEP = [{ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}.get(byte, 0) for byte in range(256)]


def _nested_too_deeply(value: Any) -> str | None:
    """The path of the first value nested more than :data:`MAX_NESTING` levels deep, or None."""
    stack: list[tuple[Any, int, Any]] = [(value, 0, None)]
    while stack:
        node, depth, where = stack.pop()
        if depth > MAX_NESTING:
            return _path(where)
        children = node.items() if isinstance(node, dict) else enumerate(node)
        # ``where``: (parent's where, key), spelled out only for the value that is too deep.
        stack.extend((child, depth + 1, (where, key)) for key, child in children if isinstance(child, (dict, list)))
    return None


def _path(where: Any) -> str:
    keys = []
    while where is not None:
        where, key = where
        keys.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(keys)).lstrip(".")
