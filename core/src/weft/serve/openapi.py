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
    (
        "/health",
        "get",
        "200 ok while serving; 503 while draining or after the engine core died",
        None,
        "text/plain",
        False,
    ),
    ("/metrics", "get", "Prometheus metrics", None, "text/plain", False),
]


_SSE_EVENT = {
    "description": "One server-sent event (as OpenAPI 3.1 describes a stream: its schema is each event's). "
    "Its data is a JSON chunk, or an error body, or the final [DONE].",
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def _examples(model: str) -> dict[str, dict[str, Any]]:
    """A request body that succeeds, per endpoint (documentation, and the fuzzer's explicit cases)."""
    chat = [{"role": "user", "content": "Name a colour."}]
    return {
        "/v1/chat/completions": {"model": model, "messages": chat, "max_tokens": 8},
        "/v1/completions": {"model": model, "prompt": "The sky is", "max_tokens": 8},
        "/v1/responses": {"model": model, "input": "Name a colour.", "max_output_tokens": 8},
        "/tokenize": {"model": model, "prompt": "Hello world"},
        "/detokenize": {"model": model, "tokens": [1, 2, 3]},
    }


@cache
def openapi_document(model: str) -> bytes:
    bodies = [
        kind for _, _, _, request, response, _ in ENDPOINTS for kind in (request, response) if isinstance(kind, type)
    ]
    schemas, components = msgspec.json.schema_components(
        [*bodies, p.ErrorResponse], ref_template="#/components/schemas/{name}"
    )
    schema_of = dict(zip([*bodies, p.ErrorResponse], schemas, strict=True))
    error = {
        "description": "An error, in OpenAI's shape",
        "content": {"application/json": {"schema": schema_of[p.ErrorResponse]}},
    }
    paths: dict[str, Any] = {}
    for path, method, summary, request, response, streams in ENDPOINTS:
        if isinstance(response, str):
            content = {response: {"schema": {"type": "string"}}}
        else:
            content = {"application/json": {"schema": schema_of[response]}}
            if streams:
                content["text/event-stream"] = {"schema": _SSE_EVENT}
        operation: dict[str, Any] = {
            "summary": summary,
            "operationId": f"{method}{path.replace('/', '_')}",
            "responses": {"200": {"description": "OK", "content": content}, "default": error},
        }
        if request is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": schema_of[request],
                        "example": _examples(model)[path],
                    }
                },
            }
        paths[path] = {method: operation}
    document = {
        "openapi": "3.1.0",
        "info": {
            "title": "Weft",
            "version": __version__,
            "description": "OpenAI-compatible API of a weft serve process (see docs/serving.md)",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "required when server.api_key or $WEFT_API_KEY is set",
                }
            },
        },
    }
    return msgspec.json.encode(document)


def openapi_route(model: str) -> Route:
    """``GET /openapi.json`` for a server of ``model`` (its name goes into the examples)."""

    async def document(request: Request) -> Response:
        return Response(openapi_document(model), media_type="application/json")

    return Route("/openapi.json", document, methods=["GET"])
