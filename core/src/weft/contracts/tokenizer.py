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

from abc import abstractmethod
from collections.abc import Sequence
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

    def normalize_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Bring chat messages to the shape the template expects, without mutating the input.

        The default accepts ``content`` as a string or a list of parts of type
        ``text``, ``input_text`` or ``output_text`` (joined with ``"\\n\\n"``) and
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
                    if kind not in ("text", "input_text", "output_text"):
                        raise ValueError(
                            f"messages[{index}].content[{part_index}]: this model supports text content only; "
                            f"got {kind!r}"
                        )
                    texts.append(part.get("text", ""))
                copy["content"] = "\n\n".join(texts)
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

    def detokenizer(self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
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
