"""The API side's view of the model: tokenizer, limits, and requests checked before they reach the core.

Built from the configuration alone (no weights, no device), in whichever process
serves callers: the API server under ``weft serve``, the caller's for ``LLM``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgspec

from weft.config import WeftConfig
from weft.contracts.loader import ModelSource
from weft.contracts.mm_processor import ImageItem, MMProcessor, MMProcessorConfig, MultimodalInputs, ProcessedPrompt
from weft.engine.api.validation_process import ConstraintValidator
from weft.engine.messages import EngineCoreRequest, GrammarStart
from weft.plugins import PluginRegistry
from weft.plugins.selection import no_backend_message, select_parser, select_structured_output
from weft.resolve import load_tokenizer, max_model_len, options_for, resolve_source
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
        hf_config = self.source.hf_config
        text_config = hf_config.get("text_config")
        # A vision-language checkpoint keeps its language model's vocabulary in text_config.
        self.vocab_size: int | None = hf_config.get("vocab_size") or (
            text_config.get("vocab_size") if isinstance(text_config, dict) else None
        )
        self.model_name = config.server.served_model_name or self.source.name
        self.special_tokens_in_content = config.server.special_tokens_in_content
        self.config = config
        self.registry = registry
        self._structured_output: Any = None
        self._structured_output_lock = threading.Lock()
        self._constraints = ConstraintValidator()
        self.mm_processor, self.images_refusal = self._build_mm_processor()
        if self.mm_processor is not None and not isinstance(type(self.tokenizer).image_placeholder, property):
            # The tokenizer's message normalisation writes this for each image part (Tokenizer.image_placeholder).
            self.tokenizer.image_placeholder = self.tokenizer.decode([self.mm_processor.placeholder_token_id], False)

    def _build_mm_processor(self) -> tuple[MMProcessor | None, str]:
        """The multimodal processor ``use.mm_processor`` selects (``auto``: the one made for the architecture), and
        why image parts are refused without one (:mod:`weft.contracts.mm_processor`)."""
        architecture = self.architecture() or ""
        processor = select_parser(self.registry, "mm_processor", self.config.use.mm_processor, architecture)
        if processor is None:
            return None, (
                f"this model ({architecture or 'unknown architecture'}) reads no images: no multimodal processor is "
                f"made for it (use.mm_processor = {self.config.use.mm_processor!r}); send text parts only"
            )
        options = options_for(self.config, "mm_processor", processor, processor.name)
        try:
            return processor(options, MMProcessorConfig(architecture, self.source.hf_config, self.source.path)), ""
        except ValueError as error:  # a checkpoint that declares no vision encoder
            return None, str(error)

    def process_images(self, prompt_token_ids: list[int], images: list[ImageItem]) -> ProcessedPrompt:
        """The prompt with each image placeholder expanded by the multimodal processor; ValueError when the model
        reads no images or the processor refuses them. Call it off the event loop."""
        if self.mm_processor is None:
            raise ValueError(self.images_refusal)
        return self.mm_processor.process(prompt_token_ids, images)

    def structured_output_backend(self) -> Any:
        """The structured-output backend class requests are validated with (imported on first use); None when
        there is none (or ``use.structured_output = "none"``)."""
        with self._structured_output_lock:
            if self._structured_output is None:
                self._structured_output = (select_structured_output(self.registry, self.config.use.structured_output),)
            return self._structured_output[0]

    def close(self) -> None:
        """Stop the constraint validation process, if one started."""
        self._constraints.close()

    def architecture(self) -> str | None:
        architectures = self.source.hf_config.get("architectures") or [None]
        return architectures[0]

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; a text far longer than the context is refused (ValueError) after
        encoding only a prefix of it, not all of it."""
        self._refuse_far_too_long(text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of a conversation (``server.special_tokens_in_content`` decides whether special-token
        text inside messages is plain text or control tokens); ValueError for a conversation far too long."""
        self._refuse_far_too_long_chat(messages, template_kwargs)
        control = self.special_tokens_in_content == "control"
        return self.tokenizer.encode_chat(messages, add_generation_prompt, control, **template_kwargs)

    def _refuse_far_too_long_chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> None:
        """ValueError naming ``messages`` when the text of the conversation (every message's content, parts,
        calls and other strings, and the template's arguments) cannot fit the context, found by encoding a prefix."""
        texts = [text for value in (messages, template_kwargs) for text in _strings(value)]
        if sum(len(text) for text in texts) > self.max_model_len * _CHARS_PER_TOKEN_BOUND:
            try:
                self._refuse_far_too_long("\n".join(texts), False)
            except ValueError as error:
                raise ValueError(f"messages: {error}") from None

    def _refuse_far_too_long(self, text: str, add_special_tokens: bool) -> None:
        if len(text) <= self.max_model_len * _CHARS_PER_TOKEN_BOUND:
            return
        cut = text.rfind(" ", 0, self.max_model_len * _CHARS_PER_TOKEN_BOUND)
        prefix = self.tokenizer.encode(
            text[: cut if cut > 0 else self.max_model_len * _CHARS_PER_TOKEN_BOUND], add_special_tokens
        )
        if len(prefix) >= self.max_model_len:
            raise ValueError(
                f"a text of {len(text)} characters has more than {len(prefix) - 1} tokens, but the context length is "
                f"{self.max_model_len}; shorten it"
            )

    def core_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
        grammar_start: GrammarStart | None = None,
        multimodal: MultimodalInputs | None = None,
    ) -> EngineCoreRequest:
        """The core's request for a prompt; ValueError ``"<field>: <problem>"`` when the prompt or params don't
        fit the model.

        ``grammar_start``: where a constraint starts when the model may reason first (:class:`GrammarStart`).
        ``multimodal``: the prompt's images as :meth:`process_images` made them (its ids are the expanded ones)."""
        return self.core_requests(
            [(request_id, prompt_token_ids, params)], kv_transfer_params, grammar_start, multimodal
        )[0]

    def core_requests(
        self,
        requests: list[tuple[str, list[int], SamplingParams]],
        kv_transfer_params: dict[str, Any] | None = None,
        grammar_start: GrammarStart | None = None,
        multimodal: MultimodalInputs | None = None,
    ) -> list[EngineCoreRequest]:
        """:meth:`core_request` for each ``(request_id, prompt_token_ids, params)``: the sequences of one API
        request, whose params differ in their seed at most, so that checking them (a constraint compiled,
        bad words tokenized) is done once, not once per choice. Call it off the event loop."""
        unchecked: SamplingParams | None = None  # the last params checked, and the result
        checked: SamplingParams | None = None
        core_requests = []
        for request_id, prompt_token_ids, params in requests:
            self._check_prompt(prompt_token_ids)
            if unchecked is None or _without_seed(params) != _without_seed(unchecked):
                unchecked, checked = params, self._checked(params)
            params = msgspec.structs.replace(params, bad_words_token_ids=checked.bad_words_token_ids)
            room = self.max_model_len - len(prompt_token_ids)
            max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
            eos = () if params.ignore_eos else tuple(sorted(self.tokenizer.eos_token_ids))
            core_requests.append(
                EngineCoreRequest(
                    request_id,
                    list(prompt_token_ids),
                    params,
                    eos,
                    max_tokens,
                    kv_transfer_params,
                    grammar_start,
                    multimodal,
                )
            )
        return core_requests

    @property
    def _vocab(self) -> int:
        """Token ids are in ``range(self._vocab)``: the model's vocabulary, else the tokenizer's."""
        return self.vocab_size if self.vocab_size is not None else self.tokenizer.vocab_size

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: empty; give at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_token_ids)} tokens, but the context length is {self.max_model_len}; "
                f"shorten the prompt or raise engine.max_model_len"
            )
        low, high = min(prompt_token_ids), max(prompt_token_ids)
        if low < 0 or high >= self._vocab:
            raise ValueError(f"prompt: token ids must be in [0, {self._vocab}); got {low}..{high}")

    def _checked(self, params: SamplingParams) -> SamplingParams:
        """``params`` checked against the model (token ids, the constraint), its bad words tokenized."""
        for field, tokens in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            out_of_range = [token for token in tokens if not 0 <= token < self._vocab]
            if out_of_range:
                raise ValueError(f"{field}: token ids must be in [0, {self._vocab}); got {out_of_range[:5]}")
        if params.structured_outputs is not None:
            backend = self.structured_output_backend()
            if backend is None:
                raise ValueError(f"structured_outputs: {no_backend_message(self.config)}")
            self._constraints.validate(backend, params.structured_outputs)
        if params.bad_words and not params.bad_words_token_ids:
            params = msgspec.structs.replace(params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        return params

    def bad_words_token_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens as it would start the text and after a space (as vLLM bans them)."""
        sequences: dict[tuple[int, ...], None] = {}  # ordered and without duplicates
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                tokens = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if tokens:
                    sequences[tokens] = None
        return tuple(sequences)


def _without_seed(params: SamplingParams) -> SamplingParams:
    return msgspec.structs.replace(params, seed=None)


def _strings(value: Any) -> Iterator[str]:
    """Every string inside ``value`` (nested lists and dicts, keys excepted)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)
