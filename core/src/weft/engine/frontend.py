"""The API side's view of the model: tokenizer, limits, and requests checked before they reach the core.

Built from the configuration alone (no weights, no device), in whichever process
serves callers: the API server under ``weft serve``, the caller's for ``LLM``.
"""

from __future__ import annotations

from typing import Any

from weft.config import WeftConfig
from weft.contracts.loader import ModelSource
from weft.engine.engine_core import EngineCoreRequest
from weft.plugins import PluginRegistry
from weft.resolve import load_tokenizer, max_model_len, resolve_source
from weft.sampling_params import SamplingParams

_CHARS_PER_TOKEN_BOUND = 32
"""Texts longer than this many characters per token of context are checked on a prefix first (tokens
of natural text average 3 to 5 characters; a text whose first ``max_model_len * 32`` characters
already fill the context cannot fit)."""


class Frontend:
    def __init__(self, config: WeftConfig, registry: PluginRegistry, source: ModelSource | None = None) -> None:
        """``source``: the model source when the caller resolved it already (an in-process core)."""
        self.source = source or resolve_source(registry, config)[1]
        self.tokenizer = load_tokenizer(registry, config, self.source)
        self.max_model_len = max_model_len(config, self.source)
        self.vocab_size: int | None = self.source.hf_config.get("vocab_size")
        self.model_name = config.server.served_model_name or self.source.name
        self.special_tokens_in_content = config.server.special_tokens_in_content

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; a text far longer than the context is refused (ValueError) after
        encoding only a prefix of it, not all of it."""
        self._refuse_far_too_long(text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Token ids of a conversation (``server.special_tokens_in_content`` decides whether special-token
        text inside messages is plain text or control tokens); ValueError for a message far too long."""
        for message in messages:
            if message.get("role") in ("system", "developer", "user") and isinstance(message.get("content"), str):
                self._refuse_far_too_long(message["content"], False)
        control = self.special_tokens_in_content == "control"
        return self.tokenizer.encode_chat(messages, add_generation_prompt, control, **template_kwargs)

    def _refuse_far_too_long(self, text: str, add_special_tokens: bool) -> None:
        if len(text) <= self.max_model_len * _CHARS_PER_TOKEN_BOUND:
            return
        cut = text.rfind(" ", 0, self.max_model_len * _CHARS_PER_TOKEN_BOUND)
        prefix = self.tokenizer.encode(text[: cut if cut > 0 else self.max_model_len * _CHARS_PER_TOKEN_BOUND], add_special_tokens)
        if len(prefix) >= self.max_model_len:
            raise ValueError(
                f"a text of {len(text)} characters has more than {len(prefix) - 1} tokens, but the context length is "
                f"{self.max_model_len}; shorten it"
            )

    def core_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     kv_transfer_params: dict[str, Any] | None = None) -> EngineCoreRequest:
        """The core's request for a prompt; ValueError naming the problem when the prompt or params don't fit the model."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens but the context length is {self.max_model_len}; "
                f"shorten the prompt or raise engine.max_model_len"
            )
        vocab = self.vocab_size
        if vocab is not None and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab):
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {min(prompt_token_ids)}..{max(prompt_token_ids)}")
        bad_stops = [token for token in params.stop_token_ids if vocab is not None and not 0 <= token < vocab]
        if bad_stops:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}); got {bad_stops[:5]}")
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        eos = () if params.ignore_eos else tuple(sorted(self.tokenizer.eos_token_ids))
        return EngineCoreRequest(request_id, list(prompt_token_ids), params, eos, max_tokens, kv_transfer_params)
