"""Rotary position embeddings (the ``rotate_half`` layout), with the llama3 and yarn (DeepSeek V3) frequency
scalings and LongRoPE's short and long tables (Phi-3); a rotation may cover only the first part of each head
(``partial_rotary_factor``). Yarn and LongRoPE scale cos and sin by an attention factor, as Hugging Face does."""

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
    if kind == "longrope":
        return inv_freq / torch.tensor(parameters["short_factor"], dtype=torch.float32)
    if kind == "yarn":
        return _yarn_inverse_frequencies(head_dim, base, parameters)
    raise ValueError(f"rope_type {kind!r} is not supported; supported: default, linear, llama3, longrope, yarn")


def _yarn_inverse_frequencies(dim: int, base: float, parameters: dict[str, Any]) -> torch.Tensor:
    """Interpolated (divided by ``factor``) below the low-frequency bound, extrapolated (unchanged) above the high
    one, a linear ramp between (HF's ``_compute_yarn_parameters``)."""
    factor, original = _yarn_factor(parameters), parameters["original_max_position_embeddings"]
    beta_fast, beta_slow = parameters.get("beta_fast") or 32, parameters.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_factor(parameters: dict[str, Any]) -> float:
    return (
        parameters.get("factor")
        or parameters["max_position_embeddings"] / parameters["original_max_position_embeddings"]
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """Yarn's magnitude correction for a context ``factor`` times longer."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_scaling(parameters: dict[str, Any]) -> float:
    """The factor HF multiplies cos and sin by: yarn's mscale ratio, LongRoPE's attention factor, else 1."""
    kind = parameters["rope_type"]
    if parameters.get("attention_factor") is not None and kind in ("yarn", "longrope"):
        return float(parameters["attention_factor"])
    if kind == "yarn":
        factor, mscale, mscale_all_dim = (
            _yarn_factor(parameters),
            parameters.get("mscale"),
            parameters.get("mscale_all_dim"),
        )
        if mscale and mscale_all_dim:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        return yarn_mscale(factor)
    if kind == "longrope":
        factor = _yarn_factor(parameters)
        original = parameters["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def rotary_dim(head_dim: int, parameters: dict[str, Any]) -> int:
    """The leading dims of each head that rotate (``partial_rotary_factor`` of them; the rest pass through)."""
    return int(head_dim * parameters.get("partial_rotary_factor", 1.0))


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to query and key heads at given positions."""

    def __init__(self, head_dim: int, max_positions: int, parameters: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rotary_dim(head_dim, parameters), parameters)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = attention_scaling(parameters)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` for ``positions`` ``[T]``, shaped ``[T, 1, dim]``: look them up once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


class LongRopeEmbedding(RotaryEmbedding):
    """LongRoPE (Phi-3): the short factors' table at rows ``0 .. max_positions - 1``, the long factors' after it
    (look a position up at ``position + max_positions`` to take the long one), both scaled by the attention factor.

    As in Hugging Face, the long factors serve a sequence longer than ``original_max_position_embeddings``,
    the attention factor defaults to ``sqrt(1 + log(factor) / log(original))`` and ``factor`` to
    ``max_position_embeddings / original`` (``parameters`` carries ``max_position_embeddings`` for it).
    """

    def __init__(self, head_dim: int, max_positions: int, parameters: dict[str, Any]) -> None:
        super().__init__(head_dim, max_positions, parameters)
        self.original_max_positions = parameters["original_max_position_embeddings"]
        long = RotaryEmbedding(head_dim, max_positions, {**parameters, "short_factor": parameters["long_factor"]})
        self.cos = torch.cat((self.cos, long.cos))
        self.sin = torch.cat((self.sin, long.sin))


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` ``[T, heads, dim]`` and ``key`` ``[T, kv_heads, dim]`` by a :meth:`RotaryEmbedding.table`;
    a table narrower than the heads rotates their leading dims only."""
    width = cos.shape[-1]
    if width < query.shape[-1]:
        query_rotated, key_rotated = apply_rotary(query[..., :width], key[..., :width], cos, sin)
        return torch.cat((query_rotated, query[..., width:]), -1), torch.cat((key_rotated, key[..., width:]), -1)
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
    """Rotary embeddings with YaRN's frequencies (:func:`yarn_frequencies`), cos and sin scaled by its attention
    factor."""

    def __init__(self, head_dim: int, max_positions: int, parameters: dict[str, Any]) -> None:
        super().__init__(head_dim, max_positions, {**parameters, "rope_type": "default"})
        inv_freq, scaling = yarn_frequencies(head_dim, parameters)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos() * scaling, emb.sin() * scaling
