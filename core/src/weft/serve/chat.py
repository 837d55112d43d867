"""The Chat Completions API (``POST /v1/chat/completions``): messages rendered with the model's chat
template, tools and reasoning parsed out of the answer, streamed or whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from weft.contracts.structured_output import StructuredOutputsParams
from weft.engine.api.streams import Delta
from weft.outputs import Logprob
from weft.serve import fields, structured, tools
from weft.serve import protocol as p
from weft.serve.body import HTTPError
from weft.serve.server import Server, field_of, request_id, server_of, start_constrained
from weft.serve.stream import finite, sse_stream


async def chat_completions(request: Request) -> Response:
    server = server_of(request)
    body: p.ChatCompletionRequest = await server.read(request, p.ChatCompletionRequest, "chat.completions")
    server.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise HTTPError(
            400,
            f"top_logprobs ({body.top_logprobs}) needs logprobs: set logprobs to true, or leave top_logprobs out",
            param="top_logprobs",
        )
    settings, constraint, field = _chat_tools_and_constraint(body)
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        template_kwargs["reasoning_effort"] = body.reasoning_effort
    images = await server.images.load(body.messages)
    prompt = await server.engine.off_loop(
        server.chat_prompt, body.messages, body.add_generation_prompt, settings, template_kwargs
    )
    prompt, multimodal = await server.images.with_images(prompt, images)
    max_tokens = body.max_completion_tokens or body.max_tokens
    server.check_length(prompt, max_tokens)
    top = body.top_logprobs or 0
    extra = fields.output_text(body, server.keeps_special_tokens(settings))
    params = server.sampling_params(body, max_tokens, top if body.logprobs else None, constraint=constraint, **extra)
    tail = server.prompt_tail(prompt)
    output, ids = await start_constrained(
        server,
        request,
        [prompt],
        params,
        field,
        body.kv_transfer_params,
        server.grammar_start(tail, constraint),
        multimodal=multimodal,
    )
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
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": _chat_logprobs(entries, tokens, top) if body.logprobs else None,
                "finish_reason": _finish_reason(choice[-1].finish_reason, bool(calls), settings),
                "stop_reason": choice[-1].stop_reason,
            }
        )
    return JSONResponse(
        {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": server.model_name,
            "choices": choices,
            "usage": msgspec.to_builtins(fields.usage([prompt], deltas)),
        }
    )


def _chat_tools_and_constraint(
    body: p.ChatCompletionRequest,
) -> tuple[tools.ToolSettings | None, StructuredOutputsParams | None, str]:
    """The request's tools and the constraint on its output (a forced tool choice's, or its format's)."""
    try:
        settings = tools.chat_tools(body)
        constraint, field = structured.from_sampling_fields(body)
        return (
            settings,
            *tools.output_constraint(settings, constraint, field, "response_format (or structured_outputs)"),
        )
    except ValueError as error:
        raise HTTPError(400, str(error), param=field_of(error)) from None


def _finish_reason(reason: str | None, called: bool, settings: tools.ToolSettings | None) -> str | None:
    """``tool_calls`` for an answer that ended with calls the model chose (a named function's stays ``stop``)."""
    if called and reason == "stop" and settings is not None and settings.choice != "function":
        return "tool_calls"
    return reason


def _chat_stream(
    server: Server,
    output: asyncio.Queue,
    ids: list[str],
    prompts: list[list[int]],
    body: Any,
    response_id: str,
    created: int,
    include_usage: bool,
    replies: list[tools.AssistantOutput],
    settings: tools.ToolSettings | None,
) -> AsyncIterator[bytes]:
    head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": server.model_name}
    opening = [
        {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for index in range(len(ids))
    ]
    called = [False] * len(ids)

    def render(delta: Delta) -> dict[str, Any] | None:
        reply = replies[delta.index]
        piece = reply.push(delta.text) if delta.text else tools.MessageDelta()
        if delta.finish_reason is not None:
            last = reply.finish()
            piece = tools.MessageDelta(
                piece.reasoning + last.reasoning, piece.content + last.content, piece.calls + last.calls
            )
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
            "index": delta.index,
            "delta": fields,
            "logprobs": _chat_logprobs(delta.logprobs or [], delta.token_ids, body.top_logprobs or 0)
            if body.logprobs
            else None,
            "finish_reason": _finish_reason(delta.finish_reason, called[delta.index], settings),
        }

    return sse_stream(server, output, ids, prompts, head, include_usage, opening, render)


def _tool_call_delta(call: Any) -> dict[str, Any]:
    """OpenAI's streamed call piece: the first carries id, type and name."""
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {
        "index": call.index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _chat_logprobs(entries: list[dict[int, Logprob]], tokens: list[int], top: int) -> dict[str, Any]:
    content = []
    for token, entry in zip(tokens, entries, strict=False):
        chosen = entry[token]
        ranked = sorted((lp for lp in entry.values()), key=lambda lp: lp.rank)[:top] if top else []
        content.append(
            {
                "token": chosen.decoded_token,
                "logprob": finite(chosen.logprob),
                "bytes": list(chosen.decoded_token.encode()),
                "top_logprobs": [
                    {"token": lp.decoded_token, "logprob": finite(lp.logprob), "bytes": list(lp.decoded_token.encode())}
                    for lp in ranked
                ],
            }
        )
    return {"content": content}
