"""The "gguf" tokenizer: the tokenizer embedded in a GGUF file.

The GGUF loader caches byte-level BPE vocabularies as Hugging Face files while
it parses the file (:mod:`weft_gguf.convert`); they are read with the
``tokenizers`` library, without importing transformers. Other vocabularies go
through transformers' GGUF converter once, and are cached the same way. Each
cached file has its checksum; the loader rebuilds a damaged cache.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec

from weft.api import HFTokenizer, eos_ids_of
from weft.contracts.loader import ModelSource
from weft_gguf import checksum
from weft_gguf.convert import write_folder
from weft_gguf.files import tokenizer_cache


class GGUFTokenizer(HFTokenizer):
    """The GGUF file's own vocabulary, merges, special tokens and chat template."""

    @classmethod
    def from_source(cls, source: ModelSource, options: msgspec.Struct | None = None) -> HFTokenizer:
        path = Path(source.path)
        cached = tokenizer_cache(path)
        eos = eos_ids_of(source)
        if cached.is_dir() and checksum.folder_problem(cached) is None:
            return cls.from_folder(cached, eos, fast=True)
        # Not byte-level BPE (the loader, which verifies and writes the cache, left it to transformers).
        shutil.rmtree(cached, ignore_errors=True)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        try:
            write_folder(cached, lambda temporary: tokenizer.save_pretrained(str(temporary)))
        except OSError:
            return cls.from_transformers(tokenizer, eos)
        return cls.from_folder(cached, eos, fast=True)
