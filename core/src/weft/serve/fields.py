"""Request fields the API handlers check and response fields they count, as functions of the request alone
(:class:`weft.serve.server.Server` calls them; what needs the server's state stays there).
"""

from __future__ import annotations

from typing import Any

from weft.engine.api.streams import Delta
from weft.serve import protocol as p
from weft.serve.body import HTTPError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The roles a chat message may have (OpenAI's; ``function``: the deprecated tool result, passed to the template)."""
_RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "tools", "control_tokens_in_content"}
"""Arguments the server gives the chat template itself (``chat_template_kwargs`` may not)."""


def logit_bias(body: Any) -> dict[int, float] | None:
    """The request's ``logit_bias`` with token ids as ints; a key that is no token id or a value outside
    [-100, 100] is a 400 naming it."""
    if not body.logit_bias:
        return None
    try:
        logit_bias = {int(token): value for token, value in body.logit_bias.items()}
        outside = [(token, value) for token, value in body.logit_bias.items() if not -100 <= value <= 100]
    except ValueError:
        raise HTTPError(
            400, f"logit_bias: keys are token ids; got {list(body.logit_bias)[:5]}", param="logit_bias"
        ) from None
    if outside:
        token, value = outside[0]
        raise HTTPError(
            400,
            f"logit_bias[{token!r}]: {value} is outside [-100, 100]; -100 bans the token, 100 all but forces it",
            param=f"logit_bias[{token!r}]",
        )
    return logit_bias


def output_text(body: Any, keep_special_tokens: bool = False) -> dict[str, bool]:
    """The SamplingParams fields of how a chat or text completion's output text is made (vLLM's
    ``skip_special_tokens``, ``include_stop_str_in_output``). ``keep_special_tokens``: a parser reads the special
    tokens of the text (a reasoning or tool-call marker), so they stay whatever the request says."""
    return {
        "skip_special_tokens": body.skip_special_tokens and not keep_special_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
    }


def check_messages(messages: list[p.ChatMessage], template_kwargs: dict[str, Any] | None) -> None:
    """A 400 naming the first message whose role is unknown or tool message that names no call, or the first
    ``chat_template_kwargs`` key that the server itself gives the template."""
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise HTTPError(
                400,
                f"messages[{index}].role: expected one of {', '.join(map(repr, CHAT_ROLES))}, got {message.role!r}",
                param=f"messages[{index}].role",
            )
        if message.role == "tool" and not message.tool_call_id:
            raise HTTPError(
                400,
                f"messages[{index}].tool_call_id: a tool message needs the id of the call it "
                "answers (tool_calls[].id of the assistant message before it)",
                param=f"messages[{index}].tool_call_id",
            )
    reserved = sorted(set(template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise HTTPError(
            400,
            f"chat_template_kwargs: may not set {', '.join(reserved)}, the server's own arguments "
            f"to the template; send messages, add_generation_prompt and tools as the request's fields",
            param="chat_template_kwargs",
        )


def usage(prompts: list[list[int]], deltas: list[list[Delta]]) -> p.Usage:
    """Counts of one API request: ``deltas`` holds each prompt's choices in turn. A prompt counts once, its
    cached tokens too: those of the choice that found the fewest in the cache (its later choices find what the
    first computed), so ``cached_tokens`` never exceeds ``prompt_tokens``."""
    prompt_tokens = sum(len(prompt) for prompt in prompts)
    completion_tokens = sum(choice[-1].num_output_tokens for choice in deltas if choice)
    per_prompt = len(deltas) // max(1, len(prompts))
    cached = sum(
        min(
            (
                choice[-1].num_cached_tokens
                for choice in deltas[index * per_prompt : (index + 1) * per_prompt]
                if choice
            ),
            default=0,
        )
        for index in range(len(prompts))
    )
    return p.Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, {"cached_tokens": cached})
