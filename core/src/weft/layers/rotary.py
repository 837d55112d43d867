"""Rotary position embeddings (the ``rotate_half`` layout), with the llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config, whether it uses ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    parameters = dict(hf_config.get("rope_scaling") or {})
    parameters.update(hf_config.get("rope_parameters") or {})
    parameters.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    parameters.setdefault("rope_type", parameters.pop("type", "default") or "default")
    return parameters


def inverse_frequencies(head_dim: int, parameters: dict[str, Any]) -> torch.Tensor:
    base = float(parameters["rope_theta"])
    # Computed on the CPU in float32 whatever the defaults the model is built under.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    kind = parameters["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "llama3":
        factor = parameters["factor"]
        low_freq_factor, high_freq_factor = parameters["low_freq_factor"], parameters["high_freq_factor"]
        old_context = parameters["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if kind == "linear":
        return inv_freq / parameters["factor"]
    raise ValueError(f"rope_type {kind!r} is not supported; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to query and key heads at given positions."""

    def __init__(self, head_dim: int, max_positions: int, parameters: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, parameters)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` for ``positions`` ``[T]``, shaped ``[T, 1, dim]``: look them up once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` ``[T, heads, dim]`` and ``key`` ``[T, kv_heads, dim]`` by a :meth:`RotaryEmbedding.table`."""
    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def yarn_frequencies(head_dim: int, parameters: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, DeepSeek V3): ``(inverse frequencies, attention factor)``, as Hugging Face computes them.

    Frequencies rotating fewer than ``beta_slow`` times over ``original_max_position_embeddings`` are divided
    by ``factor`` (interpolated), those rotating more than ``beta_fast`` times are kept, with a linear ramp
    between; cos and sin are multiplied by the attention factor (``0.1 ln(factor) + 1`` unless given, or
    the ratio of the ``mscale`` / ``mscale_all_dim`` forms).
    """
    base, factor = float(parameters["rope_theta"]), parameters["factor"]
    original = parameters["original_max_position_embeddings"]

    def mscale(scale: float, value: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * value * math.log(scale) + 1.0

    attention_factor = parameters.get("attention_factor")
    if attention_factor is None:
        if parameters.get("mscale") and parameters.get("mscale_all_dim"):
            attention_factor = mscale(factor, parameters["mscale"]) / mscale(factor, parameters["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = parameters.get("beta_fast") or 32, parameters.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    positions = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * positions)) * (1 - extrapolation) + (1.0 / positions) * extrapolation
    return inv_freq, float(attention_factor)


class YarnRotaryEmbedding(RotaryEmbedding):
    """Rotary embeddings with YaRN's frequencies (:func:`yarn_frequencies`), cos and sin scaled by its attention factor."""

    def __init__(self, head_dim: int, max_positions: int, parameters: dict[str, Any]) -> None:
        super().__init__(head_dim, max_positions, {**parameters, "rope_type": "default"})
        inv_freq, scaling = yarn_frequencies(head_dim, parameters)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos() * scaling, emb.sin() * scaling
