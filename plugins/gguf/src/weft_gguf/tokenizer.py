"""The "gguf" tokenizer: the tokenizer embedded in a GGUF file, through transformers' converter.

The converted tokenizer (tokenizer.json, chat template) is saved in the cache
folder on first use; later starts read it with the ``tokenizers`` library
without importing transformers.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from weft.builtins.hf_tokenizer import HFTokenizer, eos_ids_of
from weft.contracts.loader import ModelSource
from weft_gguf.files import cache_dir, file_key


class GGUFTokenizer(HFTokenizer):
    """The GGUF file's own vocabulary, merges, special tokens and chat template."""

    @classmethod
    def from_source(cls, source: ModelSource, options: msgspec.Struct | None = None) -> HFTokenizer:
        path = Path(source.path)
        cached = cache_dir() / "gguf" / f"{file_key(path, 'tokenizer')}.tokenizer"
        eos = eos_ids_of(source)
        if (cached / "tokenizer.json").is_file():
            return cls.from_folder(cached, eos, fast=True)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        try:
            tokenizer.save_pretrained(str(cached))
        except OSError:
            return cls.from_transformers(tokenizer, eos)
        return cls.from_folder(cached, eos, fast=True)
