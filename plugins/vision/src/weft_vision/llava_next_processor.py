"""LLaVA-Next's multimodal processor (``llava_next``): "anyres" tiling with a base view.

As transformers' ``LlavaNextImageProcessorPil`` and ``LlavaNextProcessor``: of the checkpoint's
``image_grid_pinpoints`` the resolution that keeps the most of the image and wastes the least is chosen; the
image is resized into it keeping its aspect ratio (bicubic), centred on black padding, and cut into tiles of the
vision tower's side; the base view (the whole image squashed to one tile) comes first. Every view is resized
on its shortest edge, centre-cropped and normalised with CLIP's mean and std: ``pixel_values``
``[1 + tiles, 3, side, side]`` and ``image_sizes`` ``[height, width]``.

The placeholder ``<image>`` becomes as many copies of itself as the model's packed features have rows: the base
view's ``p * p`` patch features (the CLS feature dropped, ``vision_feature_select_strategy = "default"``), then
the tiles' features as one grid with the padding's rows or columns removed ("unpadded"), each of its rows
followed by the ``image_newline`` feature. One range covers it all.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

import msgspec

from weft.contracts.mm_processor import ImageItem, MMProcessorConfig, TensorData
from weft_vision.processing import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    RESAMPLING,
    CachedUpdateProcessor,
    ItemUpdate,
    normalize,
    preprocessor_config,
    resize,
    salt_of,
    vision_config,
)

DEFAULT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


class LlavaNextProcessorOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[plugins."mm_processor.llava_next"]``: the resizing comes from the checkpoint's config and
    ``preprocessor_config.json``."""

    cache_size: Annotated[int, msgspec.Meta(description="Prompt updates kept, by item hash (an LRU)", ge=1)] = 256


def select_best_resolution(height: int, width: int, resolutions: list[list[int]]) -> tuple[int, int]:
    """transformers' choice among ``(height, width)`` resolutions: the most effective pixels, then the least waste."""
    best, best_effective, best_wasted = None, 0, float("inf")
    for target_height, target_width in resolutions:
        scale = min(target_width / width, target_height / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = target_width * target_height - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (target_height, target_width), effective, wasted
    assert best is not None, "image_grid_pinpoints is empty"
    return best


def fit_into(height: int, width: int, target_height: int, target_width: int) -> tuple[int, int]:
    """transformers' ``get_patch_output_size``: the image scaled to fit the target, aspect kept (rounded up)."""
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_height), target_width
    return target_height, min(math.ceil(width * scale_h), target_width)


