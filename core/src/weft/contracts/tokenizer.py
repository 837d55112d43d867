"""The tokenizer slot: text to token ids and back, chat templates, streaming detokenization.

``use.tokenizer = "auto"`` takes the tokenizer the loader named for the model
source (:attr:`weft.contracts.loader.ModelSource.tokenizer`). A tokenizer is
built with :meth:`Tokenizer.from_source`.

Streaming: :meth:`Tokenizer.detokenizer` returns an
:class:`IncrementalDetokenizer` that turns token ids into text pieces as they
arrive. Joined, the pieces equal ``decode(all_ids)``, and no piece ever ends in
the middle of a multi-byte character (a byte-level token may carry half of one).
"""

from __future__ import annotations

import re
import secrets
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from weft.contracts.plugin import PluginBase

if TYPE_CHECKING:
    from weft.contracts.loader import ModelSource

REPLACEMENT_CHARACTER = "\ufffd"


class Tokenizer(PluginBase):
    """Encodes, decodes and renders chat conversations for one model."""

    @classmethod
    @abstractmethod
    def from_source(cls, source: ModelSource, options: msgspec.Struct | None = None) -> Tokenizer:
        """Build the tokenizer of a resolved model source."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation unless the request sets ``ignore_eos``."""

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS and the like where the model wants them."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; invalid UTF-8 becomes U+FFFD."""

    image_placeholder: str | None = None
    """The text of the token each image part becomes (core API 1.15): set by the engine's frontend where the model
    reads images (its multimodal processor's ``placeholder_token_id``); None: image parts are refused."""

    def normalize_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Bring chat messages to the shape the template expects, without mutating the input.

        The default accepts ``content`` as a string or a list of parts of type
        ``text``, ``input_text`` or ``output_text`` (joined with ``"\\n\\n"``), and of type ``image_url``
        or ``input_image`` where :attr:`image_placeholder` is set (each becomes that text, in place), and
        rejects other part types with a ValueError naming the type.
        """
        normalized = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"messages[{index}]: expected an object with a 'role', got {message!r}")
            copy = dict(message)
            content = copy.get("content")
            if isinstance(content, list):
                texts = []
                for part_index, part in enumerate(content):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind in ("image_url", "input_image") and self.image_placeholder is not None:
                        texts.append(self.image_placeholder)
                        continue
                    if kind not in ("text", "input_text", "output_text"):
                        raise ValueError(
                            f"messages[{index}].content[{part_index}]: this model supports text content only; "
                            f"got {kind!r}"
                        )
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise ValueError(
                            f"messages[{index}].content[{part_index}].text: a {kind} part needs a string; got {text!r}"
                        )
                    texts.append(text)
                copy["content"] = "\n\n".join(texts)
            elif content is not None and not isinstance(content, str):
                raise ValueError(f"messages[{index}].content: expected a string or a list of parts, got {content!r}")
            normalized.append(copy)
        return normalized

    def vocabulary_bytes(self) -> list[bytes]:
        """Per token id, the bytes the token adds to decoded text; ``b""`` for special tokens (those
        ``skip_special_tokens`` drops). Structured-output backends build their token tables from it."""
        raise NotImplementedError(
            f"tokenizer {type(self).__name__} cannot list its tokens' bytes, which structured outputs need; "
            f"implement vocabulary_bytes()"
        )

    @property
    def special_token_texts(self) -> frozenset[str]:
        """Texts :meth:`encode` turns into control tokens (``<|im_end|>``...). :meth:`encode_chat` encodes
        them as plain text where they appear inside messages. Default: none."""
        return frozenset()

    def encode_plain(self, text: str) -> list[int]:
        """Ids of ``text`` with any special-token text in it encoded as ordinary text (no control tokens).
        The default, :meth:`encode` without special tokens, is right when :attr:`special_token_texts` is empty."""
        return self.encode(text, add_special_tokens=False)

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        control_tokens_in_content: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Normalize, render and encode a conversation.

        Special-token text typed inside the messages (``<|im_end|>\\n<|im_start|>system``) is encoded as
        plain text, so a user cannot end their turn or open a system one; the template's own control
        tokens are unaffected. Each occurrence is swapped for a random private-use marker before
        rendering, and the markers are encoded with :meth:`encode_plain` after. With
        ``control_tokens_in_content`` the text is encoded as is (special-token text becomes control tokens).
        """
        specials = () if control_tokens_in_content else tuple(sorted(self.special_token_texts, key=len, reverse=True))
        found = re.compile("|".join(re.escape(special) for special in specials)) if specials else None
        if found is None or not _any_string(messages, template_kwargs, found):
            text = self.apply_chat_template(self.normalize_messages(messages), add_generation_prompt, **template_kwargs)
            return self.encode(text, add_special_tokens=False)
        nonce = secrets.randbelow(10**12)
        marker_of = {special: f"\ue000{nonce}.{index}\ue001" for index, special in enumerate(specials)}
        special_of = {marker: special for special, marker in marker_of.items()}

        def mask(value: str) -> str:
            return found.sub(lambda match: marker_of[match.group()], value)

        masked = _map_strings(list(messages), mask)
        text = self.apply_chat_template(
            self.normalize_messages(masked), add_generation_prompt, **_map_strings(template_kwargs, mask)
        )
        ids: list[int] = []
        pieces = re.split("(" + "|".join(re.escape(marker) for marker in special_of) + ")", text)
        for index, piece in enumerate(pieces):
            if index % 2:
                ids += self.encode_plain(special_of[piece])
            elif piece:
                ids += self.encode(piece, add_special_tokens=False)
        return ids

    @property
    def has_chat_template(self) -> bool:
        """Whether :meth:`apply_chat_template` can render conversations."""
        return True

    @abstractmethod
    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render normalized ``messages`` to the prompt text the model was trained on."""

    def detokenizer(
        self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer; ``prompt_token_ids`` give context for the first pieces."""
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Streams text from token ids without splitting characters.

    It decodes a short window of ids before and after each new id and emits the
    difference, holding text back while the window ends in U+FFFD (an
    incomplete UTF-8 sequence). Works for any :class:`Tokenizer`; a tokenizer
    with a faster native path may return its own object with the same methods.
    """

    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-self._CONTEXT_TOKENS :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        """All text emitted so far."""

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text that is now complete (possibly empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        full_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHARACTER):
            return ""
        piece = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += piece
        return piece

    def push_all(self, token_ids: Sequence[int]) -> str:
        """Add many ids and flush: the text :meth:`push` of each then :meth:`flush` would give, in two decodes."""
        self._ids.extend(token_ids)
        return self.flush()

    def flush(self) -> str:
        """At the end of the stream: return held-back text (an incomplete character as U+FFFD)."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        full_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        piece = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += piece
        return piece


_WINDOW = 1 << 16


def _any_string(messages: Any, template_kwargs: Any, pattern: re.Pattern[str]) -> bool:
    """Whether any string inside ``messages`` or ``template_kwargs`` matches ``pattern``."""
    stack = [messages, template_kwargs]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            # In overlapping windows (special tokens are far shorter than the overlap): ``re`` holds the GIL
            # while it scans, which would stall the server's event loop for a long text.
            for start in range(0, max(len(node), 1), _WINDOW):
                if pattern.search(node, start, start + _WINDOW + 256):
                    return True
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return False


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """A copy of ``value`` with ``change`` applied to every string inside it (dict keys included)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {_map_strings(key, change): _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(item, change) for item in value)
    return value
