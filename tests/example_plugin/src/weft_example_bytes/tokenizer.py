"""A byte-level tokenizer: ids 0-255 are UTF-8 bytes, then two special tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from weft.contracts.tokenizer import Tokenizer

BOS, EOS = 256, 257


class ByteOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    add_bos: bool = True
    """Prepend <bos> when add_special_tokens is true."""


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as token ids, with <bos> and <eos>."""

    Options = ByteOptions

    def __init__(self, options: ByteOptions | None = None) -> None:
        self.options = options or ByteOptions()

    @classmethod
    def from_source(cls, source: Any, options: ByteOptions | None = None) -> ByteTokenizer:
        return cls(options)

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        prefix = [BOS] if add_special_tokens and self.options.add_bos else []
        return prefix + list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in token_ids if i < 256)
        text = data.decode("utf-8", errors="replace")
        if skip_special_tokens:
            return text
        names = {BOS: "<bos>", EOS: "<eos>"}
        return "".join(names.get(i, "") for i in token_ids if i >= 256) + text

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        rendered = "".join(f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages)
        return rendered + ("<|assistant|>\n" if add_generation_prompt else "")
