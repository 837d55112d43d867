"""``fp8``: linear layers with float8_e4m3 weights on Ada and Hopper GPUs (compute capability 8.9+).

Weights are float8_e4m3fn codes with one float32 scale per output channel (``w = code * scale``):
quantized at load from float checkpoints (``scale = max |row| / 448``, each weight rounded to
nearest), or taken as they are from fp8 checkpoints (compressed-tensors' float-quantized format
and FBGEMM's ``fbgemm_fp8``, which the safetensors loader reads into codes and scales; a per-tensor
scale is the same scale on every row). The checkpoints' static input scales are not used: activations
always get dynamic scales.

Two kernels multiply, chosen per call by the rows:

* one row (batch-1 decode): :class:`weft_triton.gemv.Fp8GemvKernel`, activations kept in their dtype
  and the weights converted in registers: the step streams half the bytes of bf16 weights;
* more rows: the activations quantized per token (``scale = max |row| / 448``) and multiplied by
  ``torch._scaled_mm`` with row-wise scales (cuBLASLt's fp8 tensor cores, float32 accumulation),
  bf16 out. The quantization is one launch of :class:`weft_triton.quantize.Fp8QuantizeRowsKernel` where Triton
  runs (the same codes and scales as :func:`quantize_rows`, whose seven torch launches over float32 copies would,
  by their bytes, take a 512-row 8B decode step about as long as the fp8 GEMMs save: an estimate, not measured).

The math of both (:func:`quantize_rows`, :func:`scaled_matmul`) also runs on the CPU (torch converts
float8 and has a CPU ``_scaled_mm``), where tests check it against plain torch; the method itself
refuses every platform without fp8 tensor cores.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from weft.contracts.attention import FLOAT8_MAX, to_float8
from weft.contracts.platform import FLOAT8_REQUIREMENT
from weft.contracts.quantization import GroupAffine, QuantizationMethod

ALIGNMENT = 16
"""``torch._scaled_mm`` takes matrices whose input and output features are multiples of 16."""
GEMV_ROWS = 1
"""Rows that go to the GEMV kernel (:data:`weft_triton.gemv.MAX_ROWS`); more go to ``torch._scaled_mm``."""


def quantize_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``matrix`` ``[rows, columns]`` as float8_e4m3fn codes and a float32 scale per row (``max |row| / 448``;
    ``1 / 448`` for a row of zeros, as transformers has it), rounded to nearest:
    ``matrix ~ codes * scales[:, None]``."""
    matrix = matrix.float()
    largest = matrix.abs().amax(dim=-1)
    # Divided by a tensor, not the Python float: CUDA divides by a scalar as a multiplication by its reciprocal,
    # which misses the correctly rounded quotient in the last bit (the Triton kernel's ``div_rn`` is exact).
    scales = torch.where(largest > 0, largest, torch.ones_like(largest)) / torch.full_like(largest, FLOAT8_MAX)
    return to_float8(matrix / scales[:, None]), scales


