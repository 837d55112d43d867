"""LLaVA 1.5's image processor: the ``llava`` multimodal processor (:mod:`weft.contracts.mm_processor`).

Each image placeholder (the checkpoint's ``image_token_index``, ``<image>``) expands to one run of that token, a
position per vision patch the projector hands the language model: ``(crop_height // patch) * (crop_width // patch)``
positions, plus one for the class token when ``vision_feature_select_strategy`` is ``"full"``. Every image is
resized and cropped to the same size, so every image gives the same number of positions.

The pixels are prepared as transformers' ``CLIPImageProcessor`` does (its Pillow backend, the one llava-hf's
checkpoints name): the shortest edge resized to ``size.shortest_edge`` (the other keeping the aspect ratio, rounded
down) with Pillow's bicubic filter on 8-bit pixels, a centre crop to ``crop_size``, then ``x / 255``, less the
mean, over the standard deviation, channels first: the encoder input ``pixel_values`` (float32 ``[3, height,
width]``). The settings come from the checkpoint's ``preprocessor_config.json`` where it has one, else CLIP's
defaults at the vision tower's ``image_size``.

Runs in the API process: numpy and Pillow, no torch. The prompt update of an image is cached by item hash (an LRU of
``cache_size`` items), so a repeated image is prepared once.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
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

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3
"""Pillow's (and transformers' ``PILImageResampling``) number of the bicubic filter."""


def vision_config_of(hf_config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The checkpoint's ``vision_config``; ValueError saying so when it declares none."""
    vision = hf_config.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(
            f"this {architecture} checkpoint declares no vision encoder (its config.json has no 'vision_config'), "
            f"so it reads no images; send text parts only"
        )
    return vision


def image_token_id_of(hf_config: dict[str, Any]) -> int:
    """The placeholder token: ``image_token_id`` (transformers 5's name) or ``image_token_index`` (the checkpoints')."""
    value = hf_config.get("image_token_id", hf_config.get("image_token_index"))
    if not isinstance(value, int):
        raise ValueError("the checkpoint's config.json names no image_token_index (or image_token_id)")
    return value


class LlavaProcessorOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[plugins."mm_processor.llava"]``."""

    cache_size: Annotated[int, msgspec.Meta(ge=0, description="prompt updates of images kept, by item hash")] = 256


class PixelSettings(msgspec.Struct, frozen=True):
    """How an image becomes ``pixel_values`` (a ``CLIPImageProcessor``'s settings)."""

    shortest_edge: int
    crop_height: int
    crop_width: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    resample: int = BICUBIC
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_center_crop: bool = True
    do_normalize: bool = True

    @classmethod
    def of(cls, model_path: str, image_size: int) -> PixelSettings:
        """From ``preprocessor_config.json`` in ``model_path`` where there is one, else CLIP's at ``image_size``."""
        path = Path(model_path) / "preprocessor_config.json" if model_path else None
        found: dict[str, Any] = json.loads(path.read_text()) if path is not None and path.is_file() else {}
        size = found.get("size", {"shortest_edge": image_size})
        crop = found.get("crop_size", {"height": image_size, "width": image_size})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        shortest = size.get("shortest_edge") if isinstance(size, dict) else size
        if not isinstance(shortest, int):
            raise ValueError(
                f"preprocessor_config.json: size {size!r} is not supported; LLaVA 1.5 resizes the shortest edge "
                f"(size.shortest_edge)"
            )
        return cls(
            shortest_edge=shortest,
            crop_height=int(crop["height"]),
            crop_width=int(crop["width"]),
            mean=tuple(found.get("image_mean", CLIP_MEAN)),
            std=tuple(found.get("image_std", CLIP_STD)),
            resample=int(found.get("resample", BICUBIC)),
            rescale_factor=float(found.get("rescale_factor", 1 / 255)),
            do_resize=bool(found.get("do_resize", True)),
            do_center_crop=bool(found.get("do_center_crop", True)),
            do_normalize=bool(found.get("do_normalize", True)),
        )


def pixel_values(item: ImageItem, settings: PixelSettings) -> Any:
    """float32 ``[3, height, width]``: the image resized, cropped, rescaled and normalised (module docstring)."""
    import numpy
    from PIL import Image

    array = item.to_array()
    if settings.do_resize:
        height, width = array.shape[:2]
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = settings.shortest_edge, int(settings.shortest_edge * long / short)
        new_height, new_width = (new_long, new_short) if width <= height else (new_short, new_long)
        resampling = Image.Resampling(settings.resample)
        array = numpy.asarray(Image.fromarray(array).resize((new_width, new_height), resample=resampling))
    if settings.do_center_crop:
        array = _center_crop(array, settings.crop_height, settings.crop_width)
    values = array.astype(numpy.float32) * numpy.float32(settings.rescale_factor)
    if settings.do_normalize:
        values = (values - numpy.asarray(settings.mean, numpy.float32)) / numpy.asarray(settings.std, numpy.float32)
    return numpy.ascontiguousarray(values.transpose(2, 0, 1), dtype=numpy.float32)


def _center_crop(array: Any, height: int, width: int) -> Any:
    """The centre ``height x width`` of ``[h, w, 3]`` ``array``, padded with zeros where it is smaller (as
    transformers' ``center_crop``)."""
    import numpy

    top, left = (array.shape[0] - height) // 2, (array.shape[1] - width) // 2
    if top >= 0 and left >= 0:
        return array[top : top + height, left : left + width]
    padded_height, padded_width = max(height, array.shape[0]), max(width, array.shape[1])
    padded = numpy.zeros((padded_height, padded_width, 3), dtype=array.dtype)
    pad_top, pad_left = (padded_height - array.shape[0]) // 2, (padded_width - array.shape[1]) // 2
    padded[pad_top : pad_top + array.shape[0], pad_left : pad_left + array.shape[1]] = array
    top, left = (padded_height - height) // 2, (padded_width - width) // 2
    return padded[top : top + height, left : left + width]


class LlavaProcessor(MMProcessor):
    """LLaVA 1.5: each image is one run of ``<image>`` tokens, one per projected vision patch (module docstring)."""

    name: ClassVar[str] = "llava"
    architectures: ClassVar[tuple[str, ...]] = ("LlavaForConditionalGeneration",)
    Options: ClassVar[type[msgspec.Struct]] = LlavaProcessorOptions

    def __init__(self, options: msgspec.Struct | None, config: MMProcessorConfig) -> None:
        super().__init__(options, config)
        hf_config = config.hf_config
        vision = vision_config_of(hf_config, config.architecture)
        self.placeholder_token_id = image_token_id_of(hf_config)
        self.settings = PixelSettings.of(config.model_path, int(vision.get("image_size", 336)))
        patch = int(vision.get("patch_size", 14))
        strategy = hf_config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r}: LLaVA 1.5 knows 'default' and 'full'")
        self.num_image_tokens = (self.settings.crop_height // patch) * (self.settings.crop_width // patch) + (
            strategy == "full"
        )
        self._salt = b"llava:" + msgspec.json.encode(self.settings)
        self._updates: OrderedDict[str, PromptUpdate] = OrderedDict()
        self._lock = threading.Lock()

    def process(self, prompt_token_ids: Sequence[int], items: Sequence[ImageItem]) -> ProcessedPrompt:
        return apply_prompt_updates(prompt_token_ids, self.placeholder_token_id, [self._update(item) for item in items])

    def _update(self, item: ImageItem) -> PromptUpdate:
        key = item_hash(item, self._salt)
        with self._lock:
            cached = self._updates.get(key)
            if cached is not None:
                self._updates.move_to_end(key)
                return cached
        update = PromptUpdate(
            key,
            (self.placeholder_token_id,) * self.num_image_tokens,
            {"pixel_values": TensorData.from_array(pixel_values(item, self.settings))},
        )
        size = self.options.cache_size  # type: ignore[attr-defined]
        with self._lock:
            self._updates[key] = update
            while len(self._updates) > size:
                self._updates.popitem(last=False)
        return update
