"""Idefics3 / SmolVLM's multimodal processor (``idefics3``): image splitting into square crops plus a global view.

As transformers' ``Idefics3ImageProcessorPil`` and ``Idefics3Processor``: the image is resized (Lanczos) so its
longest side is ``size`` (4 x the crop side by default; the other side keeps the aspect ratio, made even), then
up to whole multiples of the crop side ``max_image_size``; an image larger than one crop is cut into
``rows x columns`` crops, read row by row, and a global view (the whole image resized to one crop) follows
them. Each crop is normalised (mean and std 0.5) into ``pixel_values`` ``[crops + 1, 3, side, side]``; an
image that fits one crop is that one view.

The placeholder ``<image>`` becomes, for a split image::

    (<fake_token_around_image> <row_r_col_c> <image> * seq) * columns "\\n"     for each row r
    "\\n" <fake_token_around_image> <global-img> <image> * seq <fake_token_around_image>

and without splitting just the last line (without its leading newline). ``seq`` is the vision tower's patches
per crop over ``scale_factor**2`` (the pixel shuffle). The item's range is its whole replacement, markers
included, so that the replacement is one span of encoder rows (the contract's invariants, and one cache entry
per item): the family's ``encode`` writes the views' features at the ``<image>`` positions and the markers'
own token embeddings at the others, reading the replacement from the ``token_ids`` encoder input.

The marker tokens are the tokenizer's: their ids and those of ``"\\n"`` and ``"\\n\\n"`` (the text between two
markers is tokenised apart, so the newline after the last row and the one before the global view read as one
``"\\n\\n"``) come from the checkpoint's ``tokenizer.json`` (read with the ``tokenizers`` library), or from this
processor's options where there is none.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

import msgspec

from weft.contracts.mm_processor import ImageItem, MMProcessorConfig, TensorData
from weft_vision.processing import (
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    RESAMPLING,
    CachedUpdateProcessor,
    ItemUpdate,
    normalize,
    preprocessor_config,
    resize,
    salt_of,
    vision_config,
)

MAX_IMAGE_SIZE = 4096
"""transformers' bound on either side after the first resize."""

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
MAX_GRID = 6
"""``<row_r_col_c>`` markers exist for r, c up to 6."""


