"""The small endpoints: ``GET /v1/models``, ``POST /tokenize`` and ``/detokenize`` (vLLM's), ``GET /health``
and ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from weft.serve import protocol as p
from weft.serve.body import HTTPError
from weft.serve.server import server_of, struct_response


async def models(request: Request) -> Response:
    server = server_of(request)
    card = p.ModelCard(
        id=server.model_name,
        object="model",
        created=server.created,
        owned_by="weft",
        max_model_len=server.max_model_len,
    )
    return struct_response(p.ModelList(object="list", data=[card]))


async def tokenize(request: Request) -> Response:
    server = server_of(request)
    body: p.TokenizeRequest = await server.read(request, p.TokenizeRequest, "tokenize")
    server.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise HTTPError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        tokens = await server.engine.off_loop(server.chat_prompt, body.messages, True)
    else:
        try:
            tokens = await server.engine.off_loop(
                server.engine.frontend.encode_prompt, body.prompt, body.add_special_tokens
            )
        except ValueError as error:
            raise HTTPError(400, f"prompt: {error}", param="prompt") from None
    return struct_response(p.TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=server.max_model_len))


async def detokenize(request: Request) -> Response:
    server = server_of(request)
    body: p.DetokenizeRequest = await server.read(request, p.DetokenizeRequest, "detokenize")
    server.check_model(body.model)
    bad = [token for token in body.tokens if not 0 <= token < server.tokenizer.vocab_size]
    if bad:
        raise HTTPError(
            400, f"tokens: ids must be in [0, {server.tokenizer.vocab_size}); got {bad[:5]}", param="tokens"
        )
    text = await server.engine.off_loop(server.tokenizer.decode, body.tokens, False)
    return struct_response(p.DetokenizeResponse(prompt=text))


async def health(request: Request) -> Response:
    server = server_of(request)
    if (problem := server.engine.unhealthy()) is not None:
        return PlainTextResponse(problem, status_code=503)
    if not server.engine.accepting:
        return PlainTextResponse("shutting down", status_code=503)
    return PlainTextResponse("ok")


async def metrics(request: Request) -> Response:
    server = server_of(request)
    return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
