"""``cpu_int4``: linear layers on torch's packed int4 CPU kernel, weights never dequantized to floats.

The kernel (``torch.ops.aten._weight_int4pack_mm_for_cpu``, weights packed by
``_convert_weight_to_int4pack_for_cpu``) computes ``x @ W^T`` with
``W = (code - 8) * scale + zero`` for 4-bit codes ``0..15`` and one ``(scale, zero)`` pair per
group of 32/64/128/256 input features and output feature, scales and zeros in the activations'
dtype. Only bf16 activations have a fast path in torch 2.9-2.13 (fp32 is 10-30x slower there,
measured on AVX-512), so the method multiplies in bf16 (fp32 accumulation) and returns the
activations' dtype. Float activations go in as two bf16 rows each, ``hi + lo`` (16 mantissa bits): the
kernel's rounding of its inputs to bf16 is gone, its outputs' (2^-9 relative) stays. On a CPU without
native bf16 (:mod:`weft.runner.cpu_isa`), GEMMs of more than :data:`DECODE_ROWS` rows dequantize the layer
to float32 and multiply there instead.

What each checkpoint format becomes (:meth:`CpuInt4.describe` says it per layer):

* 4-bit group-affine codes (GGUF Q4_0, Q4_1, Q4_K): the codes as they are, ``zero = offset + 8 scale``;
  the only rounding is of scale and zero to bf16 (relative 2^-9 each, under a tenth of a 4-bit step).
* 8-bit signed codes (GGUF Q8_0): no 8-bit group kernel exists, so each code is split exactly as
  ``16 hi + lo`` (``hi`` in -8..7, ``lo`` in 0..15) into two int4 matrices, multiplied and summed:
  the same bf16 rounding of scales, twice the 4-bit kernel's bytes (as many as Q8_0's).
* float weights (a float checkpoint, a format the loader does not decompose): quantized round-to-nearest
  to 4 bits per group of 32 with min/max, an error of up to half a step (``(max - min) / 30``) per weight.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from weft.contracts.quantization import GroupAffine, QuantizationMethod
from weft.runner.cpu_isa import detect, gemm_dtype

GROUP = 32
COMPUTE_DTYPE = torch.bfloat16
# Up to this many rows (decode of a few sequences) the kernel streams each weight once for all of them: memory-bound,
# its bf16 multiplies cost nothing there. More rows are a GEMM, multiplied in the CPU's GEMM dtype (cpu_isa).
DECODE_ROWS = 8


def round_to_int4(weight: torch.Tensor, group_size: int = GROUP) -> GroupAffine:
    """Float weights ``[out, in]`` as 4-bit codes, min/max per group, rounded to nearest."""
    rows, columns = weight.shape
    groups = weight.float().reshape(rows, columns // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((groups - low.unsqueeze(-1)) / scales.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return GroupAffine(
        codes.reshape(rows, columns), scales, low, group_size, 4, False, str(weight.dtype).removeprefix("torch.")
    )


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[out, in]`` in 0..15 and per-group scales and zeros ``[out, groups]`` in the kernel's layout."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(COMPUTE_DTYPE).contiguous()
    return packed, scales_and_zeros


class CpuInt4(QuantizationMethod):
    """Linear layers on torch's packed int4 CPU kernel: GGUF Q4_0/Q4_1/Q4_K/Q8_0 kept quantized."""

    device_types: ClassVar[frozenset[str]] = frozenset({"cpu"})
    auto_formats: ClassVar[frozenset[str]] = frozenset({"gguf"})
    # bf16 activations and bf16-rounded scales against a float32 reference: a few parts in a thousand.
    tolerance: ClassVar[tuple[float, float]] = (2e-2, 2e-2)
    conversions: ClassVar[dict[str, str]] = {
        "Q4_0, Q4_1, Q4_K": "int4 g32 (codes kept; scale and zero rounded to bf16, |error| <= 2^-9 of each)",
        "Q8_0": "two int4 g32 halves, 16 hi + lo, summed (exact codes; scales rounded to bf16)",
        "float and other GGUF formats": "int4 g32 rounded to nearest (|error| <= half a step, (max - min) / 30)",
        "activations": "multiplied in bf16 with float32 accumulation (torch's fast path)",
    }

    @classmethod
    def is_available(cls, platform) -> bool:
        return super().is_available(platform) and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        if in_features % GROUP:
            raise ValueError(
                f"quantization 'cpu_int4' needs input features in groups of {GROUP}; a layer has "
                f"{in_features}; set engine.quantization = 'none'"
            )
        layer.quantized_parts = []

    def load_weight(self, layer: nn.Module, weight: GroupAffine | torch.Tensor, row: int, name: str) -> None:
        if isinstance(weight, torch.Tensor) or weight.float_codes:  # floats, or an fp8 checkpoint's codes
            weight = round_to_int4(weight if isinstance(weight, torch.Tensor) else weight.dequantize())
        elif weight.group_size % GROUP or weight.bits not in (4, 8) or (weight.bits == 4) == weight.signed:
            raise ValueError(
                f"checkpoint tensor {name!r} is {weight.source_format} ({weight.bits}-bit codes in groups "
                f"of {weight.group_size}), which 'cpu_int4' cannot take; set engine.quantization = 'none'"
            )
        layer.quantized_parts.append((row, weight))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = sorted(layer.__dict__.pop("quantized_parts"), key=lambda part: part[0])
        if not parts:
            raise ValueError(f"a {type(layer).__name__} of {layer.out_features} rows got no weights to quantize")
        weight = GroupAffine.concatenate([part for _, part in parts])
        if weight.shape != (layer.out_features, layer.in_features):
            raise ValueError(
                f"quantized weights of shape {weight.shape} for a layer of {(layer.out_features, layer.in_features)}"
            )
        if weight.group_size != GROUP:
            weight = regroup(weight)
        offsets = weight.offsets if weight.offsets is not None else torch.zeros_like(weight.scales)
        if weight.bits == 4:
            layer.int4_packs = [pack_int4(weight.codes, weight.scales, offsets + 8 * weight.scales)]
        else:
            codes = weight.codes.to(torch.int16)
            high, low = codes >> 4, codes & 15  # code == 16 * high + low, exactly
            layer.int4_packs = [
                pack_int4(high + 8, 16 * weight.scales, offsets),
                pack_int4(low, weight.scales, 8 * weight.scales),
            ]
        layer.gemm_dtype = gemm_dtype(detect())
        if layer.gemm_dtype == "float32":
            # No native bf16: GEMMs of more than DECODE_ROWS rows dequantize the codes (kept as bytes) to float32.
            layer.group_affine = weight
        layer.effective_format = (
            f"int4 g{GROUP} bf16 scales from {weight.source_format}"
            + (" (as two int4 halves)" if weight.bits == 8 else "")
            + ("" if weight.source_format.startswith("Q") else " (rounded to 4 bits per group)")
            + (f", GEMMs of over {DECODE_ROWS} rows dequantized to float32" if layer.gemm_dtype == "float32" else "")
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        if rows > DECODE_ROWS and layer.gemm_dtype == "float32":
            out = torch.nn.functional.linear(flat.float(), layer.group_affine.dequantize())
            out = out.to(x.dtype).reshape(*x.shape[:-1], -1)
            return out if bias is None else out + bias
        if flat.dtype != COMPUTE_DTYPE:
            # The activations as two bf16 rows each, hi + lo (16 mantissa bits between them): rounding them to bf16
            # alone cost 0.6% of teacher-forced top-1 against transformers (docs/quantization.md).
            high = flat.to(COMPUTE_DTYPE)
            flat = torch.cat([high, (flat - high).to(COMPUTE_DTYPE)])
        packs = layer.int4_packs
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packs[0][0], GROUP, packs[0][1]).float()
        for packed, scales_and_zeros in packs[1:]:
            out += torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, GROUP, scales_and_zeros)
        if flat.shape[0] != rows:
            out = out[:rows] + out[rows:]
        out = out.to(x.dtype).reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias

    def describe(self, layer: nn.Module) -> str:
        return layer.effective_format


def regroup(weight: GroupAffine) -> GroupAffine:
    """Groups larger than the kernel's split into groups of :data:`GROUP` (each keeps its scale and offset)."""
    factor = weight.group_size // GROUP
    split = lambda tensor: None if tensor is None else tensor.repeat_interleave(factor, dim=1)  # noqa: E731
    return GroupAffine(
        weight.codes,
        split(weight.scales),
        split(weight.offsets),
        GROUP,
        weight.bits,
        weight.signed,
        weight.source_format,
    )
