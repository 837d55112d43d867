"""Qwen2.5-VL's multimodal processor (``qwen2_5_vl``): dynamic-resolution patches and 3-axis rotary positions.

As transformers' ``Qwen2VLImageProcessorPil`` and ``Qwen2_5_VLProcessor``: the image is resized (bicubic) so that
both sides are multiples of ``patch_size * merge_size`` and its area lies in ``[min_pixels, max_pixels]``
(``smart_resize``), normalised with CLIP's mean and std, and cut into ``patch_size``-pixel patches, each repeated
``temporal_patch_size`` times (a still image is one frame) and flattened in the order the vision tower's patch
merger reads them (each ``merge_size x merge_size`` block's patches together). The placeholder ``<|image_pad|>``
(the chat template writes ``<|vision_start|><|image_pad|><|vision_end|>``) becomes ``grid_h * grid_w / merge**2``
copies of itself, one per merged patch.

Positions (M-RoPE): three axes, temporal, height and width. A text token advances all three by one; an image's
merged patch at row ``r`` and column ``c`` of its ``h x w`` grid sits at ``(p, p + r, p + c)`` where ``p`` is the
position after the text before it, and the text after the image continues at ``p + max(h, w)``. An item's
positions less its first one depend on the item alone, as the contract requires; the prompt's last position
plus one is where decoding continues on every axis (the prompt's positions are not ``0..n-1``, so the engine
reads them from :attr:`~weft.contracts.mm_processor.ProcessedPrompt.positions`).

Encoder inputs: ``pixel_values`` float32 ``[grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]`` and
``image_grid_thw`` int64 ``[3]`` (``1, grid_h, grid_w``), as the Hugging Face processor's per image.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec

from weft.contracts.mm_processor import (
    ImageItem,
    MMProcessorConfig,
    ProcessedPrompt,
    TensorData,
)
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


class Qwen2_5_VLProcessorOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[plugins."mm_processor.qwen2_5_vl"]``: unset values come from the checkpoint's ``preprocessor_config.json``
    and then transformers' defaults."""

    min_pixels: Annotated[
        int | None, msgspec.Meta(description="The fewest pixels of a resized image (default 56 * 56)")
    ] = None
    max_pixels: Annotated[
        int | None,
        msgspec.Meta(description="The most pixels of a resized image (default 28 * 28 * 1280); a larger one shrinks"),
    ] = None
    cache_size: Annotated[int, msgspec.Meta(description="Prompt updates kept, by item hash (an LRU)", ge=1)] = 256


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``smart_resize``: sides multiples of ``factor``, area within the bounds, aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"the image is {width}x{height}: Qwen2.5-VL takes an aspect ratio of at most 200, got "
            f"{max(height, width) / min(height, width):.1f}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2_5_VLProcessor(CachedUpdateProcessor):
    """Qwen2.5-VL: ``<|image_pad|>`` to one token per merged patch, M-RoPE positions (module docstring)."""

    name = "qwen2_5_vl"
    architectures: ClassVar[tuple[str, ...]] = ("Qwen2_5_VLForConditionalGeneration",)
    Options: ClassVar[type[msgspec.Struct]] = Qwen2_5_VLProcessorOptions
    options: Qwen2_5_VLProcessorOptions

    def __init__(self, options: msgspec.Struct | None, config: MMProcessorConfig) -> None:
        super().__init__(options, config)
        vision = vision_config(config)
        pre = preprocessor_config(config)
        size = pre.get("size") or {}
        self.placeholder_token_id = int(config.hf_config.get("image_token_id", 151655))
        self.patch_size = int(vision.get("patch_size", 14))
        self.merge_size = int(vision.get("spatial_merge_size", 2))
        self.temporal_patch_size = int(vision.get("temporal_patch_size", 2))
        self.min_pixels = self.options.min_pixels or pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56
        self.max_pixels = self.options.max_pixels or pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"plugins.qwen2_5_vl mm processor: min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}"
            )
        self.mean = tuple(pre.get("image_mean") or OPENAI_CLIP_MEAN)
        self.std = tuple(pre.get("image_std") or OPENAI_CLIP_STD)
        self.resample = int(pre.get("resample", RESAMPLING["bicubic"]))
        self.cache_size = self.options.cache_size
        self.salt = salt_of(self.name, self.settings())

    def settings(self) -> dict[str, Any]:
        """What decides the encoder inputs and the expansion (the item hash's salt)."""
        return {
            "placeholder": self.placeholder_token_id,
            "patch": self.patch_size,
            "merge": self.merge_size,
            "temporal": self.temporal_patch_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "mean": self.mean,
            "std": self.std,
            "resample": self.resample,
        }

    def compute(self, item: ImageItem, key: str) -> ItemUpdate:
        import numpy

        patch, merge = self.patch_size, self.merge_size
        height, width = smart_resize(item.height, item.width, patch * merge, self.min_pixels, self.max_pixels)
        image = normalize(resize(item.to_array(), height, width, self.resample), self.mean, self.std)
        grid_h, grid_w = height // patch, width // patch
        patches = image.reshape(3, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
        patches = numpy.broadcast_to(
            patches[:, :, :, :, :, None], (*patches.shape[:5], self.temporal_patch_size, patch, patch)
        )
        pixel_values = patches.reshape(grid_h * grid_w, 3 * self.temporal_patch_size * patch * patch)
        tokens = grid_h * grid_w // (merge * merge)
        return ItemUpdate(
            key,
            (self.placeholder_token_id,) * tokens,
            {
                "pixel_values": TensorData.from_array(pixel_values),
                "image_grid_thw": TensorData.from_array(numpy.asarray([1, grid_h, grid_w], dtype=numpy.int64)),
            },
        )

    def process(self, prompt_token_ids: Sequence[int], items: Sequence[ImageItem]) -> ProcessedPrompt:
        processed = super().process(prompt_token_ids, items)
        grids = [tuple(item.encoder_inputs["image_grid_thw"].to_numpy().tolist()) for item in processed.items]
        starts = [item.ranges[0].offset for item in processed.items]
        positions = mrope_positions(len(processed.token_ids), starts, grids, self.merge_size)
        return msgspec.structs.replace(processed, positions=TensorData.from_array(positions))


def mrope_positions(length: int, starts: Sequence[int], grids: Sequence[tuple[int, int, int]], merge_size: int) -> Any:
    """int64 ``[3, length]``: the temporal, height and width position of each prompt position (module docstring).

    ``starts[i]`` is item ``i``'s first position in the prompt, ``grids[i]`` its ``(t, grid_h, grid_w)`` in patches.
    """
    import numpy

    positions = numpy.empty((3, length), dtype=numpy.int64)
    index = position = 0
    for start, (frames, grid_h, grid_w) in zip(starts, grids, strict=True):
        text = start - index
        positions[:, index:start] = numpy.arange(position, position + text)
        position += text
        rows, columns = grid_h // merge_size, grid_w // merge_size
        size = frames * rows * columns
        temporal, row, column = numpy.meshgrid(
            numpy.arange(frames), numpy.arange(rows), numpy.arange(columns), indexing="ij"
        )
        positions[:, start : start + size] = numpy.stack([temporal, row, column]).reshape(3, -1) + position
        position += max(rows, columns)
        index = start + size
    positions[:, index:] = numpy.arange(position, position + length - index)
    return positions
