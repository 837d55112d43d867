"""The starlette app: OpenAI Chat Completions, Completions and Responses, models, health, metrics.

Every handler validates its body into a msgspec Struct (:mod:`weft.serve.body`),
checks the model name (a plain string comparison: a request never names a path),
turns the request into engine requests (one per prompt and choice) and either
collects their deltas or streams them as server-sent events. Decoding bodies,
tokenization, chat templating and detokenization of prompts run on the engine's
tokenizer threads (:meth:`weft.engine.api.async_engine.AsyncEngine.off_loop`), never
on the event loop. Leaving a handler for any reason (a client that disconnects
included) aborts the engine requests that are still running, which frees their
KV blocks. A stream that ends in an error sends an OpenAI-shaped error event,
then ``[DONE]``. An unexpected exception is logged with the request's id and
answered with a generic 500 naming that id, never with the exception's text.
The state behind the routes, shared with :mod:`weft.serve.responses`, is
:class:`weft.serve.server.Server`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from weft.config import WeftConfig
from weft.contracts.structured_output import StructuredOutputsParams
from weft.engine.api.async_engine import AsyncEngine
from weft.engine.api.streams import Delta
from weft.outputs import Logprob
from weft.serve import protocol as p
from weft.serve import structured, tools
from weft.serve.body import HTTPError, error_type
from weft.serve.openapi import openapi_route
from weft.serve.responses import responses
from weft.serve.server import Server, field_of, request_id, sse, start_constrained

Handler = Callable[[Request], Awaitable[Response]]
logger = logging.getLogger("weft.serve")


def error_response(error: HTTPError) -> Response:
    body = p.ErrorResponse(p.ErrorBody(message=error.message, type=error.kind, param=error.param, code=str(error.status)))
    return Response(msgspec.json.encode(body), status_code=error.status, media_type="application/json", headers=error.headers)


def _sse_error(message: str, status: int) -> bytes:
    """The event that ends a failed stream (``[DONE]`` follows), shaped like OpenAI's error body."""
    return sse(p.ErrorResponse(p.ErrorBody(message=message, type=error_type(status), code=str(status))))


LOWEST_LOGPROB = -9999.0
"""What a log-probability below it (a token a mask or bias removed: -inf) is sent as: JSON has no
infinity, and vLLM's API sends the same floor."""


def _finite(logprob: float) -> float:
    return logprob if logprob >= LOWEST_LOGPROB else LOWEST_LOGPROB  # NaN fails the comparison too


def _chat_logprobs(entries: list[dict[int, Logprob]], tokens: list[int], top: int) -> dict[str, Any]:
    content = []
    for token, entry in zip(tokens, entries):
        chosen = entry[token]
        ranked = sorted((lp for lp in entry.values()), key=lambda lp: lp.rank)[:top] if top else []
        content.append({
            "token": chosen.decoded_token, "logprob": _finite(chosen.logprob), "bytes": list(chosen.decoded_token.encode()),
            "top_logprobs": [{"token": lp.decoded_token, "logprob": _finite(lp.logprob), "bytes": list(lp.decoded_token.encode())}
                             for lp in ranked],
        })
    return {"content": content}


def _top_with_chosen(entry: dict[int, Logprob], token: int, top: int) -> dict[str, float]:
    """A completion's ``top_logprobs`` entry: the ``top`` most likely tokens and the chosen one (OpenAI's
    legacy API: up to ``logprobs + 1`` entries)."""
    ranked = sorted(entry.values(), key=lambda lp: lp.rank)[:top]
    chosen = entry[token]
    if all(lp is not chosen for lp in ranked):
        ranked.append(chosen)
    return {lp.decoded_token: _finite(lp.logprob) for lp in ranked}


