"""The starlette app: OpenAI Chat Completions, Completions and Responses, models, health, metrics.

Every handler validates its body into a msgspec Struct (:mod:`weft.serve.body`),
checks the model name (a plain string comparison: a request never names a path),
turns the request into engine requests (one per prompt and choice) and either
collects their deltas or streams them as server-sent events. Tokenization,
chat templating and detokenization of prompts run on worker threads, never on
the event loop. Leaving a handler for any reason (a client that disconnects
included) aborts the engine requests that are still running, which frees their
KV blocks. A stream that ends in an error sends an OpenAI-shaped error event,
then ``[DONE]``. An unexpected exception is logged with the request's id and
answered with a generic 500 naming that id, never with the exception's text.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from weft.config import WeftConfig
from weft.engine.async_engine import AsyncEngine, Delta, QueueFullError, ShuttingDownError
from weft.generation_config import load_model_sampling_defaults
from weft.outputs import Logprob
from weft.sampling_params import SamplingParams
from weft.serve import protocol as p
from weft.serve.body import HTTPError, check_media_type, decode, error_type, read_bytes
from weft.serve.metrics import ServerMetrics
from weft.serve.openapi import openapi_route
from weft.serve.unsupported import explain

Handler = Callable[[Request], Awaitable[Response]]
logger = logging.getLogger("weft.serve")


def error_response(error: HTTPError) -> Response:
    body = p.ErrorResponse(p.ErrorBody(message=error.message, type=error.kind, param=error.param, code=str(error.status)))
    return Response(msgspec.json.encode(body), status_code=error.status, media_type="application/json", headers=error.headers)


class Server:
    """The state behind the routes: engine, tokenizer, limits, metrics."""

    def __init__(self, engine: AsyncEngine, config: WeftConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.api_key = config.server.api_key or os.environ.get("WEFT_API_KEY") or None
        self.metrics = ServerMetrics(engine)
        engine.observer = self.metrics
        self.created = int(time.time())
        self.model_sampling_defaults = load_model_sampling_defaults(engine.frontend.source, config.engine.generation_config)

    # Plumbing shared by the handlers.

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise HTTPError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error")

    async def read(self, request: Request, body_type: type[Any], endpoint: str = "") -> Any:
        """The body as ``body_type`` (``endpoint`` names the API for :mod:`weft.serve.unsupported`)."""
        check_media_type(request)
        data = await read_bytes(request, self.config.server.max_body_bytes, self.config.server.body_timeout)
        return decode(data, body_type, endpoint)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise HTTPError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "not_found_error", "model")

    def check_length(self, prompt: list[int], max_tokens: int | None) -> None:
        if len(prompt) >= self.max_model_len:
            raise HTTPError(
                400, f"the prompt has {len(prompt)} tokens but the model's context length is {self.max_model_len}; "
                f"shorten the prompt", param="messages",
            )
        if max_tokens is not None and len(prompt) + max_tokens > self.max_model_len:
            raise HTTPError(
                400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the model's context length "
                f"of {self.max_model_len} tokens; lower max_tokens", param="max_tokens",
            )

    async def start(self, request: Request, prompts: list[list[int]], params: SamplingParams,
                    kv_transfer_params: dict[str, Any] | None = None) -> tuple[asyncio.Queue, list[str]]:
        """Submit one engine request per prompt and choice; deltas of choice ``i*n + j`` go to one queue.
        Engine request ids are the HTTP request's id and the choice's index."""
        sequences = len(prompts) * params.n
        limit = min(self.config.server.max_sequences_per_request, self.engine.max_queued_requests)
        if sequences > limit:
            raise HTTPError(
                400, f"n ({params.n}) times the prompts ({len(prompts)}) is {sequences} sequences; one request may "
                f"have at most {limit} (server.max_sequences_per_request, server.max_queued_requests)", param="n",
            )
        if kv_transfer_params is not None and sequences != 1:
            raise HTTPError(400, "kv_transfer_params: a KV transfer serves one prompt and one choice; "
                            "send n = 1 and a single prompt", param="kv_transfer_params")
        output: asyncio.Queue = asyncio.Queue()
        choices = params.choices()
        base = request_id(request)
        batch = [
            (f"{base}-{prompt_index * len(choices) + index}", prompt, choice, prompt_index * len(choices) + index)
            for prompt_index, prompt in enumerate(prompts)
            for index, choice in enumerate(choices)
        ]
        ids = [engine_request_id for engine_request_id, *_ in batch]
        try:
            await self.engine.submit(batch, output, kv_transfer_params)
        except BaseException as error:
            for engine_request_id in ids:
                self.engine.abort(engine_request_id)
            if isinstance(error, QueueFullError):
                raise HTTPError(503, f"the server is busy ({error}); retry later", "server_error",
                                headers={"Retry-After": "1"}) from None
            if isinstance(error, ShuttingDownError):
                raise HTTPError(503, str(error), "server_error", headers={"Retry-After": "5"}) from None
            if isinstance(error, ValueError):
                raise HTTPError(400, str(error)) from None
            raise
        return output, ids

    async def collect(self, request: Request, output: asyncio.Queue, ids: list[str]) -> list[list[Delta]]:
        """Every delta of every choice, in choice order; aborts everything if the client goes away."""
        deltas: list[list[Delta]] = [[] for _ in ids]
        pending = len(ids)
        checked = time.monotonic()
        try:
            while pending:
                try:
                    delta = await asyncio.wait_for(output.get(), timeout=0.5)
                except TimeoutError:
                    delta = None
                if time.monotonic() - checked >= 0.5:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise asyncio.CancelledError
                if delta is None:
                    continue
                if delta.error:
                    raise HTTPError(delta.error_status, delta.error)
                deltas[delta.index].append(delta)
                pending -= delta.finish_reason is not None
        finally:
            for engine_request_id in ids:
                self.engine.abort(engine_request_id)
        return deltas

    def sampling_params(self, body: Any, max_tokens: int | None, logprobs: int | None,
                        unset_max_tokens: int | None = None) -> SamplingParams:
        """The request's sampling values; one it leaves unset comes from the model's generation config
        (``engine.generation_config``), else Weft's default. ``unset_max_tokens``: the endpoint's own
        default max_tokens (None: up to the context length)."""
        stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
        requested = {
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty, "max_tokens": max_tokens,
        }
        chosen = {
            "max_tokens": unset_max_tokens, **self.model_sampling_defaults,
            **{field: value for field, value in requested.items() if value is not None},
        }
        try:
            return SamplingParams(
                n=getattr(body, "n", None) or 1,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                seed=body.seed,
                stop=tuple(stop),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                min_tokens=body.min_tokens or 0,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                **chosen,
            )
        except ValueError as error:
            field = str(error).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise HTTPError(400, str(error).replace("SamplingParams.", ""), param=field) from None

    def usage(self, prompts: list[list[int]], deltas: list[list[Delta]]) -> p.Usage:
        prompt_tokens = sum(len(prompt) for prompt in prompts)
        completion_tokens = sum(choice[-1].num_output_tokens for choice in deltas if choice)
        cached = sum(choice[-1].num_cached_tokens for choice in deltas if choice)
        return p.Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, {"cached_tokens": cached})

    def chat_prompt(self, messages: list[p.ChatMessage], add_generation_prompt: bool) -> list[int]:
        """The conversation's token ids (call it on a worker thread: templating and encoding take time)."""
        for index, message in enumerate(messages):
            reason = explain("chat.messages", "tool_calls", message.tool_calls)
            if reason is not None:
                raise HTTPError(400, f"messages[{index}].{reason}", param=f"messages[{index}].tool_calls")
        plain = [msgspec.to_builtins(message) for message in messages]
        try:
            return self.engine.frontend.encode_chat(plain, add_generation_prompt)
        except ValueError as error:
            raise HTTPError(400, str(error), param="messages") from None
        except TemplateError as error:
            raise HTTPError(400, f"messages: the model's chat template cannot render them: {error}", param="messages") from None