def emulate_in_plain_torch(model: torch.nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> None:
    """Round, in place, every ``nn.Linear`` of ``model`` (a transformers model, say) but those named in ``skip`` as
    this method rounds: the weights per output channel, the inputs per token (a forward pre-hook), the products
    in the model's dtype. The fp8 format's own error, measured without Weft's kernels: what ``bench/fp8.py`` and the
    GPU tests judge the engine's fp8 against."""

    def rounded_input(module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0]
        codes, scales = quantize_rows(x.reshape(-1, x.shape[-1]))
        return ((codes.float() * scales[:, None]).to(x.dtype).reshape(x.shape),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name not in skip:
            codes, scales = quantize_rows(module.weight.data)
            module.weight.data = (codes.float() * scales[:, None]).to(module.weight.dtype)
            module.register_forward_pre_hook(rounded_input)


def scaled_matmul(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``x @ (codes * scales[:, None])^T`` for ``x`` ``[rows, in]``: ``x`` quantized per token, both scales applied
    by ``torch._scaled_mm`` (row-wise scaling takes a bf16 output)."""
    return scaled_product(*quantize_rows(x), codes, scales, out_dtype)


def scaled_product(
    x_codes: torch.Tensor,
    x_scales: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(x_codes * x_scales[:, None]) @ (codes * scales[:, None])^T`` through ``torch._scaled_mm``."""
    return torch._scaled_mm(x_codes, codes.t(), scale_a=x_scales[:, None], scale_b=scales[None, :], out_dtype=out_dtype)


class Fp8(QuantizationMethod):
    """float8_e4m3 weights with per-output-channel scales; activations quantized per token; ``torch._scaled_mm``."""

    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    # Weights and activations each rounded to 3 mantissa bits (2^-4 relative at most, about 2^-6 on average),
    # the product in bf16: a few parts in a hundred of the output's magnitude at worst.
    tolerance: ClassVar[tuple[float, float]] = (5e-2, 5e-2)
    conversions: ClassVar[dict[str, str]] = {
        "fp8 checkpoints (compressed-tensors float-quantized, fbgemm_fp8)": "float8_e4m3 codes and scales as stored",
        "float weights": "float8_e4m3 per output channel, scale max|row| / 448, rounded to nearest "
        "(|error| <= 2^-4 of each weight, relative)",
        "GGUF blocks": "dequantized, then float8_e4m3 per output channel as float weights",
        "activations": "float8_e4m3 per token (dynamic scales) into torch._scaled_mm, bf16 out; at one row "
        "kept in bf16 against the fp8 weights (Triton GEMV)",
    }

    def __init__(self, platform, dtype: str) -> None:
        super().__init__(platform, dtype)
        self.gemv = self.quantize = None
        from weft_triton.runtime import runs_on

        if runs_on(platform):
            from weft.api import register
            from weft_triton.gemv import Fp8GemvKernel
            from weft_triton.quantize import Fp8QuantizeRowsKernel

            self.gemv = register(Fp8GemvKernel())
            self.quantize = register(Fp8QuantizeRowsKernel())

    @classmethod
    def is_available(cls, platform) -> bool:
        return super().is_available(platform) and platform.float8_unsupported() is None

    @classmethod
    def unavailable_reason(cls, platform) -> str:
        return f"needs {FLOAT8_REQUIREMENT}; {platform.float8_unsupported() or f'this platform is {platform.name}'}"

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        if in_features % ALIGNMENT or out_features % ALIGNMENT:
            raise ValueError(
                f"quantization 'fp8' needs input and output features in multiples of {ALIGNMENT} (torch._scaled_mm); "
                f"a layer has {in_features} -> {out_features}; set engine.quantization = 'none'"
            )
        layer.fp8_parts = []
        if self.gemv is not None and self.dtype in ("bfloat16", "float16"):
            self.gemv.add_shape(out_features, in_features, False, getattr(torch, self.dtype))
        if self.quantize is not None and self.dtype in ("bfloat16", "float16", "float32"):
            self.quantize.add_shape(in_features, getattr(torch, self.dtype))

    def load_weight(self, layer: nn.Module, weight: GroupAffine | torch.Tensor, row: int, name: str) -> None:
        device = layer.weight.device
        if isinstance(weight, GroupAffine) and weight.float_codes and weight.scales.shape[1] == 1:
            codes, scales = weight.codes.to(device), weight.scales[:, 0].to(device, torch.float32)
            source = f"{weight.source_format} codes as stored"
        else:
            dense = weight.dequantize() if isinstance(weight, GroupAffine) else weight
            codes, scales = quantize_rows(dense.to(device))
            source = f"{weight.source_format if isinstance(weight, GroupAffine) else dense.dtype} rounded to nearest"
        layer.fp8_parts.append((row, codes, scales, source))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = sorted(layer.__dict__.pop("fp8_parts"), key=lambda part: part[0])
        if not parts:
            raise ValueError(f"a {type(layer).__name__} of {layer.out_features} rows got no weights to quantize")
        codes = torch.cat([part[1] for part in parts])
        if tuple(codes.shape) != (layer.out_features, layer.in_features):
            raise ValueError(
                f"fp8 weights of shape {tuple(codes.shape)} for a layer of {(layer.out_features, layer.in_features)}"
            )
        # Buffers, so that the worker's shutdown frees them with the model's other tensors.
        layer.register_buffer("fp8_codes", codes.contiguous(), persistent=False)
        layer.register_buffer("fp8_scales", torch.cat([part[2] for part in parts]).contiguous(), persistent=False)
        layer.fp8_source = ", ".join(dict.fromkeys(str(part[3]).replace("torch.", "") for part in parts))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        if rows <= GEMV_ROWS and self.gemv is not None and x.dtype in (torch.bfloat16, torch.float16):
            if not flat.is_contiguous() or flat.data_ptr() % 16:  # the kernel was compiled for aligned rows
                flat = flat.clone(memory_format=torch.contiguous_format)
            out = self.gemv(
                dtype=x.dtype,
                n=layer.out_features,
                k=layer.in_features,
                m=rows,
                has_bias=False,
                x=flat,
                weight=layer.fp8_codes,
                scale=layer.fp8_scales,
                bias=None,
            )
        elif self.quantize is not None and x.dtype in self.quantize.dtypes:
            x_codes, x_scales = self.quantize(dtype=x.dtype, k=layer.in_features, x=flat.contiguous())
            out = scaled_product(x_codes, x_scales, layer.fp8_codes, layer.fp8_scales)
        else:
            out = scaled_matmul(flat, layer.fp8_codes, layer.fp8_scales)
        out = out.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)
        return out if bias is None else out + bias

    def describe(self, layer: nn.Module) -> str:
        return f"float8_e4m3 per-channel scales from {layer.fp8_source}; activations float8 per token"
