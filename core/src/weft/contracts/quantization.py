"""The quantization slot: how a linear layer's weights are stored, loaded and multiplied.

A model family never changes for a quantization method: it builds its linear layers
(:class:`weft.layers.linear.Linear` and the tensor-parallel layers on it) and those ask the
engine's method, as vLLM's ``LinearMethod`` does. ``engine.quantization`` chooses it:
``"none"`` (dense weights in ``engine.dtype``, quantized checkpoints dequantized at load),
a method's entry-point name, or ``"auto"``: the highest-:attr:`~QuantizationMethod.priority`
method that :meth:`~QuantizationMethod.selects_by_default` the platform and the model's
source format (the CPU's ``cpu_int4`` for a GGUF file), else ``"none"``.

Call order, once per linear layer (``layer`` is the ``torch.nn.Module``):

1. :meth:`QuantizationMethod.create_weights` when the family builds the layer (inside
   :func:`weft.layers.quantization.using_quantization`): the method may register the
   buffers it will fill; the layer keeps an empty ``weight`` parameter, so parameter names
   and the family's completeness check stay as they are.
2. :meth:`QuantizationMethod.load_weight` for each part of each checkpoint tensor the layer
   takes (its rows of a stacked q/k/v, its columns under row parallelism): a
   :class:`QuantizedWeight` when the loader kept the checkpoint's blocks, else a float tensor.
3. :meth:`QuantizationMethod.process_weights_after_loading` once every part is in: pack the
   weights into the kernel's layout and free what the packing no longer needs.
4. :meth:`QuantizationMethod.apply` in each forward: ``x W^T (+ bias)``.

A loader keeps a checkpoint's quantized blocks only when :attr:`LoadConfig.quantization
<weft.contracts.loader.LoadConfig.quantization>` names a method: it then yields a
:class:`QuantizedWeight` for every tensor stored in a block format it can decompose
(:meth:`QuantizedWeight.group_affine`), whose ``load``/``narrow`` still give dequantized
floats for the layers that do not quantize (norms, embeddings).

The representation every loader and method share is :class:`GroupAffine`: integer codes,
and one scale and offset per group of consecutive input features, ``w = code * scale +
offset``. GGUF's Q4_0, Q4_1, Q4_K (sub-blocks of 32) and Q8_0 decompose into it exactly; a
method says in :meth:`QuantizationMethod.describe` which format it turns each into, and the
error that conversion implies, which ``weft`` prints at start and ``weft config show`` names.

An fp8 checkpoint (compressed-tensors' float-quantized, FBGEMM's ``fbgemm_fp8``) decomposes
into it too: float8_e4m3fn codes and one scale per output channel (one group spanning the row),
or one per tensor repeated on every row. A method for another device (weft-cuda's ``fp8`` on
Hopper: per-output-channel weight scales, dynamic per-token activation scales,
``torch._scaled_mm``) is another class of this contract: ``create_weights`` registers the fp8
weight and its scales, ``load_weight`` quantizes float parts (or takes fp8 checkpoints'),
``apply`` quantizes the activations and calls the kernel. A method refuses a platform it cannot
run on at start, with :meth:`QuantizationMethod.unavailable_reason` in the error.

The conformance kit (:class:`weft.testing.suites.QuantizationMethodSuite`) checks each
method's ``apply`` against ``x @ dequantize(weights)^T`` within :attr:`QuantizationMethod.tolerance`.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from weft.contracts.loader import WeightSlice
from weft.contracts.plugin import PluginBase

if TYPE_CHECKING:
    import torch

    from weft.contracts.platform import Platform


@dataclass(frozen=True)
class GroupAffine:
    """Weights ``[out_features, in_features]`` as ``codes * scales + offsets``, per group of input features.

    ``codes`` is an integer tensor ``[out, in]`` (uint8 for unsigned codes, int8 for signed), or float8_e4m3fn
    codes of an fp8 checkpoint (:attr:`float_codes`; ``bits`` 8, signed, no offsets);
    ``scales`` and ``offsets`` are float32 ``[out, in / group_size]``; ``offsets`` is None where
    it is zero everywhere (GGUF's Q8_0). ``bits`` is the codes' width: unsigned codes lie in
    ``0 .. 2**bits - 1``, signed ones in ``-2**(bits-1) .. 2**(bits-1) - 1``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    bits: int
    signed: bool
    source_format: str
    """The checkpoint's name for the format (``"Q4_1"``), for logs and ``weft config show``."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def float_codes(self) -> bool:
        """Whether the codes are floats (float8_e4m3fn) rather than integers."""
        return self.codes.is_floating_point()

    def dequantize(self) -> torch.Tensor:
        """The float32 weights these codes stand for (the reference every method is checked against)."""
        import torch

        expand = lambda groups: torch.repeat_interleave(groups, self.group_size, dim=1)  # noqa: E731
        weights = self.codes.to(torch.float32) * expand(self.scales)
        return weights if self.offsets is None else weights + expand(self.offsets)

    def narrow(self, dim: int, start: int, length: int) -> GroupAffine:
        """Rows (``dim`` 0) or input features (``dim`` 1, on group boundaries) ``start .. start + length - 1``."""
        if dim == 1 and self.scales.shape[1] == 1:
            # One group per row (per-channel scales): any columns keep the row's scale and offset.
            return GroupAffine(
                self.codes.narrow(1, start, length),
                self.scales,
                self.offsets,
                length,
                self.bits,
                self.signed,
                self.source_format,
            )
        if dim == 1 and (start % self.group_size or length % self.group_size):
            raise ValueError(
                f"a {self.source_format} tensor splits along its input features only on its groups of "
                f"{self.group_size}; columns {start}..{start + length - 1} cut one (choose a tensor_parallel_size "
                f"that divides the input features into whole groups, or engine.quantization = 'none')"
            )
        first, count = (start, length) if dim == 0 else (start // self.group_size, length // self.group_size)
        return GroupAffine(
            self.codes.narrow(dim, start, length),
            self.scales.narrow(dim, first, count),
            None if self.offsets is None else self.offsets.narrow(dim, first, count),
            self.group_size,
            self.bits,
            self.signed,
            self.source_format,
        )

    @staticmethod
    def concatenate(parts: list[GroupAffine]) -> GroupAffine:
        """Row blocks stacked in order (a q/k/v or gate/up matrix from its checkpoint tensors)."""
        import torch

        first = parts[0]
        if any(
            (part.group_size, part.bits, part.signed, part.codes.dtype)
            != (first.group_size, first.bits, first.signed, first.codes.dtype)
            for part in parts
        ):
            formats = sorted({part.source_format for part in parts})
            raise ValueError(f"one stacked weight mixes block formats {formats}; engine.quantization = 'none' loads it")
        offsets = None
        if any(part.offsets is not None for part in parts):
            offsets = torch.cat(
                [part.offsets if part.offsets is not None else torch.zeros_like(part.scales) for part in parts]
            )
        formats = "+".join(dict.fromkeys(part.source_format for part in parts))
        return GroupAffine(
            torch.cat([part.codes for part in parts]),
            torch.cat([part.scales for part in parts]),
            offsets,
            first.group_size,
            first.bits,
            first.signed,
            formats,
        )


class QuantizedWeight(WeightSlice):
    """A checkpoint tensor stored in a block-quantized format, as a loader yields it.

    ``load`` and ``narrow`` give dequantized floats (in the dtype the loader was asked for),
    so a layer that does not quantize reads it like any tensor; a quantization method reads
    :meth:`group_affine` instead and never sees floats.
    """

    format: str
    """The stored format's name (GGUF's ``"Q4_1"``, ``"Q8_0"``...)."""

    @abstractmethod
    def group_affine(self) -> GroupAffine:
        """The whole tensor as codes, scales and offsets, exactly (no rounding)."""


class QuantizationMethod(PluginBase):
    """How linear layers store and multiply their weights. Instantiated once per engine: ``Method(platform, dtype)``,
    ``dtype`` the activations' (``engine.dtype``)."""

    device_types: ClassVar[frozenset[str]] = frozenset()
    """The platforms' ``device_type`` values whose kernels this method calls (``{"cpu"}``)."""
    auto_formats: ClassVar[frozenset[str]] = frozenset()
    """Source formats (:attr:`ModelSource.format <weft.contracts.loader.ModelSource.format>`) for which
    ``engine.quantization = "auto"`` picks this method on one of its device types."""
    priority: ClassVar[int] = 0
    """Order among the methods ``auto`` could pick (higher first)."""
    tolerance: ClassVar[tuple[float, float]] = (1e-2, 1e-2)
    """``(rtol, atol)`` of ``apply`` against ``x @ dequantized^T``, relative to the output's magnitude, used by
    the conformance kit; a method whose kernel rounds the activations or the scales says so here."""

    conversions: ClassVar[dict[str, str]] = {}
    """What each source format becomes and the error that implies (``{"Q4_1": "int4 g32, bf16 scales: ..."}``),
    printed by ``weft config show``; per layer, :meth:`describe` says it after loading."""

    def __init__(self, platform: Platform, dtype: str) -> None:
        self.platform = platform
        self.dtype = dtype

    @classmethod
    def is_available(cls, platform: Platform) -> bool:
        """Whether the kernels exist here (the torch build has them, the device is capable)."""
        return platform.device_type in cls.device_types

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str:
        """Why :meth:`is_available` is false on ``platform``, for the error that refuses the method there: what the
        method needs and what the platform is (``"needs a CUDA GPU with compute capability >= 8.9; this platform
        is cpu"``). Added in core API 1.15."""
        return f"has no kernels on platform {platform.name!r} (it runs on {', '.join(sorted(cls.device_types))})"

    @classmethod
    def selects_by_default(cls, platform: Platform, source_format: str) -> bool:
        """Whether ``engine.quantization = "auto"`` picks this method for a model of ``source_format`` on
        ``platform``."""
        return source_format in cls.auto_formats and cls.is_available(platform)

    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int) -> None:
        """Called when ``layer`` is built; ``layer.weight`` is already an empty parameter. The default adds nothing."""

    @abstractmethod
    def load_weight(self, layer: torch.nn.Module, weight: GroupAffine | torch.Tensor, row: int, name: str) -> None:
        """Take ``weight`` (this layer's part of checkpoint tensor ``name``: codes when the loader kept the blocks,
        else float rows) as the layer's rows ``row .. row + weight.shape[0] - 1``. Raise ValueError naming the
        tensor and the format when the method cannot take it."""

    @abstractmethod
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Every part is in: build the kernel's layout. Raise ValueError if rows are missing."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W^T + bias`` for ``x`` ``[tokens, in_features]`` in the activations' dtype; the result in that
        dtype."""

    @abstractmethod
    def describe(self, layer: torch.nn.Module) -> str:
        """The layer's effective format after processing, and what the conversion rounds (``"int4 g32 bf16 scales
        (from Q4_1; scales and offsets rounded to bf16: |error| <= 2^-9 of each)"``)."""