def _sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


def _sse_error(message: str, status: int) -> bytes:
    """The event that ends a failed stream (``[DONE]`` follows), shaped like OpenAI's error body."""
    return _sse(p.ErrorResponse(p.ErrorBody(message=message, type=error_type(status), code=str(status))))


def _chat_logprobs(entries: list[dict[int, Logprob]], tokens: list[int], top: int) -> dict[str, Any]:
    content = []
    for token, entry in zip(tokens, entries):
        chosen = entry[token]
        ranked = sorted((lp for lp in entry.values()), key=lambda lp: lp.rank)[:top] if top else []
        content.append({
            "token": chosen.decoded_token, "logprob": chosen.logprob, "bytes": list(chosen.decoded_token.encode()),
            "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())} for lp in ranked],
        })
    return {"content": content}


def _completion_logprobs(entries: list[dict[int, Logprob]], tokens: list[int], top: int, offset: int) -> dict[str, Any]:
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        chosen = entry[token]
        result["tokens"].append(chosen.decoded_token)
        result["token_logprobs"].append(chosen.logprob)
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)[:top]
        result["top_logprobs"].append({lp.decoded_token: lp.logprob for lp in ranked})
        result["text_offset"].append(offset)
        offset += len(chosen.decoded_token)
    return result


def request_id(request: Request) -> str:
    """The id of one HTTP request: in its ``X-Request-Id`` response header, its engine requests' ids and the log."""
    if getattr(request.state, "request_id", None) is None:
        request.state.request_id = uuid.uuid4().hex
    return request.state.request_id


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
    prompt = await asyncio.to_thread(server.chat_prompt, body.messages, body.add_generation_prompt)
    max_tokens = body.max_completion_tokens or body.max_tokens
    server.check_length(prompt, max_tokens)
    top = body.top_logprobs or 0
    params = server.sampling_params(body, max_tokens, top if body.logprobs else None)
    output, ids = await server.start(request, [prompt], params, body.kv_transfer_params)
    response_id, created = f"chatcmpl-{request_id(request)}", int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _chat_stream(server, output, ids, [prompt], body, response_id, created, include_usage),
            media_type="text/event-stream",
        )
    deltas = await server.collect(request, output, ids)
    choices = []
    for index, choice in enumerate(deltas):
        tokens = [token for delta in choice for token in delta.token_ids]
        entries = [entry for delta in choice for entry in (delta.logprobs or [])]
        choices.append({
            "index": index,
            "message": {"role": "assistant", "content": "".join(delta.text for delta in choice)},
            "logprobs": _chat_logprobs(entries, tokens, top) if body.logprobs else None,
            "finish_reason": choice[-1].finish_reason,
            "stop_reason": choice[-1].stop_reason,
        })
    return JSONResponse({
        "id": response_id, "object": "chat.completion", "created": created, "model": server.model_name,
        "choices": choices, "usage": msgspec.to_builtins(server.usage([prompt], deltas)),
    })


