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

_GUIDED: dict[str, tuple[str, Any]] = {
    f"guided_{kind}": ("vLLM's removed guided decoding fields (send structured_outputs instead)", NOOP)
    for kind in ("json", "regex", "choice", "grammar")
}

UNSUPPORTED: dict[str, dict[str, tuple[str, Any]]] = {
    # endpoint -> field -> (what it would do, its value that changes nothing)
    "chat.completions": {
        "functions": ("function calling (deprecated form of tools)", []),
        "function_call": ("function calling (deprecated form of tool_choice)", "none"),
        "chat_template": ("a per-request chat template", NOOP),
        "prediction": ("predicted outputs", NOOP),
        "audio": ("audio output", NOOP),
        "modalities": ("output modalities other than text", ["text"]),
        "web_search_options": ("web search", NOOP),
        **_GUIDED,
    },
    "completions": {
        "suffix": ("insertion (a suffix after the completion)", NOOP),
        **_GUIDED,
    },
    "responses": {
        "previous_response_id": ("stored responses (Weft stores none)", NOOP),
        "conversation": ("stored conversations (Weft stores none)", NOOP),
        "background": ("background responses", False),
        "include": ("extra output items", []),
        "prompt": ("stored prompt templates", NOOP),
        "top_logprobs": ("log-probabilities in the Responses API", 0),
        "max_tool_calls": ("a cap on the number of tool calls", NOOP),
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
