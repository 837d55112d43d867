"""The "hf" tokenizer: transformers' AutoTokenizer from a local folder, chat templates rendered by Weft.

:meth:`HFTokenizer.from_folder` with ``fast=True`` reads a ``tokenizer.json``
with the ``tokenizers`` library directly instead (transformers' import alone
costs seconds at start-up); weft-gguf uses it for the tokenizer it converted
and cached itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from weft.builtins.chat_template import ChatTemplate
from weft.contracts.loader import ModelSource
from weft.contracts.tokenizer import Tokenizer


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer (tokenizer.json, or anything AutoTokenizer reads) from the model folder."""

    def __init__(
        self,
        encode: Callable[[str, bool], list[int]],
        decode: Callable[[list[int], bool], str],
        vocab_size: int,
        eos_token_ids: frozenset[int],
        special_tokens: dict[str, str],
        chat_template: str | None,
        backend: Any = None,
        special_token_texts: frozenset[str] = frozenset(),
        encode_plain: Callable[[str], list[int]] | None = None,
    ) -> None:
        """``backend``: the ``tokenizers.Tokenizer`` underneath, when there is one (it lists the vocabulary)."""
        self._encode, self._decode = encode, decode
        self._backend = backend
        self._special_token_texts = special_token_texts
        self._encode_plain = encode_plain
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self.special_tokens = special_tokens
        """``bos_token`` and ``eos_token`` text, passed to the chat template."""
        self.chat_template = ChatTemplate(chat_template) if chat_template else None

    @classmethod
    def from_source(cls, source: ModelSource, options: msgspec.Struct | None = None) -> HFTokenizer:
        return cls.from_folder(Path(source.path), eos_ids_of(source))

    @classmethod
    def from_folder(cls, folder: Path, extra_eos_ids: Sequence[int] = (), fast: bool = False) -> HFTokenizer:
        """AutoTokenizer on ``folder``; with ``fast``, its tokenizer.json through ``tokenizers`` when it suffices."""
        config = _read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((item["template"] for item in template if item.get("name") == "default"), None)
        if fast and (folder / "tokenizer.json").is_file() and not config.get("clean_up_tokenization_spaces"):
            return cls._from_tokenizers(folder, config, template, extra_eos_ids)
        return cls.from_transformers(_auto_tokenizer(folder), extra_eos_ids, template)

    @classmethod
    def _from_tokenizers(
        cls, folder: Path, config: dict[str, Any], template: str | None, extra_eos_ids: Sequence[int]
    ) -> HFTokenizer:
        from tokenizers import Tokenizer as FastTokenizer

        fast = FastTokenizer.from_file(str(folder / "tokenizer.json"))
        plain = FastTokenizer.from_file(str(folder / "tokenizer.json"))
        plain.encode_special_tokens = True  # a second instance: the flag is per object, encodes run on threads
        special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}
        eos = set(extra_eos_ids)
        if special["eos_token"] and fast.token_to_id(special["eos_token"]) is not None:
            eos.add(fast.token_to_id(special["eos_token"]))
        return cls(
            # encode_batch releases the GIL while it works (encode holds it: seconds for a long text).
            encode=lambda text, add_special: fast.encode_batch([text], add_special_tokens=add_special)[0].ids,
            decode=lambda ids, skip: fast.decode(ids, skip_special_tokens=skip),
            vocab_size=fast.get_vocab_size(with_added_tokens=True),
            eos_token_ids=frozenset(eos),
            special_tokens={key: value or "" for key, value in special.items()},
            chat_template=template,
            backend=fast,
            special_token_texts=frozenset(
                token.content for token in fast.get_added_tokens_decoder().values() if token.special
            ),
            encode_plain=lambda text: plain.encode_batch([text], add_special_tokens=False)[0].ids,
        )

    @classmethod
    def from_transformers(
        cls, tokenizer: Any, extra_eos_ids: Sequence[int] = (), template: str | None = None
    ) -> HFTokenizer:
        """Wrap a transformers tokenizer object."""
        eos = set(extra_eos_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        chat_template = template or getattr(tokenizer, "chat_template", None)
        return cls(
            encode=lambda text, add_special: tokenizer.encode(text, add_special_tokens=add_special),
            decode=_decoder_of(tokenizer),
            vocab_size=len(tokenizer),
            eos_token_ids=frozenset(eos),
            special_tokens={"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""},
            chat_template=chat_template if isinstance(chat_template, str) else None,
            backend=getattr(tokenizer, "backend_tokenizer", None),
            special_token_texts=frozenset(
                token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values() if token.special
            )
            | frozenset(getattr(tokenizer, "all_special_tokens", ())),
            encode_plain=lambda text: tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True),
        )

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode(text, add_special_tokens)

    @property
    def special_token_texts(self) -> frozenset[str]:
        return self._special_token_texts

    def encode_plain(self, text: str) -> list[int]:
        return self._encode_plain(text) if self._encode_plain is not None else super().encode_plain(text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decode(list(token_ids), skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def vocabulary_bytes(self) -> list[bytes]:
        if self._backend is None:
            return super().vocabulary_bytes()
        return vocabulary_bytes(self._backend, self.vocab_size)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; use completions with a plain prompt")
        variables = {**self.special_tokens, **template_kwargs}
        return self.chat_template.render(list(messages), add_generation_prompt=add_generation_prompt, **variables)


def vocabulary_bytes(backend: Any, vocab_size: int) -> list[bytes]:
    """Each token's bytes in decoded text, from a ``tokenizers.Tokenizer``: byte-level BPE (GPT-2's
    byte-to-character map), SentencePiece-style (``▁`` for a space, ``<0xNN>`` byte-fallback tokens) or
    plain strings; added tokens are their literal text, special ones ``b""``."""
    spec = json.loads(backend.to_str())
    decoders = _decoder_types(spec.get("decoder"))
    added = {token["id"]: token for token in spec.get("added_tokens", [])}
    byte_level = "ByteLevel" in decoders
    byte_fallback = "ByteFallback" in decoders
    metaspace = "Metaspace" in decoders or "Replace" in decoders
    if not (byte_level or metaspace) and decoders - {"Fuse", "Strip"}:
        raise NotImplementedError(
            f"the tokenizer's decoder ({', '.join(sorted(decoders))}) is neither byte-level nor SentencePiece-style; "
            f"structured outputs cannot map its tokens to bytes"
        )
    from_char = {char: byte for byte, char in _bytes_to_unicode().items()}
    table = [b""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if not 0 <= token_id < vocab_size:
            continue
        if token_id in added:
            table[token_id] = b"" if added[token_id].get("special") else token.encode()
        elif byte_level and all(char in from_char for char in token):
            table[token_id] = bytes(from_char[char] for char in token)
        elif byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            table[token_id] = bytes([int(token[3:5], 16)])
        else:
            table[token_id] = (token.replace("\u2581", " ") if metaspace else token).encode()
    return table


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return {kind for inner in decoder.get("decoders", []) for kind in _decoder_types(inner)}
    return {decoder.get("type", "")}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character byte-level BPE vocabularies spell it with."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _decoder_of(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """``tokenizer.decode``, or the ``tokenizers`` object underneath it where that gives the same text: the
    streaming detokenizer decodes twice per generated token, and transformers' wrapper costs several times
    the decode itself."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its own decode
        TokenizersBackend = None  # noqa: N806
    kind = type(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        TokenizersBackend is not None
        and isinstance(tokenizer, TokenizersBackend)
        and backend is not None
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def _auto_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken serialised as a dict
        return value.get("content")
    return value if isinstance(value, str) else None


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
