"""GGUF block formats as codes, scales and offsets (:class:`weft.contracts.quantization.GroupAffine`), exactly.

Each format's dequantization (the ``gguf`` package's, llama.cpp's ``ggml-quants.c``) is
``code * scale + offset`` per group of 32 consecutive input features:

=======  =====================================  ==========================
format   codes                                  scale, offset per group
=======  =====================================  ==========================
Q4_0     4-bit, 0..15                           ``d``, ``-8 d``
Q4_1     4-bit, 0..15                           ``d``, ``m``
Q4_K     4-bit, 0..15 (8 sub-blocks of 256)     ``d * sc``, ``-dmin * m`` (6-bit sc and m)
Q8_0     8-bit signed                           ``d``, none
=======  =====================================  ==========================

Scales and offsets are computed in float32 as the ``gguf`` package does, so ``dequantize()``
of the result equals ``gguf.quants.dequantize`` bit for bit. Other formats are not decomposed:
their tensors reach layers as dequantized floats.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from weft.contracts.quantization import GroupAffine, QuantizedWeight

GROUP = 32


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[blocks, 16]`` packed bytes -> ``[blocks, 32]`` codes: low nibbles first, then high (llama.cpp's order)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    return _nibbles(blocks[:, 2:]), d, -8 * d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    return _nibbles(blocks[:, 4:]), d, m


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    return blocks[:, 2:].copy().view(np.int8), d, None


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    from gguf.quants import Q4_K

    count = blocks.shape[0]
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scales = (d * sc.reshape(count, -1).astype(np.float32)).reshape(-1)
    offsets = -(dmin * m.reshape(count, -1).astype(np.float32)).reshape(-1)
    # 128 bytes hold 4 chunks of 64 values: each chunk's 32 bytes give 32 low nibbles, then 32 high ones.
    qs = blocks[:, 16:].reshape(count, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(count * 8, GROUP), scales, offsets


_FORMATS = {"Q4_0": (_q4_0, 4, False), "Q4_1": (_q4_1, 4, False), "Q4_K": (_q4_k, 4, False), "Q8_0": (_q8_0, 8, True)}
"""Format name -> (decoder of ``[blocks, bytes]`` into per-group codes/scales/offsets, code bits, signed)."""


def decomposable(format_name: str) -> bool:
    return format_name in _FORMATS


def group_affine(data: np.ndarray, format_name: str, rows: int, columns: int) -> GroupAffine:
    """A GGUF tensor's raw blocks (``[rows, bytes per row]`` uint8, as ``GGUFReader`` maps them) decomposed."""
    decode, bits, signed = _FORMATS[format_name]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[format_name]]
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    codes, scales, offsets = decode(blocks)
    groups = columns // GROUP
    assert block_size % GROUP == 0 and codes.size == rows * columns
    return GroupAffine(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, columns)),
        torch.from_numpy(np.ascontiguousarray(scales).reshape(rows, groups)),
        None if offsets is None else torch.from_numpy(np.ascontiguousarray(offsets).reshape(rows, groups)),
        GROUP,
        bits,
        signed,
        format_name,
    )


class GGUFQuantizedWeight(QuantizedWeight):
    """One GGUF tensor kept in its blocks; floats (dequantized, with llama's q/k rows permuted back) on request."""

    def __init__(self, tensor: Any, dtype: torch.dtype, unpermute_heads: int | None) -> None:
        self.tensor = tensor
        self.format = tensor.tensor_type.name
        self.dtype = dtype
        self.unpermute_heads = unpermute_heads
        self.shape = (int(tensor.shape[1]), int(tensor.shape[0]))

    def group_affine(self) -> GroupAffine:
        from weft_gguf.loader import unpermute_rotary

        weights = group_affine(self.tensor.data, self.format, *self.shape)
        if self.unpermute_heads is None:
            return weights
        rows = lambda tensor: None if tensor is None else unpermute_rotary(tensor, self.unpermute_heads)  # noqa: E731
        return GroupAffine(
            rows(weights.codes),
            rows(weights.scales),
            rows(weights.offsets),
            weights.group_size,
            weights.bits,
            weights.signed,
            weights.source_format,
        )

    def load(self) -> torch.Tensor:
        return self.group_affine().dequantize().to(self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.load().narrow(dim, start, length)
