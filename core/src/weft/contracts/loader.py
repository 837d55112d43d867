"""The loader slot: turn a model source into a config and a stream of weights.

``use.loader = "auto"`` asks each enabled loader whether it
:meth:`~WeightLoader.accepts` the ``model`` string, in descending
:attr:`~WeightLoader.priority`, and takes the first that does. A source is
whatever the user wrote in ``model``: an alias a plugin defines, a local folder,
a file, or a Hugging Face repo id (``org/name``, ``org/name@revision``).
``accepts`` never touches the network; ``resolve`` may download a repo id's
missing files through :mod:`weft.hub` (Hugging Face's cache, its file lock and
``HF_HUB_OFFLINE``), and never opens a path it was not given.

Each loader instance carries the :class:`LoadConfig` of the worker that built it
(:attr:`WeightLoader.load_config`): where downloads go, which revision, the
worker's device and its place among the parallel ranks. A loader that hands the
work to another (a cache falling back to disk, a draft model on one pipeline
stage) builds that one with a copy of it (``msgspec.structs.replace``), never
with a config assembled field by field.

Under tensor parallelism each rank needs only its part of most tensors. A loader
that can read part of a stored tensor overrides :meth:`WeightLoader.iter_weight_slices`
to yield :class:`WeightSlice` handles (safetensors' ``get_slice``; a GGUF file's rows);
the model family narrows each to its rank's part, and only that part is read. The
default wraps :meth:`~WeightLoader.iter_weights`, so every loader serves every family.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from weft.contracts.plugin import PluginBase

if TYPE_CHECKING:
    import torch


class ModelSource(msgspec.Struct, frozen=True):
    """A resolved model: where it is, what it is, and how to tokenize it."""

    path: str
    """Absolute path of the folder or file holding the weights."""
    format: str
    """Weight format (``"safetensors"``, ``"gguf"``)."""
    hf_config: dict[str, Any]
    """The model's ``config.json`` contents (synthesised for formats without one)."""
    tokenizer: str
    """The tokenizer plugin that reads this source when ``use.tokenizer = "auto"``."""
    name: str
    """The name served as the model id."""
    generation_config: dict[str, Any] = {}
    """The model's ``generation_config.json`` contents, under Hugging Face's key names (``temperature``,
    ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_new_tokens``...). Formats without
    one give what they carry instead (a GGUF file's ``general.sampling.*`` metadata), or what the plugin
    declares for the model; empty when the model states nothing. Under ``engine.generation_config =
    "auto"`` its sampling keys are the defaults of requests that leave them unset (:mod:`weft.generation_config`)."""


class WeightSlice:
    """A stored tensor not yet read: its shape, and reads of the whole or of one range along one axis.

    Valid until the iterator that yielded it moves on. Floating-point results are in the dtype
    the iterator was asked for; integer tensors come as stored.
    """

    shape: tuple[int, ...]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Elements ``start .. start + length - 1`` along ``dim`` (only those are read where the format allows)."""
        raise NotImplementedError

    def load(self) -> torch.Tensor:
        """The whole tensor."""
        raise NotImplementedError


class LoadedSlice(WeightSlice):
    """A tensor already in memory, behind the :class:`WeightSlice` interface."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, length)

    def load(self) -> torch.Tensor:
        return self.tensor


def as_slice(weight: Any) -> WeightSlice:
    """``weight`` as a :class:`WeightSlice` (a whole tensor is wrapped)."""
    return weight if isinstance(weight, WeightSlice) else LoadedSlice(weight)


class LoadConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How one worker loads one model: the loader, where downloads go, and where the worker sits.

    Added in core API 1.2. Built by :func:`weft.resolve.load_config_for` from ``weft.toml`` and the
    worker's place; ranks follow torch.distributed's layout, tensor-parallel ranks innermost.
    """

    loader: str = "auto"
    """The loader's name (``use.loader``), or ``"auto"``."""
    revision: str | None = None
    """The Hugging Face revision (branch, tag or 40-hex commit) of a repo id (``engine.revision``)."""
    download_dir: str | None = None
    """The Hugging Face cache a repo id downloads into (``engine.download_dir``); default ``HF_HUB_CACHE``."""
    device: str = "cpu"
    """The worker's device (``"cpu"``, ``"cuda:0"``): a loader may place tensors there directly."""
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    pipeline_parallel_size: int = 1
    pipeline_parallel_rank: int = 0
    data_parallel_rank: int = 0
    local_rank: int = 0
    """The worker's device index on its node."""
    pipeline_partition: tuple[int, ...] | None = None
    """Layers of each pipeline stage (``engine.pipeline_partition``; None: an even split). Added in core API 1.8."""
    enable_expert_parallel: bool = False
    """Whether routed experts are spread over the tensor ranks (``engine.enable_expert_parallel``), which
    decides which experts' tensors a rank reads. Added in core API 1.8."""
    quantization: str = "none"
    """The quantization method the model's linear layers use (``engine.quantization`` resolved; "none": dense).
    Under a method, a loader of a block-quantized format yields
    :class:`~weft.contracts.quantization.QuantizedWeight` for the tensors it can decompose, else floats."""

    @property
    def global_rank(self) -> int:
        """The worker's rank in the whole job: ``dp_rank * tp + tp_rank`` without pipeline parallelism,
        ``(dp_rank * pp + pp_rank) * tp + tp_rank`` with it."""
        stage = self.data_parallel_rank * self.pipeline_parallel_size + self.pipeline_parallel_rank
        return stage * self.tensor_parallel_size + self.tensor_parallel_rank


class WeightLoader(PluginBase):
    """Resolves model sources and streams their tensors."""

    priority: ClassVar[int] = 0
    """Order of the ``accepts`` poll under ``use.loader = "auto"`` (higher first)."""

    single_stage_fallback: ClassVar[str | None] = None
    """For a loader whose loading is collective over the whole world group (every rank must load the
    same model at the same time): the loader that reads alone, used instead for a model only some
    ranks hold, such as a draft model on one pipeline stage (:func:`weft.resolve.draft_load_config`).
    None: this loader reads alone. Added in core API 1.2."""

    load_config: LoadConfig = LoadConfig()
    """The worker's load configuration (set by :meth:`for_load`; the default for a loader built bare)."""

    def __init__(self, options: msgspec.Struct | None = None) -> None:
        self.options = options if options is not None else self.Options()

    @classmethod
    def for_load(cls, options: msgspec.Struct | None, load_config: LoadConfig) -> WeightLoader:
        """The loader with ``options``, carrying ``load_config`` (how core builds loaders)."""
        loader = cls(options)
        loader.load_config = load_config
        return loader

    @abstractmethod
    def accepts(self, source: str) -> bool:
        """Whether this loader reads ``source``; cheap, no weights read, never raises."""

    @abstractmethod
    def resolve(self, source: str) -> ModelSource:
        """Resolve ``source``; raise ValueError saying what was looked for and how to fix it."""

    @abstractmethod
    def iter_weights(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_tensor_name, tensor)`` pairs, each tensor once: floating-point tensors in ``dtype``,
        integer tensors (index tables) as stored."""

    def iter_weight_slices(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, WeightSlice]]:
        """As :meth:`iter_weights`, each tensor as a :class:`WeightSlice` that reads only the part asked for.

        The default reads every tensor whole; loaders whose format allows partial reads override it
        (added in core API 1.4)."""
        for name, tensor in self.iter_weights(source, dtype):
            yield name, LoadedSlice(tensor)
