"""DeepSeek V4.1's multimodal token stream: the ``dsv4`` multimodal processor (:mod:`weft.contracts.mm_processor`).

Each image placeholder (token 129264) expands to ``START + (IMAGE * w + NEWLINE) * h + END``: ``h * (w + 1) + 2``
positions, every one with id 129264, their roles in a separate ``token_types`` extra (:data:`TOKEN_TYPES`; text is
0). Positions are consecutive, as for text: each of the ``h * (w + 1) + 2`` slots takes one position, so the
processed prompt carries no ``positions`` (the model's rotary embedding is one-dimensional).

The expansion depends only on the image. An earlier port prepended alignment pads so that every image span started
at a fixed compressor phase; that padding belonged to another (vision-exp) variant and made the expansion depend on
where the image sat in the prompt, so per-item updates could not be cached. Here the same image at any offset gives
the same replacement and the same item hash, and the update is cached per item hash (an LRU).

``h`` and ``w`` (tokens per column and per row) come from the image's size: one token per ``patch_size * merge_size``
pixels each way, rounded, at least one, and scaled down (keeping the aspect ratio) to at most ``max_image_tokens``
IMAGE tokens. transformers 5.24's DeepSeek V4 (``models/deepseek_v4``) has no vision tower and its config no vision
settings, so the patch size and the merge factor are options of this processor: set them to the checkpoint's.
The encoder inputs are the image resized to ``(w * patch_size * merge_size, h * patch_size * merge_size)`` as uint8
``pixels`` ``[H, W, 3]`` (normalisation belongs to the family's encoder) and the ``grid`` ``[h, w]``.

A checkpoint declares its vision encoder with a ``vision_config`` table in ``config.json`` (Hugging Face's key for
vision-language checkpoints); without one, image parts are refused (here and in :mod:`weft_dsv4.chat`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec

from weft.contracts.mm_processor import (
    ImageItem,
    MMProcessor,
    MMProcessorConfig,
    ProcessedPrompt,
    PromptUpdate,
    TensorData,
    apply_prompt_updates,
    item_hash,
)

IMAGE_TOKEN_ID = 129264
VISION_CONFIG_KEY = "vision_config"
TOKEN_TYPES = {"text": 0, "image_start": 1, "image": 2, "image_newline": 3, "image_end": 4}
"""The role of each position, in the ``token_types`` extra: Weft's numbering (the checkpoint's own is not
published); the family's encoder and merge read these values."""


def declares_vision_encoder(hf_config: dict[str, Any]) -> bool:
    """Whether a checkpoint's ``config.json`` declares a vision encoder (a ``vision_config`` table)."""
    return isinstance(hf_config.get(VISION_CONFIG_KEY), dict)


