"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a window-attention vision tower, a patch merger, and core's
Llama (Qwen2 settings) with multimodal rotary positions (M-RoPE) as the language model.

The tower, as transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` on one image: a 3-D patch convolution
over the processor's flattened patches (:mod:`weft_vision.qwen2_5_vl_processor`), a 2-D rotary embedding (height
and width each rotate a quarter of every head), and blocks of RMSNorm, attention and a gated MLP. The patches are
regrouped into windows of ``window_size`` pixels (in units of merged ``spatial_merge_size**2`` patch blocks);
the blocks of ``fullatt_block_indexes`` attend over the whole image, the others within each window. The merger
(RMSNorm, then an MLP over each block's concatenated patches) gives one row per merged block, put back in raster
order: the item's ``grid_h * grid_w / merge**2`` rows.

M-RoPE: the rotary angle of a query or key dimension comes from one of three position axes (temporal, height,
width), by the ``mrope_section`` split of the head's frequencies. The processed prompt's ``[3, n]`` positions
reach the model on ``context.multimodal.positions``; where the step has none (text-only and decode steps) the
plain positions serve every axis, which is ordinary RoPE.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from weft.api import ForwardContext, LlamaForCausalLM, rms_norm
from weft_vision.common import (
    Conv3d,
    Linear,
    VisionLanguageFamily,
    VisionLanguageModel,
    VisionLanguageSettings,
)
from weft_vision.vit import activation

_LlamaModel = LlamaForCausalLM.model_class


class MultimodalRotaryEmbedding(_LlamaModel.rotary_class):
    """Core's rotary table, looked up per axis where positions are ``[3, T]`` (module docstring)."""

    def __init__(self, head_dim: int, max_positions: int, parameters: dict[str, Any]) -> None:
        super().__init__(head_dim, max_positions, parameters)
        sections = list(parameters.get("mrope_section") or [])
        if sum(sections) * 2 != self.cos.shape[-1]:
            raise ValueError(
                f"rope_parameters.mrope_section = {sections} must sum to half the rotary width "
                f"({self.cos.shape[-1] // 2}), the head's frequencies split over the temporal, height and width axes"
            )
        axes = torch.cat([torch.full((size,), index % 3) for index, size in enumerate(sections)])
        self.register_buffer("axes", torch.cat((axes, axes)), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().table(positions, dtype)
        index = self.axes[None, None, :].expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, index)[0]
        sin = self.sin[positions].gather(0, index)[0]
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


class Qwen2_5_VLTextModel(_LlamaModel):
    rotary_class = MultimodalRotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = Linear(hidden, 3 * hidden)
        self.proj = Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor, segments: list[int], rotary: tuple[torch.Tensor, torch.Tensor]):
        tokens = hidden.shape[0]
        query, key, value = self.qkv(hidden).reshape(tokens, 3, self.heads, self.head_dim).unbind(1)
        cos, sin = (table.unsqueeze(1).float() for table in rotary)
        dtype = query.dtype
        query = (query.float() * cos + _rotate_half(query.float()) * sin).to(dtype)
        key = (key.float() * cos + _rotate_half(key.float()) * sin).to(dtype)
        outputs = []
        for q, k, v in zip(*(t.split(segments) for t in (query, key, value)), strict=True):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=self.head_dim**-0.5
            )
            outputs.append(out.transpose(0, 1).reshape(q.shape[0], -1))
        return self.proj(torch.cat(outputs))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = Linear(hidden, intermediate), Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.attn = VisionAttention(hidden, config["num_heads"])
        self.mlp = VisionMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"))

    def forward(self, hidden: torch.Tensor, segments: list[int], rotary: tuple[torch.Tensor, torch.Tensor]):
        hidden = hidden + self.attn(self.norm1(hidden), segments, rotary)
        return hidden + self.mlp(self.norm2(hidden))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, temporal: int, channels: int, hidden: int) -> None:
        super().__init__()
        self.shape = (-1, channels, temporal, patch, patch)
        self.proj = Conv3d(channels, hidden, self.shape[2:], stride=self.shape[2:], bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.view(self.shape).to(self.proj.weight.dtype)).flatten(1)


class PatchMerger(nn.Module):
    def __init__(self, hidden: int, merged: int, out: int) -> None:
        super().__init__()
        self.merged = merged
        self.ln_q = RMSNorm(hidden)
        self.mlp = nn.Sequential(Linear(merged, merged), nn.GELU(), Linear(merged, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen2_5_VisionTower(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_heads"]
        self.patch_size, self.merge = config.get("patch_size", 14), config.get("spatial_merge_size", 2)
        self.window_size = config.get("window_size", 112)
        self.full_attention = set(config.get("fullatt_block_indexes", (7, 15, 23, 31)))
        self.patch_embed = PatchEmbed(
            self.patch_size, config.get("temporal_patch_size", 2), config.get("in_channels", 3), hidden
        )
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config["depth"]))
        self.merger = PatchMerger(hidden, hidden * self.merge**2, config["out_hidden_size"])
        theta = float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        spatial = hidden // heads // 2  # height and width each rotate half of every head
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device="cpu") / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid: list[int]) -> torch.Tensor:
        frames, grid_h, grid_w = grid
        merge, unit = self.merge, self.merge**2
        device = pixel_values.device
        hidden = self.patch_embed(pixel_values)
        # (h, w) of each patch, the patches of each merge block together (the processor's order).
        blocks = (grid_h // merge, merge, grid_w // merge, merge)
        rows = torch.arange(grid_h, device=device)[:, None].expand(grid_h, grid_w)
        columns = torch.arange(grid_w, device=device)[None, :].expand(grid_h, grid_w)
        position = torch.stack(
            [axis.reshape(blocks).transpose(1, 2).flatten() for axis in (rows, columns)], dim=-1
        ).repeat(frames, 1)
        freqs = position[..., None].float() * self.inv_freq.to(device)
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        order, windows = self.window_order(frames, grid_h // merge, grid_w // merge, device)
        tokens = hidden.shape[0]

        def by_window(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(tokens // unit, unit, -1)[order].reshape(tokens, -1)

        hidden = by_window(hidden)
        rotary = (by_window(angles.cos()), by_window(angles.sin()))
        whole = [tokens // frames] * frames
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, whole if index in self.full_attention else windows, rotary)
        return self.merger(hidden)[torch.argsort(order)]

    def window_order(self, frames: int, rows: int, columns: int, device: torch.device) -> tuple[torch.Tensor, list]:
        """The merge blocks in window order, and each window's patch count (transformers'
        ``get_vision_window_index`` for one image)."""
        side = self.window_size // self.merge // self.patch_size
        pad_h, pad_w = side - rows % side, side - columns % side
        index = torch.arange(frames * rows * columns, device=device).reshape(frames, rows, columns)
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        windows_h, windows_w = (rows + pad_h) // side, (columns + pad_w) // side
        padded = padded.reshape(frames, windows_h, side, windows_w, side).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(frames, windows_h * windows_w, side * side)
        sizes = (padded != -100).sum(-1).reshape(-1)
        order = padded.reshape(-1)
        return order[order != -100], [size * self.merge**2 for size in sizes.tolist() if size > 0]


class Qwen2_5_VLModel(VisionLanguageModel):
    model_class = Qwen2_5_VLTextModel

    def build_vision(self, settings: VisionLanguageSettings) -> None:
        self.visual = Qwen2_5_VisionTower(settings.vision_config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        multimodal = getattr(context, "multimodal", None)
        if multimodal is not None and multimodal.positions is not None:
            positions = multimodal.positions
        return self.model(input_ids, positions, context, intermediate)

    def encode_item(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        grid = [int(size) for size in inputs["image_grid_thw"].tolist()]
        return self.visual(inputs["pixel_values"], grid)


class Qwen2_5_VLFamily(VisionLanguageFamily):
    """Qwen2.5-VL: window-attention tower, patch merger, Qwen2 with M-RoPE (module docstring)."""

    module_class = Qwen2_5_VLModel
    default_text_model_type: ClassVar[str] = "qwen2"
    renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
    )
    vision_prefixes: ClassVar[tuple[str, ...]] = ("visual.",)
