"""The multimodal-processor slot: images into placeholder expansions, encoder inputs and item hashes.

A vision-language model reads an image as a run of prompt positions whose embeddings come from its
vision encoder instead of its token embedding table. A multimodal processor prepares that on the API
side; the model family's :meth:`weft.contracts.model.ModelFamily.encode` computes the embeddings in
the workers; core merges them and caches them (docs/multimodal.md). Selection: ``use.mm_processor =
"auto"`` takes the processor whose :attr:`MMProcessor.architectures` lists the checkpoint's architecture
(none: image parts are refused with a 400 that says the model reads no images).

What a processor gets (:meth:`MMProcessor.process`):

* ``prompt_token_ids``: the prompt, rendered and tokenized. Each image part of the messages became
  exactly one placeholder token, :attr:`MMProcessor.placeholder_token_id` (the tokenizer's
  ``normalize_messages`` writes its text), in the order of the parts. The processor works on ids, not
  on rendered text, so that a token-id prompt (``/v1/completions``) and a chat take the same path, and
  no text search can mistake a user's literal ``<image>`` for an image.
* ``items``: the decoded images, one :class:`ImageItem` per placeholder, in order.
  :mod:`weft.serve.media` decodes them from the request's ``image_url`` / ``input_image`` parts and
  checks the limits (bytes, pixels, items per prompt) before any processor sees them.

What it returns, a :class:`ProcessedPrompt`:

* ``token_ids``: the expanded prompt: each placeholder replaced by the item's run of tokens.
* per item (:class:`ProcessedItem`): its placeholder range(s) in the expanded prompt (the positions
  whose embeddings the encoder gives), a content hash (:func:`item_hash`), and the encoder's inputs
  (pixel values, grid sizes) as :class:`TensorData`.
* per-position extras, each a :class:`TensorData` whose last axis is the expanded prompt's length
  (DeepSeek V4.1's ``token_types``: the role of each position of an image span), and ``positions`` where
  they are not simply ``0..n-1`` (multi-axis rotary positions; None otherwise).

Invariants (the kit's :class:`weft.testing.MMProcessorContract` checks them):

* The expansion of an item depends on the item alone, never on where it sits in the prompt: the same
  image at any offset gives the same replacement ids, the same slice of every extra (positions: the
  same values less the span's first position) and the same hash. This is what lets a processor cache
  its prompt update per item hash, the engine cache encoder outputs per item hash, and the prefix
  cache share blocks across prompts holding the same image. (DeepSeek V4.1 once lost this to an
  alignment padding tied to the image's position; see weft-dsv4.)
* Equal images give equal hashes; different pixels, sizes, or processor options that change the
  encoder's inputs give different ones (:func:`item_hash` takes the options as its ``salt``).
* The ranges lie in the expanded prompt, in item order, without overlap; every position outside them
  keeps the prompt's own token, in order.
* A prompt whose placeholder count differs from the item count is a ValueError naming both numbers.

Where it runs: in the API server's process, which imports no torch. This module imports neither
torch nor numpy at module level; a processor computes its encoder inputs with numpy (or Pillow) and
hands them over as :class:`TensorData`. The server calls :meth:`MMProcessor.process` off the event loop
(``asyncio.to_thread``), so several calls may run at once in different threads: a processor's caches
must be safe for that (a lock around an LRU is enough).

How tensors cross to the engine core: every Struct here is msgspec-encodable (msgpack on the wire
between the API process and the engine core). :class:`TensorData` is a dtype name, a shape and the
raw bytes in C order (msgpack ``bin``: no per-element encoding). The engine turns it into a tensor with
:meth:`TensorData.to_torch`; an API-side processor builds it with :meth:`TensorData.from_array`.

The engine side (core: :mod:`weft.engine.core.encoder_cache`, :mod:`weft.runner.encoder`): the
encoder runs once per item hash. Its outputs (one row per position of the item's ranges) stay in an
encoder cache keyed by item hash, with its own budget in the scheduler as vLLM's (in embedding rows),
so a repeated image is not encoded again; a step whose prefill chunk covers part of an item's range
takes those rows of the cached output, so an image span may cross a chunk boundary. Prefix-cache
block hashes include the hashes of the items whose ranges overlap the block, so two different images
behind the same placeholder ids never share blocks.
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from weft.contracts.plugin import PluginBase

if TYPE_CHECKING:
    import numpy
    import torch


class TensorData(msgspec.Struct, frozen=True):
    """A tensor as msgspec-encodable data: what crosses from the API process to the engine core."""

    dtype: str
    """numpy's name of the element type (``"uint8"``, ``"int64"``, ``"float32"``); bfloat16 has none: send float32."""
    shape: tuple[int, ...]
    data: bytes
    """The elements in C order, native little-endian."""

    @classmethod
    def from_array(cls, array: Any) -> TensorData:
        """From a numpy array (or anything ``numpy.asarray`` takes)."""
        import numpy

        array = numpy.ascontiguousarray(array)
        return cls(array.dtype.name, tuple(int(size) for size in array.shape), array.tobytes())

    def to_numpy(self) -> numpy.ndarray:
        import numpy

        return numpy.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)

    def to_torch(self) -> torch.Tensor:
        """A CPU tensor owning a copy of the data (the engine moves it to the device)."""
        import torch

        return torch.from_numpy(self.to_numpy().copy())