class DeepseekV4MMOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[plugins."mm_processor.dsv4"]`` (the tokenizer, also named dsv4, has ``[plugins."tokenizer.dsv4"]``)."""

    image_token_id: Annotated[
        int,
        msgspec.Meta(
            description="The placeholder each image part becomes; equal to the dsv4 tokenizer's image_token_id"
        ),
    ] = IMAGE_TOKEN_ID
    patch_size: Annotated[
        int,
        msgspec.Meta(
            description="Pixels per side of one vision-encoder patch (the checkpoint's; not in transformers' config)"
        ),
    ] = 16
    merge_size: Annotated[
        int, msgspec.Meta(description="Patches merged per side into one IMAGE token (the checkpoint's)")
    ] = 2
    max_image_tokens: Annotated[
        int,
        msgspec.Meta(
            description="The most IMAGE tokens (h * w) of one image; a larger one is scaled down, keeping its "
            "aspect ratio"
        ),
    ] = 4096
    cache_size: Annotated[int, msgspec.Meta(description="Prompt updates kept, by item hash (an LRU)")] = 256

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "max_image_tokens", "cache_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"plugins.dsv4 mm processor: {name} = {getattr(self, name)} must be at least 1")


def image_grid(width: int, height: int, options: DeepseekV4MMOptions) -> tuple[int, int]:
    """``(h, w)``: IMAGE tokens per column and per row for an image of ``width x height`` pixels."""
    side = options.patch_size * options.merge_size
    rows, columns = max(1, round(height / side)), max(1, round(width / side))
    if rows * columns > options.max_image_tokens:
        scale = (options.max_image_tokens / (rows * columns)) ** 0.5
        rows, columns = max(1, int(rows * scale)), max(1, int(columns * scale))
        while rows * columns > options.max_image_tokens:  # int() of a 1-clamped side can still overshoot
            if rows >= columns:
                rows -= 1
            else:
                columns -= 1
    return rows, columns


def token_types(rows: int, columns: int) -> tuple[int, ...]:
    """The roles of an image span: START, then per row ``columns`` IMAGE and one NEWLINE, then END."""
    row = (TOKEN_TYPES["image"],) * columns + (TOKEN_TYPES["image_newline"],)
    return (TOKEN_TYPES["image_start"], *row * rows, TOKEN_TYPES["image_end"])


class DeepseekV4MMProcessor(MMProcessor):
    """DeepSeek V4.1's image token stream: START + (IMAGE*w + NEWLINE)*h + END per image, cached per item."""

    name = "dsv4"
    architectures: ClassVar[tuple[str, ...]] = ("DeepseekV4ForCausalLM",)
    Options: ClassVar[type[msgspec.Struct]] = DeepseekV4MMOptions
    options: DeepseekV4MMOptions

    def __init__(self, options: msgspec.Struct | None, config: MMProcessorConfig) -> None:
        super().__init__(options, config)
        if not declares_vision_encoder(config.hf_config):
            raise ValueError(
                f"this {config.architecture} checkpoint declares no vision encoder (its config.json has no "
                f"'{VISION_CONFIG_KEY}'), so it reads no images; send text only, or serve a checkpoint with one"
            )
        self.placeholder_token_id = self.options.image_token_id
        # The hash covers what decides the encoder's inputs, not the cache's size.
        options = self.options
        self._salt = b"dsv4:%d:%d:%d" % (options.patch_size, options.merge_size, options.max_image_tokens)
        self._updates: OrderedDict[str, PromptUpdate] = OrderedDict()
        self._lock = threading.Lock()

    def process(self, prompt_token_ids: Sequence[int], items: Sequence[ImageItem]) -> ProcessedPrompt:
        updates = [self.prompt_update(item) for item in items]
        return apply_prompt_updates(prompt_token_ids, self.placeholder_token_id, updates, {"token_types": 0}, "int8")

    def prompt_update(self, item: ImageItem) -> PromptUpdate:
        """The item's replacement, from the cache when its hash was seen."""
        key = item_hash(item, self._salt)
        with self._lock:
            update = self._updates.get(key)
            if update is not None:
                self._updates.move_to_end(key)
                return update
        update = self._compute(item, key)
        with self._lock:
            self._updates[key] = update
            while len(self._updates) > self.options.cache_size:
                self._updates.popitem(last=False)
        return update

    @property
    def cached_items(self) -> int:
        return len(self._updates)

    def _compute(self, item: ImageItem, key: str) -> PromptUpdate:
        import numpy
        from PIL import Image

        rows, columns = image_grid(item.width, item.height, self.options)
        side = self.options.patch_size * self.options.merge_size
        image = Image.frombytes("RGB", (item.width, item.height), item.pixels)
        resized = image.resize((columns * side, rows * side), Image.Resampling.BICUBIC)
        types = token_types(rows, columns)
        return PromptUpdate(
            key,
            (self.placeholder_token_id,) * len(types),
            {
                "pixels": TensorData.from_array(numpy.asarray(resized, dtype=numpy.uint8)),
                "grid": TensorData.from_array(numpy.asarray([rows, columns], dtype=numpy.int64)),
            },
            {"token_types": types},
        )
