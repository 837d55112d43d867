"""A GGUF file's byte-level BPE vocabulary as Hugging Face tokenizer files, without transformers.

llama.cpp stores GPT-2-style tokenizers (``tokenizer.ggml.model = "gpt2"``) as a
token list, merges and token types. They map one to one onto a ``tokenizers``
BPE model with a byte-level pre-tokenizer and decoder; control tokens
(type 3) become special tokens. This is what transformers' GGUF converter builds
too, minus its second parse of the file. Other vocabulary types return False
and are left to transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weft_gguf import checksum

CONTROL = 3


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def write_tokenizer(reader: Any, folder: Path) -> bool:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into ``folder``; False if unsupported."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        return False
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or merges is None:
        return False
    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=[tuple(merge.split(" ", 1)) for merge in merges],
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, types, strict=False)
            if kind == CONTROL
        ]
    )
    config: dict[str, Any] = {}
    for name in ("bos", "eos", "unknown", "padding"):
        index = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if index is not None and 0 <= index < len(tokens):
            key = {"unknown": "unk", "padding": "pad"}.get(name, name)
            config[f"{key}_token"] = tokens[index]
    template = _field(reader, "tokenizer.chat_template")

    def write(temporary: Path) -> None:
        tokenizer.save(str(temporary / "tokenizer.json"))
        (temporary / "tokenizer_config.json").write_text(json.dumps(config))
        if template:
            (temporary / "chat_template.jinja").write_text(template)

    write_folder(folder, write)
    return True


def cache_tokenizer(folder: Path, source: Path, reader: Callable[[], Any]) -> None:
    """Make the cache ``folder`` hold the tokenizer of the GGUF file ``source`` (``reader()`` parses it), unless
    it holds a tokenizer already whose checksums match. A damaged one (truncated, changed, without its checksums)
    is rebuilt with one warning. A vocabulary other than byte-level BPE is left for transformers to convert
    (:meth:`weft_gguf.tokenizer.GGUFTokenizer.from_source`)."""
    if folder.is_dir():
        wrong = checksum.folder_problem(folder)
        if wrong is None:
            return
        warnings.warn(
            f"weft-gguf: the tokenizer cache {folder} is damaged ({wrong}); rebuilding it from {source}", stacklevel=3
        )
        shutil.rmtree(folder, ignore_errors=True)
    try:
        write_tokenizer(reader(), folder)
    except OSError as error:
        print(f"weft-gguf: could not cache the tokenizer in {folder}: {error}", file=sys.stderr)


def write_folder(folder: Path, write: Callable[[Path], None]) -> None:
    """``write(temporary)`` fills a temporary folder, which gets its checksums and is renamed to ``folder``, so
    that readers never see half a cache (OSError when it cannot be written)."""
    temporary = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    try:
        write(temporary)
        checksum.record_folder(temporary)
        os.replace(temporary, folder)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