class ImageItem(msgspec.Struct, frozen=True):
    """A decoded image: RGB, 8 bits per channel, rows top to bottom (:mod:`weft.serve.media` makes these)."""

    width: int
    height: int
    pixels: bytes
    """``height * width * 3`` bytes: R, G, B of each pixel, row-major."""

    def __post_init__(self) -> None:
        if self.width <= 0 or self.height <= 0 or len(self.pixels) != self.width * self.height * 3:
            raise ValueError(
                f"ImageItem: {self.width}x{self.height} RGB needs {max(self.width * self.height * 3, 0)} "
                f"bytes of pixels, got {len(self.pixels)}"
            )

    def to_array(self) -> numpy.ndarray:
        """``[height, width, 3]`` uint8."""
        import numpy

        return numpy.frombuffer(self.pixels, dtype=numpy.uint8).reshape(self.height, self.width, 3)

    @classmethod
    def from_array(cls, array: Any) -> ImageItem:
        """From ``[height, width, 3]`` uint8 values."""
        import numpy

        array = numpy.ascontiguousarray(array, dtype=numpy.uint8)
        if array.ndim != 3 or array.shape[2] != 3:
            raise ValueError(f"ImageItem.from_array: expected [height, width, 3], got shape {tuple(array.shape)}")
        return cls(int(array.shape[1]), int(array.shape[0]), array.tobytes())


def item_hash(item: ImageItem, salt: bytes = b"") -> str:
    """The content hash of an item (hex sha256): its size and pixels, and ``salt``.

    ``salt`` carries what else decides the encoder's inputs for this item: the processor's name and the
    options that change its resizing or normalisation (``msgspec.json.encode(options)``), so that two
    configurations never share an encoder-cache entry or prefix-cache blocks.
    """
    digest = hashlib.sha256()
    digest.update(b"image/rgb8:%d:%d:" % (item.width, item.height))
    digest.update(item.pixels)
    digest.update(b":salt:")
    digest.update(salt)
    return digest.hexdigest()


class PlaceholderRange(msgspec.Struct, frozen=True):
    """A run of positions of the expanded prompt whose embeddings come from an item's encoder output."""

    offset: int
    """Index of the run's first position in :attr:`ProcessedPrompt.token_ids`."""
    length: int


class ProcessedItem(msgspec.Struct, frozen=True):
    """One item of a processed prompt."""

    hash: str
    """:func:`item_hash` of the item: the key of the engine's encoder cache and part of prefix-cache block hashes."""
    ranges: tuple[PlaceholderRange, ...]
    """Where its encoder output goes, in order: ``encode`` returns one row per position of these ranges."""
    encoder_inputs: dict[str, TensorData]
    """What :meth:`weft.contracts.model.ModelFamily.encode` takes for it (``pixel_values``, ``grid``...)."""
    modality: str = "image"

    @property
    def num_embeddings(self) -> int:
        """Rows of encoder output the item needs: the positions of its ranges."""
        return sum(placeholder.length for placeholder in self.ranges)


class ProcessedPrompt(msgspec.Struct, frozen=True):
    """What :meth:`MMProcessor.process` returns (module docstring)."""

    token_ids: list[int]
    items: list[ProcessedItem]
    extras: dict[str, TensorData] = {}
    """Per-position values the model reads besides the ids, last axis ``len(token_ids)`` (``token_types``)."""
    positions: TensorData | None = None
    """int64 ``[len(token_ids)]`` or ``[axes, len(token_ids)]`` where positions are not ``0..n-1``; None: they are."""

    def multimodal(self) -> MultimodalInputs | None:
        """What the engine needs of this prompt besides its ids (None: it carries no item, extra or positions)."""
        if not self.items and not self.extras and self.positions is None:
            return None
        return MultimodalInputs(self.items, self.extras, self.positions)


