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

INT32_MAX = 2**31 - 1
"""The largest count or token id a request may give (the device keeps them as int32); the model's
vocabulary and context length bound them further, checked when the request is submitted."""
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 512
"""Stop strings are searched for after every token, on the thread that serves every request's output."""
MAX_BAD_WORDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_CHOICE_OPTIONS = 1024
"""Caps on the lists a request may give (docs/serving.md lists them): past them, a 400 naming the field."""

Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
MaxTokens = Annotated[int, Meta(ge=1, le=INT32_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Choices = Annotated[int, Meta(ge=1, le=128)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_LENGTH)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class StructuredOutputsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` request field."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(max_length=MAX_CHOICE_OPTIONS)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    structural_tag: Any = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool | None = None
    """Accepted: xgrammar never generates properties a schema does not name (OpenAI's strict mode)."""
    disable_fallback: bool | None = None
    """Accepted: there is one backend, and no fallback to another."""


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Chat and completions' ``response_format``: text, json_object, or json_schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str = "function"
    function: FunctionDefinition | None = None


class ToolChoiceFunction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``{"type": "function", "function": {"name": ...}}`` (chat) or ``{"type": "function", "name": ...}``
    (Responses)."""

    type: str = "function"
    function: ToolChoiceFunction | None = None
    name: str | None = None


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
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    max_tokens: MaxTokens | None = None
    min_tokens: Count | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    """vLLM's: false keeps special tokens in the output text (true, the default, drops them)."""
    include_stop_str_in_output: bool | None = None
    """vLLM's: true ends the text with the stop string that ended it (false, the default, cuts it off)."""
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    """Token id -> bias in [-100, 100] (checked by the server, naming the token and the value)."""
    allowed_token_ids: list[TokenId] | None = None
    bad_words: Annotated[list[str], Meta(max_length=MAX_BAD_WORDS)] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """For the server's KV connector (prefill/decode disaggregation: set by a P/D proxy)."""


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """One part of a message's content; the tokenizer decides which types it renders (text always)."""

    type: str
    text: str | None = None
    image_url: str | dict[str, str | None] | None = None
    input_audio: dict[str, str] | None = None
    file: dict[str, str] | None = None
    refusal: str | None = None
    """An assistant's ``refusal`` part."""


class MessageFunctionCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    arguments: str | dict[str, Any]
    """JSON text, as OpenAI's API has it (an object is accepted: chat templates want one)."""


class MessageToolCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A call an earlier assistant message made."""

    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall
    index: int | None = None
    """Ignored: the position a streamed reply's delta gave the call (a client that rebuilt the reply from its
    chunks sends it back)."""


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """A message of the conversation. The fields the OpenAI SDKs echo back with a reply are accepted
    (``refusal``, ``annotations``; ``audio`` and ``function_call`` as null); any other is a 400 naming it."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    """Ignored: citations OpenAI attached to a reply."""
    audio: None = None
    function_call: None = None
    """The deprecated form of ``tool_calls``: accepted as null only."""


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | Count | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]
    """A string, a list of strings, a list of token ids, or a list of token-id lists (checked by the handler)."""
    max_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    """0 only with ``echo``: the prompt is scored (its logprobs), nothing generated (the handler checks)."""
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    best_of: Choices | None = None
    """Candidates sampled per prompt, of which the ``n`` with the highest log-probability per token are
    returned (at least ``n``; more than ``n`` cannot stream)."""


class ResponseContentPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A part of an input item's content: its text, or a kind the tokenizer refuses by its ``type``."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    """Ignored: what an ``output_text`` part of an earlier response carried."""
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None
    detail: str | None = None


class ResponseInputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An input item: a message, a ``function_call`` or ``function_call_output``, or an earlier ``reasoning``
    item (dropped). The fields an earlier response's output items carry (``id``, ``status``...) are accepted."""

    role: str | None = None
    type: str | None = None
    content: str | list[ResponseContentPart] | None = None
    call_id: str | None = None
    """``function_call`` and ``function_call_output`` items."""
    name: str | None = None
    arguments: str | None = None
    output: str | list[ResponseContentPart] | None = None
    id: str | None = None
    status: str | None = None
    summary: list[Any] | None = None
    encrypted_content: str | None = None


class ResponseFunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseTextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseText(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: ResponseTextFormat | None = None
    verbosity: str | None = None
    """Ignored: a hint to OpenAI's models about answer length; this model has no such control."""


class ResponseReasoning(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None
    summary: str | None = None
    """Ignored: the reasoning item carries the whole thinking, never a summary."""
    generate_summary: str | None = None
    """Ignored, as ``summary`` (its older name)."""


class ResponsesRequest(IgnoredFields, kw_only=True):
    model: str
    input: str | Annotated[list[ResponseInputItem], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stream: bool | None = None
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    reasoning: ResponseReasoning | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[TokenId]


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
    "n": 1,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "stream": False,
    "echo": False,
    "add_generation_prompt": True,
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


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str
    """JSON text."""


class ToolCall(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    """The thinking before the answer (models with a reasoning parser)."""
    tool_calls: list[ToolCall] | None = None


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
    token_logprobs: list[float | None]
    """None for an echoed prompt's first token (nothing predicts it)."""
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """vLLM's, with ``prompt_logprobs``: per prompt token, None for the first, else token id -> its logprob."""


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


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: str
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningText(msgspec.Struct):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(msgspec.Struct, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: str


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    """JSON text."""
    status: str


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
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall]
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[Any]
    text: dict[str, Any]
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
