"""Partial interleaved RoPE of DeepSeek V4: the main and compressed-branch tables (YaRN on the latter)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inverse_frequencies(
    parameters: dict[str, Any], head_dim: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (one per interleaved pair) and the cos/sin scale of one rope type."""
    dim = int(head_dim * parameters["partial_rotary_factor"])
    base = float(parameters["rope_theta"])
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    if parameters["rope_type"] == "default":
        return inv_freq, 1.0
    # YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp in between.
    factor = parameters["factor"]
    original = parameters["original_max_position_embeddings"]
    beta_fast, beta_slow = parameters.get("beta_fast") or 32, parameters.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    scale = parameters.get("attention_factor")
    if scale is None:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, float(scale)


class InterleavedRope(nn.Module):
    """cos/sin tables of one rope type; rotates the trailing ``rope_dim`` channels in (even, odd) pairs."""

    def __init__(self, parameters: dict[str, Any], head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scale = rope_inverse_frequencies(parameters, head_dim, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # HF casts the tables to the activation dtype before rotating in fp32; so do we.
        cos = self.cos[positions].to(dtype).float().repeat_interleave(2, dim=-1)
        sin = self.sin[positions].to(dtype).float().repeat_interleave(2, dim=-1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``cos.shape[-1]`` channels of ``x`` ``[T, ..., D]``; cos/sin are ``[T, rope_dim]``."""
    rope_dim = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    cos, sin = cos.view(shape), sin.view(shape)
    rope = x[..., -rope_dim:].float()
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], (rope * cos + rotated * sin).to(x.dtype)], dim=-1)
