"""Request fields of the OpenAI APIs that Weft does not implement, and those it accepts and ignores.

Request bodies are decoded with ``forbid_unknown_fields``: a field no request
Struct declares is refused with a 400 naming it, so a request is never answered
as if a field it relies on were absent. :data:`UNSUPPORTED` gives the reason
for the fields clients commonly send that Weft does not implement yet (a field
sent as ``null``, or as its no-op value, is accepted). When a feature lands,
declare its field on the request Struct in :mod:`weft.serve.protocol` and delete
its row here (a test checks that no row names a declared field).

Fields that are harmless to ignore (``user``, ``metadata``, ``store``...) are
declared on the Structs and listed in :data:`IGNORED`.
"""

from __future__ import annotations

from typing import Any

NOOP = object()
"""Marks a row without a no-op value: only null (or absence) is accepted."""

UNSUPPORTED: dict[str, dict[str, tuple[str, Any]]] = {
    # endpoint -> field -> (what it would do, its value that changes nothing)
    "chat.completions": {
        "tools": ("tool calling", []),
        "tool_choice": ("tool calling", "none"),
        "functions": ("function calling (deprecated form of tools)", []),
        "function_call": ("function calling (deprecated form of tool_choice)", "none"),
        "response_format": ("structured outputs", {"type": "text"}),
        "logit_bias": ("logit bias", {}),
        "chat_template": ("a per-request chat template", NOOP),
        "chat_template_kwargs": ("chat template arguments", {}),
        "reasoning_effort": ("reasoning effort", NOOP),
        "prediction": ("predicted outputs", NOOP),
        "audio": ("audio output", NOOP),
        "modalities": ("output modalities other than text", ["text"]),
        "web_search_options": ("web search", NOOP),
        "guided_json": ("structured outputs (vLLM's guided decoding)", NOOP),
        "guided_regex": ("structured outputs (vLLM's guided decoding)", NOOP),
        "guided_choice": ("structured outputs (vLLM's guided decoding)", NOOP),
        "guided_grammar": ("structured outputs (vLLM's guided decoding)", NOOP),
        "structured_outputs": ("structured outputs", NOOP),
    },
    "completions": {
        "logit_bias": ("logit bias", {}),
        "best_of": ("best-of sampling", 1),
        "suffix": ("insertion (a suffix after the completion)", NOOP),
        "response_format": ("structured outputs", {"type": "text"}),
        "guided_json": ("structured outputs (vLLM's guided decoding)", NOOP),
        "guided_regex": ("structured outputs (vLLM's guided decoding)", NOOP),
        "guided_choice": ("structured outputs (vLLM's guided decoding)", NOOP),
        "guided_grammar": ("structured outputs (vLLM's guided decoding)", NOOP),
        "structured_outputs": ("structured outputs", NOOP),
    },
    "chat.messages": {
        # Declared on ChatMessage (messages ignore unknown fields, so the handler checks this one itself).
        "tool_calls": ("tool calling", []),
    },
    "responses": {
        "tools": ("tool calling", []),
        "tool_choice": ("tool calling", "none"),
        "text": ("structured outputs and verbosity", {"format": {"type": "text"}}),
        "reasoning": ("reasoning settings", NOOP),
        "previous_response_id": ("stored responses (Weft stores none)", NOOP),
        "conversation": ("stored conversations (Weft stores none)", NOOP),
        "background": ("background responses", False),
        "include": ("extra output items", []),
        "prompt": ("stored prompt templates", NOOP),
        "top_logprobs": ("log-probabilities in the Responses API", 0),
        "max_tool_calls": ("tool calling", NOOP),
        "truncation": ("automatic truncation of the input", "disabled"),
    },
}

IGNORED: dict[str, str] = {
    "user": "an end-user id for abuse monitoring; Weft keeps no per-user state",
    "metadata": "key-value tags OpenAI stores with a request; Weft stores nothing",
    "store": "whether OpenAI stores the response; Weft stores none",
    "service_tier": "OpenAI's processing tier; Weft has one",
    "safety_identifier": "an end-user id for abuse monitoring",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; Weft's prefix cache needs none",
    "parallel_tool_calls": "meaningful only with tools, which are refused",
}
"""Fields accepted and ignored, with why ignoring them changes no output (docs/serving.md lists them)."""


def explain(endpoint: str, field: str, value: Any) -> str | None:
    """Why ``field`` is refused on ``endpoint``, or None when it is no table's row or ``value`` changes nothing."""
    row = UNSUPPORTED.get(endpoint, {}).get(field)
    if row is None:
        return None
    feature, noop = row
    if value is None or (noop is not NOOP and value == noop):
        return None
    return f"{field}: Weft does not implement {feature} yet; remove the field (see docs/serving.md)"
