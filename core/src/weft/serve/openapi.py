"""``GET /openapi.json``: the server's OpenAPI 3.1 document, generated from the protocol's msgspec Structs.

Request bodies are the request Structs of :mod:`weft.serve.protocol` (the same
types the handlers decode with), responses the response Structs; every error
is an ``ErrorResponse``. Streaming endpoints also answer ``text/event-stream``.
Fuzzers (schemathesis in the test suite) drive the API from this document.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from weft._version import __version__
from weft.serve import protocol as p

ENDPOINTS: list[tuple[str, str, str, type | None, type | str, bool]] = [
    # path, method, summary, request body, response body (or a text media type), streams
    ("/v1/chat/completions", "post", "Chat Completions", p.ChatCompletionRequest, p.ChatCompletion, True),
    ("/v1/completions", "post", "Completions", p.CompletionRequest, p.Completion, True),
    ("/v1/responses", "post", "Responses", p.ResponsesRequest, p.ResponseObject, True),
    ("/v1/models", "get", "The served model", None, p.ModelList, False),
    ("/tokenize", "post", "Token ids of a prompt or a conversation", p.TokenizeRequest, p.TokenizeResponse, False),
    ("/detokenize", "post", "Text of token ids", p.DetokenizeRequest, p.DetokenizeResponse, False),
    ("/health", "get", "200 ok while serving; 503 while draining or after the engine core died", None, "text/plain", False),
    ("/metrics", "get", "Prometheus metrics", None, "text/plain", False),
]


@cache
def openapi_document() -> bytes:
    bodies = [kind for _, _, _, request, response, _ in ENDPOINTS for kind in (request, response) if isinstance(kind, type)]
    schemas, components = msgspec.json.schema_components([*bodies, p.ErrorResponse], ref_template="#/components/schemas/{name}")
    schema_of = dict(zip([*bodies, p.ErrorResponse], schemas))
    error = {"description": "An error, in OpenAI's shape", "content": {"application/json": {"schema": schema_of[p.ErrorResponse]}}}
    paths: dict[str, Any] = {}
    for path, method, summary, request, response, streams in ENDPOINTS:
        if isinstance(response, str):
            content = {response: {"schema": {"type": "string"}}}
        else:
            content = {"application/json": {"schema": schema_of[response]}}
            if streams:
                content["text/event-stream"] = {"schema": {"type": "string", "description": "server-sent events"}}
        operation: dict[str, Any] = {
            "summary": summary, "operationId": f"{method}{path.replace('/', '_')}",
            "responses": {"200": {"description": "OK", "content": content}, "default": error},
        }
        if request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema_of[request]}}}
        paths[path] = {method: operation}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "Weft", "version": __version__,
                 "description": "OpenAI-compatible API of a weft serve process (see docs/serving.md)"},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "required when server.api_key or $WEFT_API_KEY is set"}},
        },
    }
    return msgspec.json.encode(document)


async def _openapi(request: Request) -> Response:
    return Response(openapi_document(), media_type="application/json")


def openapi_route() -> Route:
    return Route("/openapi.json", _openapi, methods=["GET"])