def _completion_logprobs(entries: list[dict[int, Logprob]], tokens: list[int], top: int, offset: int) -> dict[str, Any]:
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        chosen = entry[token]
        result["tokens"].append(chosen.decoded_token)
        result["token_logprobs"].append(_finite(chosen.logprob))
        result["top_logprobs"].append(_top_with_chosen(entry, token, top))
        result["text_offset"].append(offset)
        offset += len(chosen.decoded_token)
    return result


def internal_error(request: Request) -> HTTPError:
    """The 500 for an unexpected exception: a generic message naming the request (the log has the rest)."""
    logger.exception("internal error in request %s (%s %s)", request_id(request), request.method, request.url.path)
    return HTTPError(500, f"internal error in request {request_id(request)}; the server log has the details")


def create_app(engine: AsyncEngine, config: WeftConfig, extra_routes: list[Any] = ()) -> Starlette:
    server = Server(engine, config)

    def endpoint(handler: Callable[[Server, Request], Awaitable[Response]], auth: bool = True) -> Handler:
        async def wrapped(request: Request) -> Response:
            try:
                if auth:
                    server.check_auth(request)
                response = await handler(server, request)
            except HTTPError as error:
                response = error_response(error)
            except Exception:
                response = error_response(internal_error(request))
                server.metrics.failed("internal")
            response.headers["X-Request-Id"] = request_id(request)
            return response

        return wrapped

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.drain(config.server.shutdown_timeout)  # done already after a signal (weft.serve.lifecycle)
        engine.stop()

    routes = [
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/responses", endpoint(responses), methods=["POST"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/metrics", endpoint(metrics, auth=False), methods=["GET"]),
        openapi_route(server.model_name),
        *extra_routes,
    ]
    async def http_error(request: Request, error: Exception) -> Response:
        status = getattr(error, "status_code", 500)
        message = f"{request.method} {request.url.path}: {getattr(error, 'detail', 'error')}"
        return error_response(HTTPError(status, message))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={StarletteHTTPException: http_error})
    app.state.server = server
    return app


# Handlers.


async def chat_completions(server: Server, request: Request) -> Response:
    body: p.ChatCompletionRequest = await server.read(request, p.ChatCompletionRequest, "chat.completions")
    server.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise HTTPError(400, f"top_logprobs ({body.top_logprobs}) needs logprobs: set logprobs to true, or leave "
                        "top_logprobs out", param="top_logprobs")
    settings, constraint, field = _chat_tools_and_constraint(body)
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        template_kwargs["reasoning_effort"] = body.reasoning_effort
    prompt = await server.engine.off_loop(server.chat_prompt, body.messages, body.add_generation_prompt, settings, template_kwargs)
    max_tokens = body.max_completion_tokens or body.max_tokens
    server.check_length(prompt, max_tokens)
    top = body.top_logprobs or 0
    extra = {"skip_special_tokens": False} if server.keeps_special_tokens(settings) else {}
    params = server.sampling_params(body, max_tokens, top if body.logprobs else None, constraint=constraint, **extra)
    tail = server.prompt_tail(prompt)
    output, ids = await start_constrained(server, request, [prompt], params, field, body.kv_transfer_params,
                                          server.grammar_start(tail, constraint))
    replies = [server.reply(tail, settings) for _ in ids]
    response_id, created = f"chatcmpl-{request_id(request)}", int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _chat_stream(server, output, ids, [prompt], body, response_id, created, include_usage, replies, settings),
            media_type="text/event-stream",
        )
    deltas = await server.collect(request, output, ids)
    choices = []
    for index, choice in enumerate(deltas):
        tokens = [token for delta in choice for token in delta.token_ids]
        entries = [entry for delta in choice for entry in (delta.logprobs or [])]
        reasoning, content, calls = replies[index].parse("".join(delta.text for delta in choice))
        message: dict[str, Any] = {"role": "assistant", "content": content if content is not None or calls else ""}
        if replies[index].reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in calls
            ]
        choices.append({
            "index": index,
            "message": message,
            "logprobs": _chat_logprobs(entries, tokens, top) if body.logprobs else None,
            "finish_reason": _finish_reason(choice[-1].finish_reason, bool(calls), settings),
            "stop_reason": choice[-1].stop_reason,
        })
    return JSONResponse({
        "id": response_id, "object": "chat.completion", "created": created, "model": server.model_name,
        "choices": choices, "usage": msgspec.to_builtins(server.usage([prompt], deltas)),
    })


