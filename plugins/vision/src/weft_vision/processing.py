"""What the vision families' multimodal processors share: the per-item update cache and the image operations.

Runs in the API process: numpy and Pillow only, no torch. The image operations reproduce transformers' Pillow
image processors (``image_processing_pil_*``, the ``PilBackend``) step for step, so that the pixel values equal
theirs: resizing goes through Pillow on the 8-bit image (the result is 8-bit again), rescaling multiplies in
float64 and rounds to float32, and normalising subtracts and divides in float32.

A processor here computes one :class:`ItemUpdate` per item from the item alone and keeps it in an LRU keyed by
:func:`~weft.contracts.mm_processor.item_hash`, whose salt is the processor's name and every option that changes
the encoder inputs or the expansion. An update is core's :class:`~weft.contracts.mm_processor.PromptUpdate` plus
where in its replacement the encoder's rows go: an Idefics3 image's replacement interleaves text tokens (the
``<fake_token_around_image>`` and ``<row_i_col_j>`` markers, newlines) with its crops' runs of ``<image>``.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from weft.contracts.mm_processor import (
    ImageItem,
    MMProcessor,
    MMProcessorConfig,
    PlaceholderRange,
    ProcessedItem,
    ProcessedPrompt,
    TensorData,
    item_hash,
)

if TYPE_CHECKING:
    import numpy

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)

RESAMPLING = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
"""Pillow's filter numbers by name (``PIL.Image.Resampling``; transformers' ``resample`` is the same number)."""


def resize(image: numpy.ndarray, height: int, width: int, resample: int) -> numpy.ndarray:
    """``[H, W, 3]`` uint8 to ``[height, width, 3]`` uint8 through Pillow (a no-op at the same size, as Pillow's)."""
    import numpy
    from PIL import Image

    return numpy.asarray(Image.fromarray(image).resize((width, height), resample=resample))


def normalize(image: numpy.ndarray, mean: Sequence[float], std: Sequence[float]) -> numpy.ndarray:
    """``[H, W, 3]`` uint8 to ``[3, H, W]`` float32: ``(pixel / 255 - mean) / std`` as transformers rounds it."""
    import numpy

    scaled = (image.astype(numpy.float64) * (1 / 255)).astype(numpy.float32)
    normalized = (scaled - numpy.asarray(mean, dtype=numpy.float32)) / numpy.asarray(std, dtype=numpy.float32)
    return numpy.ascontiguousarray(normalized.transpose(2, 0, 1))


def preprocessor_config(config: MMProcessorConfig) -> dict[str, Any]:
    """The checkpoint's ``preprocessor_config.json`` (``{}`` without a folder or without the file)."""
    import json
    from pathlib import Path

    if not config.model_path:
        return {}
    path = Path(config.model_path) / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def vision_config(config: MMProcessorConfig) -> dict[str, Any]:
    """The checkpoint's ``vision_config``; a ValueError saying so where it declares none."""
    vision = config.hf_config.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(
            f"this {config.architecture} checkpoint declares no vision encoder (its config.json has no "
            f"'vision_config'), so it reads no images; send text only, or serve a checkpoint with one"
        )
    return vision


class ItemUpdate(msgspec.Struct, frozen=True):
    """One item's replacement for its placeholder, independent of where the item sits (what the LRU keeps)."""

    hash: str
    token_ids: tuple[int, ...]
    encoder_inputs: dict[str, TensorData]
    ranges: tuple[tuple[int, int], ...] = ()
    """``(offset, length)`` runs of the replacement that the encoder's rows fill, in order; empty: all of it."""


def apply_updates(
    prompt_token_ids: Sequence[int], placeholder_token_id: int, updates: Sequence[ItemUpdate]
) -> ProcessedPrompt:
    """Replace each placeholder of the prompt by its item's update, in order, placing the items' ranges.

    A ValueError names both numbers when the placeholders and the updates differ in number.
    """
    found = sum(1 for token in prompt_token_ids if token == placeholder_token_id)
    if found != len(updates):
        raise ValueError(
            f"the prompt holds {found} image placeholder(s) (token {placeholder_token_id}) but "
            f"{len(updates)} image(s) came with it; each image part must become exactly one placeholder"
        )
    token_ids: list[int] = []
    items = []
    updates_left = iter(updates)
    for token in prompt_token_ids:
        if token != placeholder_token_id:
            token_ids.append(token)
            continue
        update = next(updates_left)
        runs = update.ranges or ((0, len(update.token_ids)),)
        start = len(token_ids)
        ranges = tuple(PlaceholderRange(start + offset, length) for offset, length in runs)
        items.append(ProcessedItem(update.hash, ranges, update.encoder_inputs))
        token_ids.extend(update.token_ids)
    return ProcessedPrompt(token_ids, items)


class CachedUpdateProcessor(MMProcessor):
    """A processor whose expansion of an item is one :class:`ItemUpdate` computed from the item alone, cached
    per item hash. A subclass sets ``placeholder_token_id`` and ``salt`` in its ``__init__`` and implements
    :meth:`compute`; :meth:`process` assembles the prompt (a subclass adds what spans items, e.g. positions)."""

    cache_size: int = 256
    salt: bytes

    def __init__(self, options: msgspec.Struct | None, config: MMProcessorConfig) -> None:
        super().__init__(options, config)
        self._updates: OrderedDict[str, ItemUpdate] = OrderedDict()
        self._lock = threading.Lock()

    def process(self, prompt_token_ids: Sequence[int], items: Sequence[ImageItem]) -> ProcessedPrompt:
        updates = [self.prompt_update(item) for item in items]
        return apply_updates(prompt_token_ids, self.placeholder_token_id, updates)

    def prompt_update(self, item: ImageItem) -> ItemUpdate:
        """The item's replacement, from the cache when its hash was seen."""
        key = item_hash(item, self.salt)
        with self._lock:
            update = self._updates.get(key)
            if update is not None:
                self._updates.move_to_end(key)
                return update
        update = self.compute(item, key)
        with self._lock:
            self._updates[key] = update
            while len(self._updates) > self.cache_size:
                self._updates.popitem(last=False)
        return update

    @property
    def cached_items(self) -> int:
        return len(self._updates)

    @abstractmethod
    def compute(self, item: ImageItem, key: str) -> ItemUpdate:
        """The replacement ids and encoder inputs of ``item`` (hash ``key``)."""


def salt_of(name: str, settings: dict[str, Any]) -> bytes:
    """The item-hash salt: the processor's name and the settings that decide its output, as sorted JSON."""
    return name.encode() + b":" + msgspec.json.encode(dict(sorted(settings.items())))
