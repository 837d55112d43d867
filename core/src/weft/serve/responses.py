"""The Responses API: input items to a conversation, the reply as output items, whole or as events.

Input items: messages (``role`` and text content), ``function_call`` items (a call the
model made earlier; consecutive ones form one assistant turn) and ``function_call_output``
items (a tool's result, rendered as a ``tool`` message); ``reasoning`` items are dropped
(models are not shown their earlier thinking). ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``text.format`` and ``reasoning.effort`` work as on chat
completions (:mod:`weft.serve.tools`, :mod:`weft.serve.structured`).

Output items, in order: a ``reasoning`` item (when the model has a reasoning parser), a
``message`` with the answer's text (unless the answer is only calls), one
``function_call`` item per call. Streaming opens each item as its first text arrives:
``response.reasoning_text.delta``, ``response.output_text.delta`` and
``response.function_call_arguments.delta`` events inside ``output_item.added`` /
``output_item.done``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from weft.engine.api.streams import Delta
from weft.serve import fields, structured, tools
from weft.serve import protocol as p
from weft.serve.body import HTTPError, error_type
from weft.serve.server import Server, field_of, request_id, server_of, sse, start_constrained

logger = logging.getLogger("weft.serve")


async def responses(request: Request) -> Response:
    server = server_of(request)
    body: p.ResponsesRequest = await server.read(request, p.ResponsesRequest, "responses")
    server.check_model(body.model)
    messages = input_messages(body)
    try:
        settings = tools.responses_tools(body)
        constraint, field = tools.output_constraint(settings, *structured.from_text_format(body.text), "text.format")
    except ValueError as error:
        raise HTTPError(400, str(error), param=field_of(error)) from None
    template_kwargs = (
        {"reasoning_effort": body.reasoning.effort} if body.reasoning is not None and body.reasoning.effort else {}
    )
    images = await server.images.load([] if isinstance(body.input, str) else body.input, "input")
    prompt = await server.engine.off_loop(server.chat_prompt, messages, True, settings, template_kwargs)
    prompt, multimodal = await server.images.with_images(prompt, images, "input")
    server.check_length(prompt, body.max_output_tokens)
    extra = {"skip_special_tokens": False} if server.keeps_special_tokens(settings) else {}
    params = server.sampling_params(
        p.ChatCompletionRequest(
            model=body.model, messages=messages, temperature=body.temperature, top_p=body.top_p, seed=body.seed
        ),
        body.max_output_tokens,
        None,
        constraint=constraint,
        **extra,
    )
    tail = server.prompt_tail(prompt)
    output, ids = await start_constrained(
        server, request, [prompt], params, field, None, server.grammar_start(tail, constraint), multimodal=multimodal
    )
    response = ResponseObject(server, body, prompt, request_id(request))
    reply = server.reply(tail, settings)
    if body.stream:
        return StreamingResponse(_stream(server, output, ids, response, reply), media_type="text/event-stream")
    (choice,) = await server.collect(request, output, ids)
    reasoning, content, calls = reply.parse("".join(delta.text for delta in choice))
    cut = choice[-1].finish_reason == "length"
    items = []
    if reasoning:
        items.append(response.reasoning_item(response.item_id("rs"), reasoning, "completed"))
    message = (
        response.message_item(response.item_id("msg"), content or "", "completed")
        if content is not None or not calls
        else None
    )
    call_items = [
        response.call_item(response.item_id("fc"), call.id, call.name, call.arguments, "completed") for call in calls
    ]
    # In the order written: calls, then content (a forced choice's output cut short before a call was named).
    items += (
        [*call_items, message]
        if message is not None and cut and calls
        else [*([message] if message else []), *call_items]
    )
    if cut and items:
        items[-1]["status"] = "incomplete"  # the output stopped inside it
    return JSONResponse(response.finished(items, choice))


def input_messages(body: p.ResponsesRequest) -> list[p.ChatMessage]:
    """The conversation the input items describe (after ``instructions`` as a system message)."""
    messages = [p.ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, p.ChatMessage(role="user", content=body.input)]
    for position, item in enumerate(body.input):
        where = f"input[{position}]"
        if item.type in (None, "message"):
            content = item.content
            if isinstance(content, list):
                content = [p.ContentPart(type=part.type, text=part.text, image_url=part.image_url) for part in content]
            messages.append(p.ChatMessage(role=item.role or "user", content=content))
        elif item.type == "function_call":
            if not item.call_id or not item.name:
                raise HTTPError(400, f"{where}: a function_call item needs call_id and name", param=where)
            call = p.MessageToolCall(
                id=item.call_id, function=p.MessageFunctionCall(name=item.name, arguments=item.arguments or "{}")
            )
            previous = messages[-1] if messages else None
            if previous is not None and previous.role == "assistant" and previous.tool_calls and not previous.content:
                previous.tool_calls.append(call)
            else:
                messages.append(p.ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif item.type == "function_call_output":
            if not item.call_id:
                raise HTTPError(400, f"{where}: a function_call_output item needs the call_id it answers", param=where)
            output = item.output
            if isinstance(output, list):
                output = "".join(part.text or "" for part in output)
            messages.append(p.ChatMessage(role="tool", tool_call_id=item.call_id, content=output or ""))
        elif item.type != "reasoning":
            raise HTTPError(
                400,
                f"{where}.type: {item.type!r} items are not supported; send messages, function_call "
                f"and function_call_output items",
                param=f"{where}.type",
            )
    return messages


class ResponseObject:
    """The Responses API's ``response`` object, in progress and finished, and its output items."""

    def __init__(self, server: Server, body: p.ResponsesRequest, prompt: list[int], http_request_id: str) -> None:
        self.server, self.body, self.prompt = server, body, prompt
        self.id, self.created = f"resp_{http_request_id}", int(time.time())
        self._items = 0

    def item_id(self, prefix: str) -> str:
        """``msg_<request id>``, then ``msg_<request id>_1``...: ids of the output items, unique in the response."""
        self._items += 1
        suffix = f"_{self._items - 1}" if self._items > 1 else ""
        return f"{prefix}_{self.id.removeprefix('resp_')}{suffix}"

    def message_item(self, item_id: str, text: str, status: str) -> dict[str, Any]:
        content = (
            [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            if status != "in_progress"
            else []
        )
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}

    @staticmethod
    def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def state(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None, incomplete: bool = False
    ) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "model": self.server.model_name,
            "instructions": body.instructions,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": _tool_choice(body.tool_choice),
            "tools": msgspec.to_builtins(body.tools or []),
            "text": msgspec.to_builtins(body.text) if body.text is not None else {"format": {"type": "text"}},
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "usage": usage,
        }

    def finished(self, items: list[dict[str, Any]], choice: list[Delta]) -> dict[str, Any]:
        usage = fields.usage([self.prompt], [choice])
        incomplete = choice[-1].finish_reason == "length"
        return self.state(
            "incomplete" if incomplete else "completed",
            items,
            {
                "input_tokens": usage.prompt_tokens,
                "output_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
                "input_tokens_details": {"cached_tokens": (usage.prompt_tokens_details or {}).get("cached_tokens", 0)},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
            incomplete,
        )


class _StreamedItems:
    """The output items of a streamed response, opened as their text arrives."""

    def __init__(self, response: ResponseObject, event: Callable[..., bytes]) -> None:
        self.response, self.event = response, event
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""

    def feed(self, piece: tools.MessageDelta) -> list[bytes]:
        events: list[bytes] = []
        if piece.reasoning:
            events += self._ensure("reasoning")
            self.text += piece.reasoning
            events.append(
                self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=piece.reasoning)
            )
        if piece.content:
            events += self._ensure("message")
            self.text += piece.content
            events.append(
                self.event(
                    "response.output_text.delta", **self._where(), content_index=0, delta=piece.content, logprobs=[]
                )
            )
        for call in piece.calls:
            if call.id is not None:
                events += self._close()
                item = self.response.call_item(self.response.item_id("fc"), call.id, call.name or "", "", "in_progress")
                events += self._open(item)
            if call.arguments:
                self.text += call.arguments
                events.append(
                    self.event("response.function_call_arguments.delta", **self._where(), delta=call.arguments)
                )
        return events

    def finish(self, cut: bool = False) -> list[bytes]:
        """Close the items; ``cut``: the output was cut short (``max_output_tokens``), the last item left unfinished."""
        status = "incomplete" if cut else "completed"
        events = self._close(status)
        if not self.items:  # an empty answer is still one (empty) message
            events += self._ensure("message") + self._close(status)
        return events

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _ensure(self, kind: str) -> list[bytes]:
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self._close()
        if kind == "reasoning":
            return events + self._open(self.response.reasoning_item(self.response.item_id("rs"), "", "in_progress"))
        events += self._open(self.response.message_item(self.response.item_id("msg"), "", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return events + [self.event("response.content_part.added", **self._where(), content_index=0, part=part)]

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        self.open, self.text = item, ""
        return [self.event("response.output_item.added", output_index=len(self.items), item=item)]

    def _close(self, status: str = "completed") -> list[bytes]:
        item = self.open
        if item is None:
            return []
        where, text, events = self._where(), self.text, []
        if item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            done = self.response.reasoning_item(item["id"], text, status)
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            events.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            done = self.response.message_item(item["id"], text, status)
        else:
            events.append(
                self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=text)
            )
            done = self.response.call_item(item["id"], item["call_id"], item["name"], text, status)
        events.append(self.event("response.output_item.done", output_index=len(self.items), item=done))
        self.items.append(done)
        self.open = None
        return events


async def _stream(
    server: Server, output: asyncio.Queue, ids: list[str], response: ResponseObject, reply: tools.AssistantOutput
) -> AsyncIterator[bytes]:
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\n".encode() + sse({"type": kind, "sequence_number": sequence - 1, **fields})

    items = _StreamedItems(response, event)
    try:
        yield event("response.created", response=response.state("in_progress", []))
        yield event("response.in_progress", response=response.state("in_progress", []))
        deltas = []
        while True:
            delta: Delta = await output.get()
            if delta.error:
                yield event("error", message=delta.error, code=error_type(delta.error_status), param=None)
                failed = response.state("failed", items.items)
                yield event(
                    "response.failed",
                    response={**failed, "error": {"code": error_type(delta.error_status), "message": delta.error}},
                )
                return
            deltas.append(delta)
            piece = reply.push(delta.text) if delta.text else tools.MessageDelta()
            if delta.finish_reason is not None:
                last = reply.finish()
                piece = tools.MessageDelta(
                    piece.reasoning + last.reasoning, piece.content + last.content, piece.calls + last.calls
                )
            for chunk in items.feed(piece):
                yield chunk
            if delta.finish_reason is not None:
                break
        for chunk in items.finish(cut=deltas[-1].finish_reason == "length"):
            yield chunk
        final = response.finished(items.items, deltas)
        yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
    except Exception:
        logger.exception("internal error in stream %s", response.id)
        server.metrics.failed("internal")
        yield event(
            "error",
            message=f"internal error in request {response.id}; the server log has the details",
            code="server_error",
            param=None,
        )
    finally:
        for request_id in ids:
            server.engine.abort(request_id)


def _tool_choice(choice: str | p.NamedToolChoice | None) -> Any:
    """The request's tool choice as the Responses API shows it: a named one is ``{"type": "function", "name": ...}``."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    return {"type": choice.type, "name": choice.function.name if choice.function is not None else choice.name}