def unpadded_grid(height: int, width: int, grid_height: int, grid_width: int) -> tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` of the features of an image of ``height x width`` pixels in a padded feature
    grid of ``grid_height x grid_width`` (transformers' ``unpad_image``)."""
    if width / height > grid_width / grid_height:
        new_height = int(round(height * (grid_width / width), 7))
        padding = (grid_height - new_height) // 2
        return padding, grid_height - padding, 0, grid_width
    new_width = int(round(width * (grid_height / height), 7))
    padding = (grid_width - new_width) // 2
    return 0, grid_height, padding, grid_width - padding


class LlavaNextProcessor(CachedUpdateProcessor):
    """LLaVA-Next: base view plus anyres tiles, ``<image>`` once per packed feature (module docstring)."""

    name = "llava_next"
    architectures: ClassVar[tuple[str, ...]] = ("LlavaNextForConditionalGeneration",)
    Options: ClassVar[type[msgspec.Struct]] = LlavaNextProcessorOptions
    options: LlavaNextProcessorOptions

    def __init__(self, options: msgspec.Struct | None, config: MMProcessorConfig) -> None:
        super().__init__(options, config)
        hf_config = config.hf_config
        vision = vision_config(config)
        pre = preprocessor_config(config)
        strategy = hf_config.get("vision_feature_select_strategy", "default")
        if strategy != "default":
            raise ValueError(
                f"vision_feature_select_strategy = {strategy!r}: LLaVA-Next's anyres packing needs 'default' "
                f"(the CLS feature dropped), as transformers' does"
            )
        self.placeholder_token_id = int(hf_config.get("image_token_id", hf_config.get("image_token_index", 32000)))
        self.tile = int(vision.get("image_size", 224))
        self.patches_per_side = self.tile // int(vision.get("patch_size", 32))
        self.pinpoints = [list(map(int, pair)) for pair in hf_config.get("image_grid_pinpoints", DEFAULT_PINPOINTS)]
        self.shortest_edge = int((pre.get("size") or {}).get("shortest_edge", self.tile))
        crop = pre.get("crop_size") or {}
        self.crop = (int(crop.get("height", self.tile)), int(crop.get("width", self.tile)))
        self.mean = tuple(pre.get("image_mean") or OPENAI_CLIP_MEAN)
        self.std = tuple(pre.get("image_std") or OPENAI_CLIP_STD)
        self.resample = int(pre.get("resample", RESAMPLING["bicubic"]))
        self.cache_size = self.options.cache_size
        self.salt = salt_of(self.name, self.settings())

    def settings(self) -> dict[str, Any]:
        """What decides the encoder inputs and the expansion (the item hash's salt)."""
        return {
            "placeholder": self.placeholder_token_id,
            "tile": self.tile,
            "patches": self.patches_per_side,
            "pinpoints": self.pinpoints,
            "shortest_edge": self.shortest_edge,
            "crop": self.crop,
            "mean": self.mean,
            "std": self.std,
            "resample": self.resample,
        }

    def num_features(self, height: int, width: int) -> int:
        """Rows of the packed features of an image of ``height x width`` pixels."""
        best_height, best_width = select_best_resolution(height, width, self.pinpoints)
        side = self.patches_per_side
        grid_height, grid_width = side * (best_height // self.tile), side * (best_width // self.tile)
        top, bottom, left, right = unpadded_grid(height, width, grid_height, grid_width)
        return side * side + (bottom - top) * (right - left + 1)

    def views(self, image: Any) -> list[Any]:
        """The base view, then the tiles row by row, ``[H, W, 3]`` uint8 before the per-view resize and crop."""
        import numpy

        height, width = image.shape[:2]
        best_height, best_width = select_best_resolution(height, width, self.pinpoints)
        fit_height, fit_width = fit_into(height, width, best_height, best_width)
        fitted = resize(image, fit_height, fit_width, self.resample)
        top, left = (best_height - fit_height) // 2, (best_width - fit_width) // 2
        padded = numpy.zeros((best_height, best_width, 3), dtype=numpy.uint8)
        padded[top : top + fit_height, left : left + fit_width] = fitted
        tile = self.crop[0]
        tiles = [
            padded[row : row + tile, column : column + tile]
            for row in range(0, best_height, tile)
            for column in range(0, best_width, tile)
        ]
        return [resize(image, self.shortest_edge, self.shortest_edge, self.resample), *tiles]

    def _resize_and_crop(self, view: Any) -> Any:
        """transformers' per-view ``resize`` (shortest edge) and ``center_crop`` (a no-op on square tiles)."""
        import numpy

        height, width = view.shape[:2]
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        size = (new_long, new_short) if width <= height else (new_short, new_long)
        view = resize(view, size[0], size[1], self.resample)
        crop_height, crop_width = self.crop
        height, width = view.shape[:2]
        if crop_height > height or crop_width > width:
            grown = numpy.zeros((max(crop_height, height), max(crop_width, width), 3), dtype=numpy.uint8)
            pad_top, pad_left = math.ceil((grown.shape[0] - height) / 2), math.ceil((grown.shape[1] - width) / 2)
            grown[pad_top : pad_top + height, pad_left : pad_left + width] = view
            view = grown
            height, width = view.shape[:2]
        top, left = (height - crop_height) // 2, (width - crop_width) // 2
        return view[top : top + crop_height, left : left + crop_width]

    def compute(self, item: ImageItem, key: str) -> ItemUpdate:
        import numpy

        views = [self._resize_and_crop(view) for view in self.views(item.to_array())]
        pixel_values = numpy.stack([normalize(view, self.mean, self.std) for view in views])
        count = self.num_features(item.height, item.width)
        return ItemUpdate(
            key,
            (self.placeholder_token_id,) * count,
            {
                "pixel_values": TensorData.from_array(pixel_values),
                "image_sizes": TensorData.from_array(numpy.asarray([item.height, item.width], dtype=numpy.int64)),
            },
        )