def _chat_tools_and_constraint(body: p.ChatCompletionRequest) -> tuple[tools.ToolSettings | None, StructuredOutputsParams | None, str]:
    """The request's tools and the constraint on its output (a forced tool choice's, or its format's)."""
    try:
        settings = tools.chat_tools(body)
        constraint, field = structured.from_sampling_fields(body)
        return (settings, *tools.output_constraint(settings, constraint, field, "response_format (or structured_outputs)"))
    except ValueError as error:
        raise HTTPError(400, str(error), param=field_of(error)) from None


def _finish_reason(reason: str | None, called: bool, settings: tools.ToolSettings | None) -> str | None:
    """``tool_calls`` for an answer that ended with calls the model chose (a named function's stays ``stop``)."""
    if called and reason == "stop" and settings is not None and settings.choice != "function":
        return "tool_calls"
    return reason


def _chat_stream(server: Server, output: asyncio.Queue, ids: list[str], prompts: list[list[int]], body: Any,
                 response_id: str, created: int, include_usage: bool, replies: list[tools.AssistantOutput],
                 settings: tools.ToolSettings | None) -> AsyncIterator[bytes]:
    head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": server.model_name}
    opening = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for index in range(len(ids))]
    called = [False] * len(ids)

    def render(delta: Delta) -> dict[str, Any] | None:
        reply = replies[delta.index]
        piece = reply.push(delta.text) if delta.text else tools.MessageDelta()
        if delta.finish_reason is not None:
            last = reply.finish()
            piece = tools.MessageDelta(piece.reasoning + last.reasoning, piece.content + last.content, piece.calls + last.calls)
        fields: dict[str, Any] = {}
        if piece.reasoning:
            fields["reasoning_content"] = piece.reasoning
        if piece.content:
            fields["content"] = piece.content
        if piece.calls:
            called[delta.index] = True
            fields["tool_calls"] = [_tool_call_delta(call) for call in piece.calls]
        if not fields and not delta.finish_reason and not (body.logprobs and delta.token_ids):
            return None
        return {
            "index": delta.index, "delta": fields,
            "logprobs": _chat_logprobs(delta.logprobs or [], delta.token_ids, body.top_logprobs or 0) if body.logprobs else None,
            "finish_reason": _finish_reason(delta.finish_reason, called[delta.index], settings),
        }

    return _sse_stream(server, output, ids, prompts, head, include_usage, opening, render)


