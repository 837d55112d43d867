"""DeepSeek V4.1 chat: message normalisation, reasoning settings, and the ``dsv4`` tokenizer.

Before rendering, V4.1 normalises messages (shared/reference/dsv4.md):

- inputs are never mutated (every message is deep-copied);
- ``role`` is one of system, developer, user, assistant, tool;
- ``reasoning`` is copied to ``reasoning_content``;
- list content is flattened: text parts (``text`` from the Chat API, ``input_text`` /
  ``output_text`` from the Responses API) are joined with ``"\\n\\n"``; image parts
  (``image_url``, ``input_image``) become the image placeholder where the checkpoint declares a
  vision encoder (:func:`weft_dsv4.mm.declares_vision_encoder`), and are an error saying so where it
  does not; any other part is an error;
- tools attach to the first system message (one is created at the start if there is none).

Thinking is on unless ``reasoning_effort="none"``; efforts are low, high (the default),
xhigh, max, or an integer 1..100.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from weft.api import HFTokenizer, eos_ids_of
from weft.contracts.loader import ModelSource
from weft_dsv4.mm import VISION_CONFIG_KEY, declares_vision_encoder

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PARTS = ("text", "input_text", "output_text")
IMAGE_PARTS = ("image_url", "input_image")
EFFORTS = ("low", "high", "xhigh", "max")
DEFAULT_EFFORT = "high"


def normalize_messages(
    messages: Sequence[dict[str, Any]],
    image_placeholder: str | None,
    tools: Sequence[dict[str, Any]] | None = None,
    vision_encoder: bool = True,
) -> list[dict[str, Any]]:
    """V4.1's normalised copy of ``messages`` (see the module docstring); ``vision_encoder``: whether the checkpoint
    declares one (without one, image parts are an error)."""
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}]: expected an object with a 'role', got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{index}].role = {role!r}: DeepSeek V4.1 accepts {', '.join(ROLES)}")
        copied = copy.deepcopy(message)
        if "reasoning" in copied:
            copied["reasoning_content"] = copied["reasoning"]
        content = copied.get("content")
        if isinstance(content, list):
            copied["content"] = _flatten(content, index, image_placeholder, vision_encoder)
        normalized.append(copied)
    if tools:
        system = next((message for message in normalized if message["role"] == "system"), None)
        if system is None:
            system = {"role": "system", "content": ""}
            normalized.insert(0, system)
        system["tools"] = copy.deepcopy(list(tools))
    return normalized


def _flatten(parts: list[Any], index: int, image_placeholder: str | None, vision_encoder: bool) -> str:
    texts = []
    for part_index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in TEXT_PARTS:
            texts.append(part.get("text") or "")
        elif kind in IMAGE_PARTS:
            if not vision_encoder:
                raise ValueError(
                    f"messages[{index}].content[{part_index}]: this DeepSeek V4.1 checkpoint declares no vision "
                    f"encoder (its config.json has no '{VISION_CONFIG_KEY}'), so it reads no images; send text parts "
                    "only"
                )
            if image_placeholder is None:
                raise ValueError(
                    f"messages[{index}].content[{part_index}] is an image but this tokenizer has no image token; "
                    f"set plugins.dsv4.image_token_id to the checkpoint's image placeholder id"
                )
            texts.append(image_placeholder)
        else:
            raise ValueError(
                f"messages[{index}].content[{part_index}]: DeepSeek V4.1 supports text and image content only; got "
                f"{kind!r}"
            )
    return "\n\n".join(texts)


def reasoning_settings(reasoning_effort: str | int | None) -> dict[str, Any]:
    """``{"thinking": bool, "reasoning_effort": ...}`` for the template; None means the default (thinking, high)."""
    if reasoning_effort is None:
        return {"thinking": True, "reasoning_effort": DEFAULT_EFFORT}
    if reasoning_effort == "none":
        return {"thinking": False, "reasoning_effort": None}
    if isinstance(reasoning_effort, str) and reasoning_effort in EFFORTS:
        return {"thinking": True, "reasoning_effort": reasoning_effort}
    if isinstance(reasoning_effort, int) and not isinstance(reasoning_effort, bool) and 1 <= reasoning_effort <= 100:
        return {"thinking": True, "reasoning_effort": reasoning_effort}
    raise ValueError(
        f"reasoning_effort = {reasoning_effort!r}: expected 'none', one of {', '.join(EFFORTS)}, or an integer 1..100"
    )


class DeepseekV4TokenizerOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    image_token_id: int = 129264
    """The checkpoint's image placeholder token (V4.1: 129264); image parts render as its text."""


class DeepseekV4Tokenizer(HFTokenizer):
    """The checkpoint's Hugging Face tokenizer with V4.1's message normalisation and reasoning settings.

    Select it with ``use.tokenizer = "dsv4"``. The conversation is rendered by the checkpoint's
    chat template, which receives ``thinking`` and ``reasoning_effort``. Image parts are refused unless the
    checkpoint's config declares a vision encoder (:attr:`vision_encoder`, read by :meth:`from_source`).
    """

    Options: ClassVar[type[msgspec.Struct]] = DeepseekV4TokenizerOptions
    options: DeepseekV4TokenizerOptions = DeepseekV4TokenizerOptions()
    vision_encoder: bool = False
    """Whether the checkpoint declares a vision encoder; False for a tokenizer built from a folder alone."""

    @classmethod
    def from_source(cls, source: ModelSource, options: msgspec.Struct | None = None) -> DeepseekV4Tokenizer:
        from pathlib import Path

        tokenizer = cls.from_folder(Path(source.path), eos_ids_of(source))
        tokenizer.options = options if options is not None else cls.Options()
        tokenizer.vision_encoder = declares_vision_encoder(source.hf_config)
        return tokenizer

    @property
    def image_placeholder(self) -> str | None:
        token_id = self.options.image_token_id
        return self.decode([token_id], False) if 0 <= token_id < self.vocab_size else None

    def normalize_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return normalize_messages(messages, self.image_placeholder, vision_encoder=self.vision_encoder)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        tools = template_kwargs.pop("tools", None)
        settings = reasoning_settings(template_kwargs.pop("reasoning_effort", None))
        rendered = normalize_messages(messages, self.image_placeholder, tools, self.vision_encoder)
        return super().apply_chat_template(rendered, add_generation_prompt, **settings, **template_kwargs)
