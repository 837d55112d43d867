"""Idefics3 / SmolVLM (``Idefics3ForConditionalGeneration``): a SigLIP tower, a pixel-shuffle connector, and core's
Llama as the language model (:mod:`weft_vision.common`).

Each view of an item (its crops and the global view, :mod:`weft_vision.idefics3_processor`) goes through the
tower: a patch convolution plus learned position embeddings (looked up by each patch's bucketed fractional
coordinate, as transformers' ``Idefics3VisionEmbeddings`` computes them, so a view of another size than the
tower's reads the same table), SigLIP's encoder layers and a final layer norm. The connector folds each
``scale_factor x scale_factor`` block of patch features into one feature (transformers' ``pixel_shuffle``) and
projects it to the language model's width: ``(side / patch / scale)**2`` rows per view, the views in order.
Those rows go at the ``<image>`` positions of the item's replacement (the ``token_ids`` encoder input); its
marker tokens' rows are their token embeddings, so the encoder output covers the whole replacement, one range.
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
from weft_vision.vit import ViTEncoder


class Idefics3VisionEmbeddings(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, self.patch_size = config["hidden_size"], config.get("patch_size", 32)
        self.patch_embedding = Conv2d(config.get("num_channels", 3), hidden, self.patch_size, self.patch_size)
        self.per_side = config.get("image_size", 224) // self.patch_size
        self.position_embedding = Embedding(self.per_side**2, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        views, _, height, width = pixel_values.shape
        embeddings = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        rows, columns = height // self.patch_size, width // self.patch_size
        device = pixel_values.device
        boundaries = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=device, dtype=torch.float32)
        fraction_h = torch.arange(rows, device=device, dtype=torch.float32) * (1.0 / torch.tensor(rows, device=device))
        fraction_w = torch.arange(columns, device=device, dtype=torch.float32) * (
            1.0 / torch.tensor(columns, device=device)
        )
        bucket_h = torch.bucketize(fraction_h.clamp(max=1.0 - 1e-6), boundaries, right=True)
        bucket_w = torch.bucketize(fraction_w.clamp(max=1.0 - 1e-6), boundaries, right=True)
        position_ids = (bucket_h[:, None] * self.per_side + bucket_w[None, :]).reshape(-1)
        return embeddings + self.position_embedding(position_ids)[None].expand(views, -1, -1)


class Idefics3VisionTower(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.embeddings = Idefics3VisionEmbeddings(config)
        self.encoder = ViTEncoder(config, "gelu_pytorch_tanh", 1e-6, config.get("num_hidden_layers", 12))
        self.post_layernorm = nn.LayerNorm(config["hidden_size"], eps=config.get("layer_norm_eps", 1e-6))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)


class Idefics3Projection(nn.Module):
    def __init__(self, vision_hidden: int, scale: int, text_hidden: int) -> None:
        super().__init__()
        self.proj = Linear(vision_hidden * scale * scale, text_hidden, bias=False)


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden: int, scale: int, text_hidden: int) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = Idefics3Projection(vision_hidden, scale, text_hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[views, side * side, hidden]`` -> ``[views, side * side / scale**2, text hidden]``."""
        views, patches, hidden = features.shape
        side, scale = int(patches**0.5), self.scale
        if side * side != patches or side % scale:
            raise ValueError(
                f"Idefics3's pixel shuffle needs a square grid of patches whose side divides by scale_factor "
                f"{scale}; a view gave {patches} patches"
            )
        x = features.view(views, side, side // scale, hidden * scale).permute(0, 2, 1, 3)
        x = x.reshape(views, side // scale, side // scale, hidden * scale * scale).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(views, patches // (scale * scale), hidden * scale * scale))


class Idefics3Model(VisionLanguageModel):
    def build_vision(self, settings: VisionLanguageSettings) -> None:
        vision = settings.vision_config
        self.visual = Idefics3VisionTower(vision)
        scale = int(settings.hf_config.get("scale_factor", 2))
        self.connector = Idefics3Connector(vision["hidden_size"], scale, settings.hidden_size)
        self.image_token_id = int(settings.hf_config.get("image_token_id", 128257))

    def encode_item(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        features = self.connector(self.visual(inputs["pixel_values"]))
        token_ids = inputs["token_ids"]
        rows = self.model.embed_tokens(token_ids)
        image = token_ids == self.image_token_id
        if int(image.sum()) != features.shape[0] * features.shape[1]:
            raise ValueError(
                f"Idefics3 item: {features.shape[0]} views give {features.shape[0] * features.shape[1]} features, but "
                f"its replacement holds {int(image.sum())} <image> tokens; the processor and the checkpoint disagree"
            )
        rows[image] = features.reshape(-1, features.shape[-1]).to(rows.dtype)
        return rows


class Idefics3Family(VisionLanguageFamily):
    """Idefics3 / SmolVLM: SigLIP, pixel shuffle, Llama (module docstring)."""

    module_class = Idefics3Model
    default_text_model_type: ClassVar[str] = "llama"
    renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.text_model.", "model."),
        ("model.vision_model.", "visual."),
        ("model.connector.", "connector."),
    )
    vision_prefixes: ClassVar[tuple[str, ...]] = ("visual.", "connector.")
