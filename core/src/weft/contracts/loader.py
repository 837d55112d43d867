"""The loader slot: turn a model source into a config and a stream of weights.

``use.loader = "auto"`` asks each enabled loader whether it
:meth:`~WeightLoader.accepts` the ``model`` string, in descending
:attr:`~WeightLoader.priority`, and takes the first that does. A source is
whatever the user wrote in ``model``: an alias a plugin defines, a local folder,
a file, or a Hugging Face repo id present in the local cache. A loader never
downloads implicitly and never opens a path it was not given.

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


class WeightLoader(PluginBase):
    """Resolves model sources and streams their tensors."""

    priority: ClassVar[int] = 0
    """Order of the ``accepts`` poll under ``use.loader = "auto"`` (higher first)."""

    def __init__(self, options: msgspec.Struct | None = None) -> None:
        self.options = options if options is not None else self.Options()

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
        (added in core API 1.2)."""
        for name, tensor in self.iter_weights(source, dtype):
            yield name, LoadedSlice(tensor)