class MultimodalInputs(msgspec.Struct, frozen=True, array_like=True):
    """A processed prompt's items, extras and positions: what travels with its token ids from the API process to the
    engine core (``EngineCoreRequest.multimodal``) and on to the workers (``NewRequest.multimodal``).

    The item ranges, extras and positions index the prompt's token ids (:attr:`ProcessedPrompt.token_ids`)."""

    items: list[ProcessedItem]
    extras: dict[str, TensorData] = {}
    positions: TensorData | None = None

    def spans(self) -> list[tuple[int, int, int, int]]:
        """``(start, end, item index, first row)`` of every placeholder range, in prompt order: positions
        ``start..end-1`` take rows ``first row..`` of the item's encoder output."""
        found = []
        for index, item in enumerate(self.items):
            row = 0
            for placeholder in item.ranges:
                found.append((placeholder.offset, placeholder.offset + placeholder.length, index, row))
                row += placeholder.length
        return sorted(found)


class PromptUpdate(msgspec.Struct, frozen=True):
    """One item's replacement for its placeholder: what a processor caches per item hash.

    It holds nothing about where the item sits, so one cached update serves the item at any offset.
    """

    hash: str
    token_ids: tuple[int, ...]
    encoder_inputs: dict[str, TensorData]
    extras: dict[str, tuple[int, ...]] = {}
    """Per replacement position, the value of each 1-D integer extra (``token_types``)."""


def apply_prompt_updates(
    prompt_token_ids: Sequence[int],
    placeholder_token_id: int,
    updates: Sequence[PromptUpdate],
    text_extras: dict[str, int] | None = None,
    extras_dtype: str = "int64",
) -> ProcessedPrompt:
    """Replace each placeholder of the prompt by its item's update, in order, and place the ranges and extras: each
    item's range is its whole replacement.

    ``text_extras`` gives each extra's value at positions that are not an item's (text); every extra of an update
    must be named there. Raises ValueError when the placeholders and the updates differ in number.
    """
    text_extras = dict(text_extras or {})
    found = sum(1 for token in prompt_token_ids if token == placeholder_token_id)
    if found != len(updates):
        raise ValueError(
            f"the prompt holds {found} image placeholder(s) (token {placeholder_token_id}) but "
            f"{len(updates)} image(s) came with it; each image part must become exactly one placeholder"
        )
    token_ids: list[int] = []
    extras: dict[str, list[int]] = {name: [] for name in text_extras}
    items = []
    updates_left = iter(updates)
    for token in prompt_token_ids:
        if token != placeholder_token_id:
            token_ids.append(token)
            for name, value in text_extras.items():
                extras[name].append(value)
            continue
        update = next(updates_left)
        unknown = set(update.extras) - set(text_extras)
        if unknown:
            raise ValueError(
                f"prompt update of item {update.hash[:12]} carries extras {sorted(unknown)} that "
                f"text_extras does not name"
            )
        items.append(
            ProcessedItem(
                update.hash, (PlaceholderRange(len(token_ids), len(update.token_ids)),), update.encoder_inputs
            )
        )
        token_ids.extend(update.token_ids)
        for name, value in text_extras.items():
            extras[name].extend(update.extras.get(name, (value,) * len(update.token_ids)))
    tensors = {name: _int_tensor(values, extras_dtype) for name, values in extras.items()}
    return ProcessedPrompt(token_ids, items, tensors)


def _int_tensor(values: list[int], dtype: str) -> TensorData:
    import numpy

    return TensorData.from_array(numpy.asarray(values, dtype=dtype))


class MMProcessorConfig(msgspec.Struct, frozen=True):
    """What the engine tells a processor when it builds it."""

    architecture: str
    hf_config: dict[str, Any]
    """The checkpoint's ``config.json``: a processor reads its vision settings here and refuses (ValueError) a
    checkpoint that declares no vision encoder, saying so."""
    model_path: str = ""
    """The checkpoint's folder, for a processor that reads ``preprocessor_config.json``."""


class MMProcessor(PluginBase):
    """Turns a prompt's images into its expansion, encoder inputs and item hashes (module docstring).

    Built as ``Processor(options, config)`` with an :class:`MMProcessorConfig`, once per server, in the API
    process. A subclass implements :meth:`process` and sets :attr:`placeholder_token_id`.
    """

    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]] = ()
    """The checkpoint architectures this processor serves under ``use.mm_processor = "auto"``."""

    placeholder_token_id: int
    """The token each image part of a prompt becomes before :meth:`process` expands it."""

    def __init__(self, options: msgspec.Struct | None, config: MMProcessorConfig) -> None:
        self.options = options if options is not None else self.Options()
        self.config = config

    @abstractmethod
    def process(self, prompt_token_ids: Sequence[int], items: Sequence[ImageItem]) -> ProcessedPrompt:
        """The expanded prompt for ``items``, one per placeholder in order; thread-safe (module docstring)."""