def _tool_call_delta(call: Any) -> dict[str, Any]:
    """OpenAI's streamed call piece: the first carries id, type and name."""
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {"index": call.index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


async def _sse_stream(server: Server, output: asyncio.Queue, ids: list[str], prompts: list[list[int]], head: dict[str, Any],
                      include_usage: bool, opening: list[dict[str, Any]],
                      render: Callable[[Delta], dict[str, Any] | None]) -> AsyncIterator[bytes]:
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
                    events.append(_sse_error(delta.error, delta.error_status))
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
            yield sse({**head, "choices": [], "usage": msgspec.to_builtins(server.usage(prompts, last))})
    except Exception:  # after the headers went out: the client gets an error event, the log the details
        logger.exception("internal error in stream %s", head["id"])
        server.metrics.failed("internal")
        yield b"".join(events) + _sse_error(f"internal error in request {head['id']}; the server log has the details", 500)
    finally:
        for engine_request_id in ids:
            server.engine.abort(engine_request_id)
    yield b"data: [DONE]\n\n"


def _chunk_ends(head: dict[str, Any], include_usage: bool) -> tuple[bytes, bytes]:
    """The bytes before and after the choice in ``sse({**head, "choices": [choice], "usage": None})``
    (without ``usage`` unless ``include_usage``)."""
    start = b"data: " + msgspec.json.encode(head)[:-1] + b',"choices":['
    return start, b'],"usage":null}\n\n' if include_usage else b"]}\n\n"


async def completions(server: Server, request: Request) -> Response:
    body: p.CompletionRequest = await server.read(request, p.CompletionRequest, "completions")
    server.check_model(body.model)
    try:
        constraint, field = structured.from_sampling_fields(body)
    except ValueError as error:
        raise HTTPError(400, str(error), param=field_of(error)) from None
    prompts = await server.engine.off_loop(_completion_prompts, server, body.prompt)
    scores_only = body.max_tokens == 0
    if scores_only and not body.echo:
        raise HTTPError(400, "max_tokens: 0 generates nothing, which only echo (scoring the prompt) allows; set "
                        "max_tokens to 1 or more, or echo to true", param="max_tokens")
    max_tokens = 1 if scores_only else body.max_tokens  # the forward that scores the prompt samples a token, dropped
    for prompt in prompts:
        server.check_length(prompt, max_tokens)
    # echo with logprobs scores the prompt too: its logprobs come from the same forward as the output's.
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    n, best_of = _best_of(body)
    params = server.sampling_params(body, max_tokens, body.logprobs, unset_max_tokens=16, constraint=constraint,
                                    prompt_logprobs=prompt_logprobs)
    if params.greedy:
        best_of = n  # greedy candidates are all alike: the first n are the best n
    if best_of != n:
        # Ranking the candidates needs each sampled token's log-probability: asked for even when the client did not.
        logprobs = body.logprobs if body.logprobs is not None else 0
        params = msgspec.structs.replace(params, n=best_of, logprobs=logprobs)
    output, ids = await start_constrained(server, request, prompts, params, field, body.kv_transfer_params,
                                          choices_field="best_of" if best_of != n else "n")
    if scores_only:
        output = _PromptOnly(output)
    response_id, created = f"cmpl-{request_id(request)}", int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _completion_stream(server, output, ids, prompts, body, response_id, created, include_usage),
            media_type="text/event-stream",
        )
    deltas = await server.collect(request, output, ids)
    best = _best_candidates(deltas, n, best_of) if best_of != n else deltas
    choices = await server.engine.off_loop(_completion_choices, server, body, prompts, best)  # decoding the echoed prompts
    return JSONResponse({
        "id": response_id, "object": "text_completion", "created": created, "model": server.model_name,
        # Usage counts every candidate: each was computed.
        "choices": choices, "usage": msgspec.to_builtins(server.usage(prompts, deltas)),
    })


class _PromptOnly:
    """The output queue of a completion scoring its prompt only (``echo`` with ``max_tokens`` 0): the engine samples
    one token (the prompt's logprobs come from that forward), which each delta here goes without."""

    def __init__(self, queue: asyncio.Queue) -> None:
        self.queue = queue

    async def get(self) -> Delta:
        return _without_output(await self.queue.get())

    def get_nowait(self) -> Delta:
        return _without_output(self.queue.get_nowait())

    def empty(self) -> bool:
        return self.queue.empty()


def _without_output(delta: Delta) -> Delta:
    if delta.error:
        return delta
    return msgspec.structs.replace(delta, token_ids=[], text="", logprobs=None if delta.logprobs is None else [],
                                   num_output_tokens=0, stop_reason=None,
                                   finish_reason=None if delta.finish_reason is None else "length")


def _best_of(body: p.CompletionRequest) -> tuple[int, int]:
    """``(n, best_of)`` of a completions request, or a 400 naming the field."""
    n = body.n or 1
    best_of = body.best_of if body.best_of is not None else n
    if best_of < n:
        raise HTTPError(400, f"best_of ({best_of}) must be at least n ({n}): it is the number of candidates the n "
                        f"choices are picked from; raise best_of or lower n", param="best_of")
    if best_of > n and body.stream:
        raise HTTPError(400, f"best_of ({best_of}) above n ({n}) cannot be streamed: the best candidates are known only "
                        f"when every one has finished; set stream to false or best_of to n", param="best_of")
    return n, best_of


