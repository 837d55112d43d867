"""Request and response bodies of the OpenAI APIs Weft serves, as msgspec Structs.

Requests accept (and ignore) fields Weft does not use, so any OpenAI client
works. Numeric ranges are checked here so that a bad value is a 400 naming
the field.
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


class SamplingFields(msgspec.Struct, kw_only=True):
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
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """For the server's KV connector (prefill/decode disaggregation: set by a P/D proxy)."""


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool | None = None


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


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[ResponseInputItem]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stream: bool | None = None
    user: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
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