class Idefics3ProcessorOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[plugins."mm_processor.idefics3"]``: the marker token ids where the checkpoint has no ``tokenizer.json``;
    the resizing comes from its ``preprocessor_config.json``."""

    fake_image_token_id: Annotated[int | None, msgspec.Meta(description="Id of <fake_token_around_image>")] = None
    global_image_token_id: Annotated[int | None, msgspec.Meta(description="Id of <global-img>")] = None
    row_col_token_ids: Annotated[
        list[int] | None,
        msgspec.Meta(description="Ids of <row_1_col_1> ... <row_6_col_6>, row by row (36 ids)"),
    ] = None
    newline_token_ids: Annotated[list[int] | None, msgspec.Meta(description='The ids "\\n" tokenises to')] = None
    double_newline_token_ids: Annotated[list[int] | None, msgspec.Meta(description='The ids "\\n\\n" tokenises to')] = (
        None
    )
    cache_size: Annotated[int, msgspec.Meta(description="Prompt updates kept, by item hash (an LRU)", ge=1)] = 256


class Idefics3Processor(CachedUpdateProcessor):
    """Idefics3 / SmolVLM: crops and a global view, each a run of ``<image>`` between markers (module docstring)."""

    name = "idefics3"
    architectures: ClassVar[tuple[str, ...]] = ("Idefics3ForConditionalGeneration",)
    Options: ClassVar[type[msgspec.Struct]] = Idefics3ProcessorOptions
    options: Idefics3ProcessorOptions

    def __init__(self, options: msgspec.Struct | None, config: MMProcessorConfig) -> None:
        super().__init__(options, config)
        vision = vision_config(config)
        pre = preprocessor_config(config)
        image_size, patch_size = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
        scale = int(config.hf_config.get("scale_factor", 2))
        self.placeholder_token_id = int(config.hf_config.get("image_token_id", 128257))
        self.image_seq_len = (image_size // patch_size) ** 2 // (scale * scale)
        self.crop_side = int((pre.get("max_image_size") or {}).get("longest_edge", image_size))
        self.longest_edge = int((pre.get("size") or {}).get("longest_edge", 4 * self.crop_side))
        self.splitting = bool(pre.get("do_image_splitting", True))
        self.mean = tuple(pre.get("image_mean") or IMAGENET_STANDARD_MEAN)
        self.std = tuple(pre.get("image_std") or IMAGENET_STANDARD_STD)
        self.resample = int(pre.get("resample", RESAMPLING["lanczos"]))
        self._tokens(config)
        self.cache_size = self.options.cache_size
        self.salt = salt_of(self.name, self.settings())

    def _tokens(self, config: MMProcessorConfig) -> None:
        options = self.options
        marker_names = [FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN] + [
            f"<row_{row + 1}_col_{column + 1}>" for row in range(MAX_GRID) for column in range(MAX_GRID)
        ]
        given = [options.fake_image_token_id, options.global_image_token_id, options.row_col_token_ids]
        newlines = [options.newline_token_ids, options.double_newline_token_ids]
        if all(value is not None for value in given + newlines):
            ids = [options.fake_image_token_id, options.global_image_token_id, *options.row_col_token_ids]
            newline, double_newline = list(options.newline_token_ids), list(options.double_newline_token_ids)
        else:
            tokenizer = _tokenizer(config)
            ids = [tokenizer.token_to_id(name) for name in marker_names]
            missing = [name for name, token in zip(marker_names, ids, strict=True) if token is None]
            if missing:
                raise ValueError(
                    f"the checkpoint's tokenizer.json has no {missing[:3]} token(s) that Idefics3 images need; "
                    f"is this an Idefics3 / SmolVLM checkpoint?"
                )
            newline = tokenizer.encode("\n", add_special_tokens=False).ids
            double_newline = tokenizer.encode("\n\n", add_special_tokens=False).ids
        if len(ids) != 2 + MAX_GRID * MAX_GRID:
            raise ValueError(
                f"plugins.idefics3 mm processor: row_col_token_ids holds {len(ids) - 2} ids; it needs "
                f"{MAX_GRID * MAX_GRID}, <row_1_col_1> to <row_6_col_6> row by row"
            )
        self.fake_image_token_id, self.global_image_token_id = ids[0], ids[1]
        self.row_col_token_ids = ids[2:]
        self.newline, self.double_newline = tuple(newline), tuple(double_newline)

    def settings(self) -> dict[str, Any]:
        """What decides the encoder inputs and the expansion (the item hash's salt)."""
        return {
            "placeholder": self.placeholder_token_id,
            "seq": self.image_seq_len,
            "crop": self.crop_side,
            "longest_edge": self.longest_edge,
            "splitting": self.splitting,
            "mean": self.mean,
            "std": self.std,
            "resample": self.resample,
            "markers": [self.fake_image_token_id, self.global_image_token_id, *self.row_col_token_ids],
            "newlines": [self.newline, self.double_newline],
        }

    def crops(self, image: Any) -> tuple[list[Any], int, int]:
        """``(views, rows, columns)``: the ``[side, side, 3]`` uint8 crops row by row and the global view last
        (rows = columns = 0: the one view of an image that is not split)."""
        side = self.crop_side
        height, width = resize_to_longest_edge(image.shape[0], image.shape[1], self.longest_edge)
        image = resize(image, height, width, self.resample)
        if not self.splitting:
            return [resize(image, side, side, self.resample)], 0, 0
        height, width = multiples_of_side(height, width, side)
        image = resize(image, height, width, self.resample)
        if height <= side and width <= side:
            return [image], 0, 0
        rows, columns = (height - side) // side + 1, (width - side) // side + 1
        views = [
            image[row * side : (row + 1) * side, column * side : (column + 1) * side]
            for row in range(rows)
            for column in range(columns)
        ]
        views.append(resize(image, side, side, self.resample))
        return views, rows, columns

    def compute(self, item: ImageItem, key: str) -> ItemUpdate:
        import numpy

        views, rows, columns = self.crops(item.to_array())
        if rows > MAX_GRID or columns > MAX_GRID:
            raise ValueError(
                f"the image is {item.width}x{item.height}: split into {rows}x{columns} crops, more than the "
                f"{MAX_GRID}x{MAX_GRID} the <row_r_col_c> markers name; lower the preprocessor's size"
            )
        pixel_values = numpy.stack([normalize(view, self.mean, self.std) for view in views])
        run = [self.placeholder_token_id] * self.image_seq_len
        tokens: list[int] = []
        for row in range(rows):
            for column in range(columns):
                tokens += [self.fake_image_token_id, self.row_col_token_ids[row * MAX_GRID + column], *run]
            tokens += self.newline if row < rows - 1 else self.double_newline
        tokens += [self.fake_image_token_id, self.global_image_token_id, *run, self.fake_image_token_id]
        return ItemUpdate(
            key,
            tuple(tokens),
            {
                "pixel_values": TensorData.from_array(pixel_values),
                "token_ids": TensorData.from_array(numpy.asarray(tokens, dtype=numpy.int64)),
            },
        )


def resize_to_longest_edge(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """transformers' first resize: the longest side to ``longest_edge``, the other by the aspect ratio (even), then
    both within :data:`MAX_IMAGE_SIZE`."""
    aspect_ratio = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect_ratio = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect_ratio)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect_ratio)
    return max(height, 1), max(width, 1)


def multiples_of_side(height: int, width: int, side: int) -> tuple[int, int]:
    """transformers' ``resize_for_vision_encoder``: both sides up to whole crops, the shorter by the aspect ratio."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / aspect_ratio) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * aspect_ratio) / side) * side
    return height, width


def _tokenizer(config: MMProcessorConfig) -> Any:
    from pathlib import Path

    path = Path(config.model_path) / "tokenizer.json" if config.model_path else None
    if path is None or not path.is_file():
        raise ValueError(
            f"the Idefics3 processor reads its marker tokens' ids from the checkpoint's tokenizer.json, and "
            f"{path or 'no checkpoint folder'} is not there; set fake_image_token_id, global_image_token_id, "
            f"row_col_token_ids, newline_token_ids and double_newline_token_ids in "
            f'[plugins."mm_processor.idefics3"]'
        )
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