def _best_candidates(deltas: list[list[Delta]], n: int, best_of: int) -> list[list[Delta]]:
    """Of each prompt's ``best_of`` candidates (consecutive), the ``n`` whose sampled tokens have the highest
    log-probability per token (OpenAI's "best"; a sum would favour the shortest), best first (ties: the earlier
    candidate). Exactly ``n`` per prompt, so a choice's prompt is still its index over ``n``."""

    def score(choice: list[Delta]) -> float:
        values = [entry[token].logprob for delta in choice for token, entry in zip(delta.token_ids, delta.logprobs or ())]
        return sum(values) / max(len(values), 1)

    chosen = []
    for start in range(0, len(deltas), best_of):
        candidates = deltas[start : start + best_of]
        ranked = sorted(range(len(candidates)), key=lambda index: -score(candidates[index]))
        chosen.extend(candidates[index] for index in ranked[:n])
    return chosen


def _completion_choices(server: Server, body: p.CompletionRequest, prompts: list[list[int]],
                        deltas: list[list[Delta]]) -> list[dict[str, Any]]:
    echoed = [server.tokenizer.decode(prompt) for prompt in prompts] if body.echo else []
    choices = []
    for index, choice in enumerate(deltas):
        prompt = prompts[index // body.n]
        prefix = echoed[index // body.n] if body.echo else ""
        tokens = [token for delta in choice for token in delta.token_ids]
        entries = [entry for delta in choice for entry in (delta.logprobs or [])]
        logprobs = None
        if body.logprobs is not None:
            logprobs = _completion_logprobs(entries, tokens, body.logprobs, len(prefix))
            if body.echo:
                echoed_logprobs = _prompt_completion_logprobs(server, choice[0].prompt_logprobs, prompt, body.logprobs)
                logprobs = _join_logprobs(echoed_logprobs, logprobs)
        entry: dict[str, Any] = {
            "index": index, "text": prefix + "".join(delta.text for delta in choice), "logprobs": logprobs,
            "finish_reason": choice[-1].finish_reason, "stop_reason": choice[-1].stop_reason,
        }
        if body.prompt_logprobs is not None:
            entry["prompt_logprobs"] = _prompt_logprobs_json(choice[0].prompt_logprobs)
        choices.append(entry)
    return choices


def _prompt_completion_logprobs(server: Server, entries: list[dict[int, Logprob] | None] | None, prompt: list[int],
                                top: int) -> dict[str, list[Any]]:
    """The prompt's tokens in a completion's logprobs shape (the first token has none, as in OpenAI's API)."""
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, entry in zip(prompt, entries or [None] * len(prompt)):
        text = server.tokenizer.decode([token], skip_special_tokens=False)
        result["tokens"].append(text)
        result["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            continue
        result["token_logprobs"].append(_finite(entry[token].logprob))
        result["top_logprobs"].append(_top_with_chosen(entry, token, top))
    return result


def _join_logprobs(first: dict[str, list[Any]], second: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: first[key] + second[key] for key in first}


def _prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None or ``{token id: {logprob, rank, decoded_token}}``."""
    if entries is None:
        return None
    return [None if entry is None else {str(token): {**msgspec.to_builtins(lp), "logprob": _finite(lp.logprob)}
                                        for token, lp in entry.items()} for entry in entries]


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _completion_prompts(server: Server, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise HTTPError(400, "prompt: must not be empty", param="prompt")
    if _is_token_list(prompt):
        return [list(prompt)]
    if not all(isinstance(item, str) or _is_token_list(item) for item in prompt):
        raise HTTPError(
            400, "prompt: expected a string, a list of strings, a list of token ids or a list of token-id lists",
            param="prompt",
        )
    try:
        prompts = [server.engine.frontend.encode_prompt(item) if isinstance(item, str) else list(item) for item in prompt]
    except ValueError as error:
        raise HTTPError(400, f"prompt: {error}", param="prompt") from None
    if any(not item for item in prompts):
        raise HTTPError(400, "prompt: every prompt needs at least one token", param="prompt")
    return prompts


def _completion_stream(server: Server, output: asyncio.Queue, ids: list[str], prompts: list[list[int]], body: Any,
                       response_id: str, created: int, include_usage: bool) -> AsyncIterator[bytes]:
    head = {"id": response_id, "object": "text_completion", "created": created, "model": server.model_name}
    offsets = [0] * len(ids)
    opening = []
    wants_logprobs = body.logprobs is not None
    # echo: the prompt opens each choice; with logprobs it goes out with the first delta, which brings its logprobs.
    echo_pending = [bool(body.echo and wants_logprobs)] * len(ids)
    if body.echo and not wants_logprobs:
        for index in range(len(ids)):
            prompt_text = server.tokenizer.decode(prompts[index // body.n])
            offsets[index] = len(prompt_text)
            opening.append({"index": index, "text": prompt_text, "logprobs": None, "finish_reason": None})

    def render(delta: Delta) -> dict[str, Any] | None:
        index = delta.index
        if not delta.text and not delta.finish_reason and not (wants_logprobs and delta.token_ids) and not echo_pending[index]:
            return None
        text, logprobs = delta.text, None
        if echo_pending[index]:
            echo_pending[index] = False
            prompt = prompts[index // body.n]
            prompt_text = server.tokenizer.decode(prompt)
            offsets[index] = len(prompt_text)
            text = prompt_text + text
            echoed = _prompt_completion_logprobs(server, delta.prompt_logprobs, prompt, body.logprobs)
            logprobs = _join_logprobs(echoed, _completion_logprobs(delta.logprobs or [], delta.token_ids, body.logprobs, offsets[index]))
        elif wants_logprobs:
            logprobs = _completion_logprobs(delta.logprobs or [], delta.token_ids, body.logprobs, offsets[index])
        offsets[index] += len(delta.text)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    return _sse_stream(server, output, ids, prompts, head, include_usage, opening, render)


async def models(server: Server, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{
        "id": server.model_name, "object": "model", "created": server.created, "owned_by": "weft",
        "max_model_len": server.max_model_len,
    }]})


async def tokenize(server: Server, request: Request) -> Response:
    body: p.TokenizeRequest = await server.read(request, p.TokenizeRequest, "tokenize")
    server.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise HTTPError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        tokens = await server.engine.off_loop(server.chat_prompt, body.messages, True)
    else:
        try:
            tokens = await server.engine.off_loop(server.engine.frontend.encode_prompt, body.prompt, body.add_special_tokens)
        except ValueError as error:
            raise HTTPError(400, f"prompt: {error}", param="prompt") from None
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": server.max_model_len})


async def detokenize(server: Server, request: Request) -> Response:
    body: p.DetokenizeRequest = await server.read(request, p.DetokenizeRequest, "detokenize")
    server.check_model(body.model)
    bad = [token for token in body.tokens if not 0 <= token < server.tokenizer.vocab_size]
    if bad:
        raise HTTPError(400, f"tokens: ids must be in [0, {server.tokenizer.vocab_size}); got {bad[:5]}", param="tokens")
    text = await server.engine.off_loop(server.tokenizer.decode, body.tokens, False)
    return JSONResponse({"prompt": text})


async def health(server: Server, request: Request) -> Response:
    if server.engine.dead:
        return PlainTextResponse("engine core is gone", status_code=503)
    if not server.engine.accepting:
        return PlainTextResponse("shutting down", status_code=503)
    return PlainTextResponse("ok")


async def metrics(server: Server, request: Request) -> Response:
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)
