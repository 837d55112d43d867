"""Request and response bodies of the OpenAI APIs Weft serves, as msgspec Structs.

Request Structs forbid unknown fields: a field Weft does not implement is a
400 naming it (:mod:`weft.serve.unsupported` lists the common ones and the
fields accepted and ignored). Numeric ranges are checked here so that a bad
value is a 400 naming the field. The response Structs describe what the
handlers send; ``GET /openapi.json`` is generated from both
(:mod:`weft.serve.openapi`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
MaxTokens = Annotated[int, Meta(ge=1)]
Choices = Annotated[int, Meta(ge=1, le=128)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class IgnoredFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields any OpenAI client may send that change no output here (``unsupported.IGNORED`` says why)."""

    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class SamplingFields(IgnoredFields, kw_only=True):
    """Fields shared by chat and text completions. ``null`` means the default, as in OpenAI's API."""

    def __post_init__(self) -> None:
        for name, default in _NULL_DEFAULTS.items():
            if hasattr(self, name) and getattr(self, name) is None:
                setattr(self, name, default)

    model: str
    n: Choices | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: MaxTokens | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """For the server's KV connector (prefill/decode disaggregation: set by a P/D proxy)."""


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One part of a message's content; the tokenizer decides which types it renders (text always)."""

    type: str
    text: str | None = None
    image_url: str | dict[str, str | None] | None = None
    input_audio: dict[str, str] | None = None
    file: dict[str, str] | None = None


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A message of the conversation. Fields the SDKs echo back with a reply (``refusal``,
    ``annotations``, ``audio`` as null) are accepted; other unknown fields are ignored."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]
    """A string, a list of strings, a list of token ids, or a list of token-id lists (checked by the handler)."""
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool | None = None


class ResponseContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ResponseInputItem(msgspec.Struct, kw_only=True):
    role: str | None = None
    type: str | None = None
    content: str | list[ResponseContentPart] | None = None


class ResponsesRequest(IgnoredFields, kw_only=True):
    model: str
    input: str | list[ResponseInputItem]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stream: bool | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


Role = Literal["system", "developer", "user", "assistant", "tool"]


_NULL_DEFAULTS: dict[str, Any] = {
    "n": 1, "ignore_eos": False, "stream": False, "echo": False, "add_generation_prompt": True,
}


# Response bodies (what the handlers send; the OpenAPI schema and its conformance test read them).


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class OutputText(msgspec.Struct):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(msgspec.Struct):
    type: Literal["message"]
    id: str
    status: str
    role: Literal["assistant"]
    content: list[OutputText]


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class ResponseObject(msgspec.Struct):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    incomplete_details: dict[str, str] | None
    error: dict[str, str | None] | None
    model: str
    instructions: str | None
    output: list[OutputMessage]
    parallel_tool_calls: bool
    tool_choice: str
    tools: list[Any]
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    usage: ResponseUsage | None


class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct):
    prompt: str