def _chat_stream(server: Server, output: asyncio.Queue, ids: list[str], prompts: list[list[int]], body: Any,
                       response_id: str, created: int, include_usage: bool) -> AsyncIterator[bytes]:
    head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": server.model_name}
    opening = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for index in range(len(ids))]

    def render(delta: Delta) -> dict[str, Any] | None:
        if not delta.text and not delta.finish_reason and not (body.logprobs and delta.token_ids):
            return None
        return {
            "index": delta.index, "delta": {"content": delta.text} if delta.text else {},
            "logprobs": _chat_logprobs(delta.logprobs or [], delta.token_ids, body.top_logprobs or 0) if body.logprobs else None,
            "finish_reason": delta.finish_reason,
        }

    return _sse_stream(server, output, ids, prompts, head, include_usage, opening, render)


async def _sse_stream(server: Server, output: asyncio.Queue, ids: list[str], prompts: list[list[int]], head: dict[str, Any],
                      include_usage: bool, opening: list[dict[str, Any]],
                      render: Callable[[Delta], dict[str, Any] | None]) -> AsyncIterator[bytes]:
    """Chunks of a chat or text completion stream: ``opening`` choices, one per delta ``render`` keeps,
    the usage chunk, ``[DONE]``; or up to an error event, then ``[DONE]``. Leaving early (a disconnect)
    aborts the requests."""
    usage_field = {"usage": None} if include_usage else {}
    last: list[list[Delta]] = [[] for _ in ids]
    try:
        for choice in opening:
            yield _sse({**head, "choices": [choice], **usage_field})
        pending = len(ids)
        while pending:
            delta: Delta = await output.get()
            if delta.error:
                yield _sse_error(delta.error, delta.error_status)
                break
            last[delta.index] = [delta]
            pending -= delta.finish_reason is not None
            choice = render(delta)
            if choice is not None:
                yield _sse({**head, "choices": [choice], **usage_field})
        if include_usage and not pending:
            yield _sse({**head, "choices": [], "usage": msgspec.to_builtins(server.usage(prompts, last))})
    except Exception:  # after the headers went out: the client gets an error event, the log the details
        logger.exception("internal error in stream %s", head["id"])
        yield _sse_error(f"internal error in request {head['id']}; the server log has the details", 500)
    finally:
        for engine_request_id in ids:
            server.engine.abort(engine_request_id)
    yield b"data: [DONE]\n\n"


