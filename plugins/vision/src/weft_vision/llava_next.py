"""LLaVA-Next (``LlavaNextForConditionalGeneration``): a CLIP tower, a two-layer projector, anyres packing with an
``image_newline`` feature, and core's Llama (Llama, Mistral or Qwen2 settings) as the language model.

Every view of an item (the base view, then the tiles, :mod:`weft_vision.llava_next_processor`) goes through the
CLIP tower up to ``vision_feature_layer`` (the hidden states after that many layers, the embeddings' pre-norm
counting as the first; a list concatenates several), drops the CLS feature and is projected. The base view's
features come first; the tiles' features are laid out as one grid, the rows or columns that the processor's
padding produced are removed, and every row of the grid ends with ``image_newline`` (transformers'
``pack_image_features``). Layers past the deepest one read, and the tower's final norm, are not built: their
checkpoint tensors are skipped.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from weft_vision.common import (
    Conv2d,
    Embedding,
    Linear,
    VisionLanguageFamily,
    VisionLanguageModel,
    VisionLanguageSettings,
)
from weft_vision.llava_next_processor import DEFAULT_PINPOINTS, select_best_resolution, unpadded_grid
from weft_vision.vit import ViTEncoder, activation


def feature_layers(hf_config: dict[str, Any], num_layers: int) -> list[int]:
    """``vision_feature_layer`` as indices into the hidden states (0: the embeddings, i: after layer i)."""
    layers = hf_config.get("vision_feature_layer", -2)
    layers = [layers] if isinstance(layers, int) else list(layers)
    return [layer if layer >= 0 else num_layers + 1 + layer for layer in layers]


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, patch = config["hidden_size"], config.get("patch_size", 32)
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = Conv2d(config.get("num_channels", 3), hidden, patch, patch, bias=False)
        self.position_embedding = Embedding((config.get("image_size", 224) // patch) ** 2 + 1, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]


class CLIPVisionTower(nn.Module):
    def __init__(self, config: dict[str, Any], layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config["hidden_size"], eps=config.get("layer_norm_eps", 1e-5))
        self.encoder = ViTEncoder(config, "quick_gelu", 1e-5, layers)

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> torch.Tensor:
        """The hidden states after each of ``layers`` (0: the embeddings), concatenated on the last axis."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [hidden]
        for layer in self.encoder.layers:
            hidden = layer(hidden)
            states.append(hidden)
        return torch.cat([states[index] for index in layers], dim=-1)


class LlavaNextProjector(nn.Module):
    def __init__(self, vision_width: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = Linear(vision_width, text_hidden, bias=bias)
        self.act = activation(act)
        self.linear_2 = Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class Newline(nn.Module):
    """Holds ``image_newline``, the feature ending every row of the tiles' grid."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.image_newline = nn.Parameter(torch.empty(hidden))


class LlavaNextModel(VisionLanguageModel):
    def build_vision(self, settings: VisionLanguageSettings) -> None:
        hf_config, vision = settings.hf_config, settings.vision_config
        self.layers = feature_layers(hf_config, vision["num_hidden_layers"])
        self.visual = CLIPVisionTower(vision, max(self.layers))
        self.projector = LlavaNextProjector(
            vision["hidden_size"] * len(self.layers),
            settings.hidden_size,
            hf_config.get("projector_hidden_act", "gelu"),
            hf_config.get("multimodal_projector_bias", True),
        )
        self.newline = Newline(settings.hidden_size)
        self.tile = vision.get("image_size", 224)
        self.per_side = self.tile // vision.get("patch_size", 32)
        self.pinpoints = [list(pair) for pair in hf_config.get("image_grid_pinpoints", DEFAULT_PINPOINTS)]

    def encode_item(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        height, width = (int(size) for size in inputs["image_sizes"].tolist())
        features = self.projector(self.visual(inputs["pixel_values"], self.layers)[:, 1:])
        base, tiles = features[0], features[1:]
        best_height, best_width = select_best_resolution(height, width, self.pinpoints)
        rows, columns, side = best_height // self.tile, best_width // self.tile, self.per_side
        grid = tiles.view(rows, columns, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        top, bottom, left, right = unpadded_grid(height, width, grid.shape[1], grid.shape[2])
        grid = grid[:, top:bottom, left:right]
        newline = self.newline.image_newline[:, None, None].expand(-1, grid.shape[1], 1).to(grid.dtype)
        grid = torch.cat((grid, newline), dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat((base, grid), dim=0)


class LlavaNextFamily(VisionLanguageFamily):
    """LLaVA-Next: CLIP, projector, anyres packing with image_newline, Llama (module docstring)."""

    module_class = LlavaNextModel
    default_text_model_type: ClassVar[str] = "llama"
    renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
        ("vision_tower.vision_model.", "visual."),
        ("model.vision_tower.vision_model.", "visual."),
        ("model.vision_tower.", "visual."),
        ("vision_tower.", "visual."),
        ("model.multi_modal_projector.", "projector."),
        ("multi_modal_projector.", "projector."),
        ("model.image_newline", "newline.image_newline"),
        ("image_newline", "newline.image_newline"),
    )
    vision_prefixes: ClassVar[tuple[str, ...]] = ("visual.", "projector.", "newline.")

    def load_other_tensor(self, module: nn.Module, name: str, tensor: Any, filled: set[str]) -> bool:
        if name.startswith("visual.post_layernorm."):
            return True  # the tower's final norm: the features are read before it
        if name.startswith("visual.encoder.layers.") and int(name.split(".")[3]) >= len(module.visual.encoder.layers):
            return True  # a layer past the deepest feature layer
        return super().load_other_tensor(module, name, tensor, filled)
