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

_VLLM: dict[str, tuple[str, Any]] = {
    "use_beam_search": ("vLLM's beam search", False),
    "length_penalty": ("vLLM's beam-search length penalty", 1),
    "truncate_prompt_tokens": ("vLLM's prompt truncation (a longer prompt is a 400 naming its length)", NOOP),
    "spaces_between_special_tokens": ("vLLM's decoding without spaces between special tokens", True),
    "priority": ("vLLM's priority scheduling (requests are served first come, first served)", 0),
    "return_tokens_as_token_ids": ("vLLM's 'token_id:N' logprob tokens", False),
    "return_token_ids": ("vLLM's token ids in the response", False),
    "logits_processors": ("vLLM's per-request logits processors", NOOP),
    "cache_salt": ("vLLM's per-request prefix-cache isolation (cache_salt)", NOOP),
    "vllm_xargs": ("vLLM's extra arguments for its plugins", NOOP),
}
"""vLLM's request fields that change the output (or, ``cache_salt``, who shares the prefix cache) and that Weft
does not implement: ignoring them, as an unknown field is, would answer a request as if they were absent."""

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
        **_VLLM,
        "echo": ("vLLM's echo of the last message into the reply", False),
        "continue_final_message": ("vLLM's continuation of the final message", False),
        "add_special_tokens": ("vLLM's special tokens added after the chat template's", False),
        "documents": ("vLLM's documents for the chat template", NOOP),
        "prompt_logprobs": ("vLLM's prompt logprobs in chat (POST /v1/completions has them)", NOOP),
        "thinking_token_budget": ("vLLM's thinking token budget", NOOP),
        "include_reasoning": ("vLLM's replies without their reasoning", True),
    },
    "completions": {
        "suffix": ("insertion (a suffix after the completion)", NOOP),
        **_GUIDED,
        **_VLLM,
        "add_special_tokens": ("vLLM's prompt encoded without special tokens", True),
        "prompt_embeds": ("vLLM's prompt embeddings", NOOP),
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