async def completions(server: Server, request: Request) -> Response:
    body: p.CompletionRequest = await server.read(request, p.CompletionRequest, "completions")
    server.check_model(body.model)
    if body.echo and body.logprobs is not None:
        raise HTTPError(400, "echo with logprobs needs prompt log-probabilities, which Weft does not compute yet; "
                        "drop one of them", param="echo")
    prompts = await asyncio.to_thread(_completion_prompts, server, body.prompt)
    for prompt in prompts:
        server.check_length(prompt, body.max_tokens)
    params = server.sampling_params(body, body.max_tokens, body.logprobs, unset_max_tokens=16)
    output, ids = await server.start(request, prompts, params, body.kv_transfer_params)
    response_id, created = f"cmpl-{request_id(request)}", int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _completion_stream(server, output, ids, prompts, body, response_id, created, include_usage),
            media_type="text/event-stream",
        )
    deltas = await server.collect(request, output, ids)
    echoed = await asyncio.to_thread(lambda: [server.tokenizer.decode(prompt) for prompt in prompts]) if body.echo else []
    choices = []
    for index, choice in enumerate(deltas):
        prefix = echoed[index // body.n] if body.echo else ""
        tokens = [token for delta in choice for token in delta.token_ids]
        entries = [entry for delta in choice for entry in (delta.logprobs or [])]
        choices.append({
            "index": index, "text": prefix + "".join(delta.text for delta in choice),
            "logprobs": _completion_logprobs(entries, tokens, body.logprobs, len(prefix)) if body.logprobs is not None else None,
            "finish_reason": choice[-1].finish_reason, "stop_reason": choice[-1].stop_reason,
        })
    return JSONResponse({
        "id": response_id, "object": "text_completion", "created": created, "model": server.model_name,
        "choices": choices, "usage": msgspec.to_builtins(server.usage(prompts, deltas)),
    })


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
    if body.echo:
        for index in range(len(ids)):
            prompt_text = server.tokenizer.decode(prompts[index // body.n])
            offsets[index] = len(prompt_text)
            opening.append({"index": index, "text": prompt_text, "logprobs": None, "finish_reason": None})

    def render(delta: Delta) -> dict[str, Any] | None:
        wants_logprobs = body.logprobs is not None
        if not delta.text and not delta.finish_reason and not (wants_logprobs and delta.token_ids):
            return None
        logprobs = None
        if wants_logprobs:
            logprobs = _completion_logprobs(delta.logprobs or [], delta.token_ids, body.logprobs, offsets[delta.index])
        offsets[delta.index] += len(delta.text)
        return {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    return _sse_stream(server, output, ids, prompts, head, include_usage, opening, render)


async def responses(server: Server, request: Request) -> Response:
    body: p.ResponsesRequest = await server.read(request, p.ResponsesRequest, "responses")
    server.check_model(body.model)
    messages = [p.ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        messages.append(p.ChatMessage(role="user", content=body.input))
    else:
        for position, item in enumerate(body.input):
            if item.type not in (None, "message"):
                raise HTTPError(400, f"input[{position}].type: {item.type!r} items are not supported; send messages",
                                param=f"input[{position}].type")
            content = item.content
            if isinstance(content, list):
                content = [p.ContentPart(type=part.type, text=part.text) for part in content]
            messages.append(p.ChatMessage(role=item.role or "user", content=content))
    prompt = await asyncio.to_thread(server.chat_prompt, messages, True)
    server.check_length(prompt, body.max_output_tokens)
    params = server.sampling_params(
        p.ChatCompletionRequest(model=body.model, messages=messages, temperature=body.temperature, top_p=body.top_p,
                                seed=body.seed),
        body.max_output_tokens, None,
    )
    output, ids = await server.start(request, [prompt], params)
    response = _ResponseObject(server, body, prompt, request_id(request))
    if body.stream:
        return StreamingResponse(_responses_stream(server, output, ids, response), media_type="text/event-stream")
    (choice,) = await server.collect(request, output, ids)
    return JSONResponse(response.finished("".join(delta.text for delta in choice), choice))


class _ResponseObject:
    """The Responses API's ``response`` object, in progress and finished."""

    def __init__(self, server: Server, body: p.ResponsesRequest, prompt: list[int], http_request_id: str) -> None:
        self.server, self.body, self.prompt = server, body, prompt
        self.id, self.message_id, self.created = f"resp_{http_request_id}", f"msg_{http_request_id}", int(time.time())

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def state(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              incomplete: bool = False) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "model": self.server.model_name, "instructions": body.instructions, "output": output,
            "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "usage": usage,
        }

    def finished(self, text: str, choice: list[Delta]) -> dict[str, Any]:
        usage = self.server.usage([self.prompt], [choice])
        incomplete = choice[-1].finish_reason == "length"
        return self.state(
            "incomplete" if incomplete else "completed", [self.message(text, "completed")],
            {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
                "input_tokens_details": {"cached_tokens": (usage.prompt_tokens_details or {}).get("cached_tokens", 0)},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
            incomplete,
        )


async def _responses_stream(server: Server, output: asyncio.Queue, ids: list[str], response: _ResponseObject) -> AsyncIterator[bytes]:
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\n".encode() + _sse({"type": kind, "sequence_number": sequence - 1, **fields})

    where = {"item_id": response.message_id, "output_index": 0, "content_index": 0}
    try:
        yield event("response.created", response=response.state("in_progress", []))
        yield event("response.in_progress", response=response.state("in_progress", []))
        yield event("response.output_item.added", output_index=0, item=response.message("", "in_progress"))
        yield event("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        text, deltas = "", []
        while True:
            delta: Delta = await output.get()
            if delta.error:
                yield event("error", message=delta.error, code=error_type(delta.error_status), param=None)
                failed = response.state("failed", [])
                yield event("response.failed", response={**failed, "error": {"code": error_type(delta.error_status),
                                                                              "message": delta.error}})
                return
            deltas.append(delta)
            if delta.text:
                text += delta.text
                yield event("response.output_text.delta", **where, delta=delta.text, logprobs=[])
            if delta.finish_reason is not None:
                break
        final = response.finished(text, deltas)
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part={"type": "output_text", "text": text, "annotations": [], "logprobs": []})
        yield event("response.output_item.done", output_index=0, item=response.message(text, "completed"))
        yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
    except Exception:
        logger.exception("internal error in stream %s", response.id)
        yield event("error", message=f"internal error in request {response.id}; the server log has the details",
                    code="server_error", param=None)
    finally:
        for engine_request_id in ids:
            server.engine.abort(engine_request_id)


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
        tokens = await asyncio.to_thread(server.chat_prompt, body.messages, True)
    else:
        try:
            tokens = await asyncio.to_thread(server.engine.frontend.encode_prompt, body.prompt, body.add_special_tokens)
        except ValueError as error:
            raise HTTPError(400, f"prompt: {error}", param="prompt") from None
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": server.max_model_len})


async def detokenize(server: Server, request: Request) -> Response:
    body: p.DetokenizeRequest = await server.read(request, p.DetokenizeRequest, "detokenize")
    server.check_model(body.model)
    bad = [token for token in body.tokens if not 0 <= token < server.tokenizer.vocab_size]
    if bad:
        raise HTTPError(400, f"tokens: ids must be in [0, {server.tokenizer.vocab_size}); got {bad[:5]}", param="tokens")
    text = await asyncio.to_thread(server.tokenizer.decode, body.tokens, False)
    return JSONResponse({"prompt": text})


async def health(server: Server, request: Request) -> Response:
    if server.engine.dead:
        return PlainTextResponse("engine core is gone", status_code=503)
    if not server.engine.accepting:
        return PlainTextResponse("shutting down", status_code=503)
    return PlainTextResponse("ok")


async def metrics(server: Server, request: Request) -> Response:
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)
