"""The "hf" tokenizer: a Hugging Face tokenizer from a local folder, chat templates rendered by Weft."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from weft.builtins.chat_template import ChatTemplate
from weft.contracts.loader import ModelSource
from weft.contracts.tokenizer import Tokenizer


class HFTokenizer(Tokenizer):
    """A transformers AutoTokenizer from the model folder (tokenizer.json and friends)."""

    def __init__(self, tokenizer: Any, extra_eos_ids: Sequence[int] = (), chat_template: str | None = None) -> None:
        self.hf = tokenizer
        template = chat_template or getattr(tokenizer, "chat_template", None)
        self.chat_template = ChatTemplate(template) if isinstance(template, str) else None
        ids = set(extra_eos_ids)
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        self._eos_token_ids = frozenset(ids)
        self._vocab_size = len(tokenizer)

    @classmethod
    def from_source(cls, source: ModelSource, options: msgspec.Struct | None = None) -> HFTokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source.path, local_files_only=True)
        return cls(tokenizer, eos_ids_of(source))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; use completions with a plain prompt")
        variables = {"bos_token": self.hf.bos_token or "", "eos_token": self.hf.eos_token or "", **template_kwargs}
        return self.chat_template.render(list(messages), add_generation_prompt=add_generation_prompt, **variables)


def eos_ids_of(source: ModelSource) -> list[int]:
    """End-of-sequence ids the model config and generation_config.json name."""
    ids: list[int] = []
    candidates = [source.hf_config.get("eos_token_id")]
    generation_config = Path(source.path) / "generation_config.json"
    if Path(source.path).is_dir() and generation_config.is_file():
        candidates.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for value in candidates:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(v for v in value if isinstance(v, int))
    return ids
