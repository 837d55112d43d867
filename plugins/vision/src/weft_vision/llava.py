"""LLaVA 1.5 (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector, a Llama language model.

Following transformers' ``modeling_llava.py`` and ``modeling_clip.py``. An image's ``pixel_values`` (from the
``llava`` processor, :mod:`weft_vision.llava_processor`) go through the CLIP vision transformer; the hidden states
after layer ``vision_feature_layer`` (-2: the second to last, so the last layer never runs) lose their class token
(``vision_feature_select_strategy = "default"``), and the projector (linear, GELU, linear) maps each patch to one
embedding of the language model: :meth:`LlavaFamily.encode`, one row per ``<image>`` position. The language model is
core's Llama (``weft.api.LlamaForCausalLM``), which merges those rows after its token embedding
(``weft.api.merge_multimodal_embeddings``); its KV cache, tensor parallelism and decode graphs are Llama's. The
vision tower and the projector are replicated on every tensor rank.

Checkpoints name their tensors in either of transformers' layouts (``language_model.model.*`` and
``vision_tower.vision_model.*`` in llava-hf's; ``model.language_model.*``, ``model.vision_tower.*`` in
transformers 5's own); both load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from weft.api import LlamaFamily, copy_checked, default_dtype
from weft.contracts.loader import as_slice
from weft.contracts.model import ModelConfig, ModelFamily

TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""The language models a LLaVA checkpoint may carry (``text_config.model_type``), as core's Llama family names them."""

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def _activation(name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported by weft-vision's LLaVA; known: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class ClipAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, length, self.heads, self.head_dim).transpose(1, 2)

        query, key, value = heads(self.q_proj(hidden)), heads(self.k_proj(hidden)), heads(self.v_proj(hidden))
        output = F.scaled_dot_product_attention(query, key, value)  # every patch sees every patch
        return self.out_proj(output.transpose(1, 2).reshape(batch, length, width))


class ClipMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.act = _activation(activation)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-5)
        self.self_attn = ClipAttention(hidden, config["num_attention_heads"])
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = ClipMLP(hidden, config["intermediate_size"], config.get("hidden_act", "quick_gelu"))
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class ClipEmbeddings(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, patch, size = config["hidden_size"], config["patch_size"], config["image_size"]
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(config.get("num_channels", 3), hidden, patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding((size // patch) ** 2 + 1, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] + 1 != self.position_embedding.num_embeddings:
            raise ValueError(
                f"pixel_values of {tuple(pixel_values.shape[-2:])} pixels give {patches.shape[1]} patches; the vision "
                f"tower was trained for {self.position_embedding.num_embeddings - 1} (image_size)"
            )
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer up to the layer LLaVA reads (its later layers and final norm never run)."""

    def __init__(self, config: dict[str, Any], feature_layer: int) -> None:
        super().__init__()
        layers, eps = config["num_hidden_layers"], config.get("layer_norm_eps", 1e-5)
        self.embeddings = ClipEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config["hidden_size"], eps=eps)  # (sic: the checkpoints' name)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(ClipEncoderLayer(config) for _ in range(layers))
        self.post_layernorm = nn.LayerNorm(config["hidden_size"], eps=eps)  # loaded, unused by LLaVA
        # hidden_states[i] of transformers: the embeddings for 0, the output of layer i-1 after.
        self.num_layers_run = feature_layer if feature_layer >= 0 else layers + 1 + feature_layer
        if not 0 <= self.num_layers_run <= layers:
            raise ValueError(f"vision_feature_layer {feature_layer} is outside the tower's {layers} layers")

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers[: self.num_layers_run]:
            hidden = layer(hidden)
        return hidden


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, activation: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = _activation(activation)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(nn.Module):
    """The vision tower, the projector, and core's Llama as ``language_model`` (module docstring)."""

    def __init__(self, language_model: nn.Module, hf_config: dict[str, Any]) -> None:
        super().__init__()
        vision = hf_config["vision_config"]
        feature_layer = hf_config.get("vision_feature_layer", -2)
        if not isinstance(feature_layer, int):
            raise ValueError(
                f"vision_feature_layer {feature_layer!r}: weft-vision's LLaVA reads one layer (an integer); several "
                f"layers concatenated are not supported yet"
            )
        self.language_model = language_model
        self.vision_tower = ClipVisionTower(vision, feature_layer)
        self.multi_modal_projector = LlavaProjector(
            vision["hidden_size"],
            hf_config["text_config"]["hidden_size"],
            hf_config.get("projector_hidden_act", "gelu"),
            hf_config.get("multimodal_projector_bias", True),
        )
        self.keep_class_token = hf_config.get("vision_feature_select_strategy", "default") == "full"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.language_model(*args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def intermediate_spec(self, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self.language_model.intermediate_spec(num_tokens)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, patches, text hidden]`` for ``[images, 3, height, width]`` pixels."""
        features = self.vision_tower(pixel_values)
        if not self.keep_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)


def _text_config(config: ModelConfig) -> ModelConfig:
    """The language model's own ModelConfig: ``text_config`` under its Llama-family architecture."""
    text = config.hf_config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"this {config.architecture} checkpoint's config.json has no text_config")
    model_type = text.get("model_type", "llama")
    if model_type not in TEXT_ARCHITECTURES:
        raise ValueError(
            f"text_config.model_type {model_type!r}: weft-vision's LLaVA runs {sorted(TEXT_ARCHITECTURES)} language "
            f"models"
        )
    return msgspec.structs.replace(config, architecture=TEXT_ARCHITECTURES[model_type], hf_config=text)


_VISION_PREFIXES = (
    "model.vision_tower.vision_model.",
    "vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.",
)


def _checkpoint_name(name: str) -> tuple[str, str]:
    """``(part, name within it)``: part ``language`` (core Llama's names), ``vision`` or ``projector``."""
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "language", "model." + name[len(prefix) :]
    for prefix in ("language_model.lm_head.", "lm_head."):
        if name.startswith(prefix):
            return "language", "lm_head." + name[len(prefix) :]
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            return "vision", name[len(prefix) :]
    for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
        if name.startswith(prefix):
            return "projector", name[len(prefix) :]
    return "unknown", name


class LlavaFamily(ModelFamily):
    """LLaVA 1.5 (module docstring)."""

    reads_weight_slices = True

    def __init__(self, options: msgspec.Struct | None = None) -> None:
        super().__init__(options)
        self.language = LlamaFamily()

    def check_parallel(self, config: ModelConfig) -> None:
        if config.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                f"{config.architecture}: weft-vision's LLaVA runs on one pipeline stage (its vision tower feeds the "
                f"first); set engine.pipeline_parallel_size to 1"
            )
        self.language.check_parallel(_text_config(config))

    def kv_cache_groups(self, config: ModelConfig) -> tuple[Any, ...]:
        return self.language.kv_cache_groups(_text_config(config))

    def hf_architecture(self, architecture: str) -> str:
        return "LlavaForConditionalGeneration"

    def build(self, config: ModelConfig, device: torch.device) -> LlavaForConditionalGeneration:
        language_model = self.language.build(_text_config(config), device)
        with torch.device(device), default_dtype(getattr(torch, config.dtype)):
            module = LlavaForConditionalGeneration(language_model, config.hf_config)
        return module.eval()

    def load_weights(self, module: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
        """Language-model tensors go to core's Llama loader as they stream by; the others are copied here."""
        parts = {"vision": module.vision_tower, "projector": module.multi_modal_projector}
        parameters = {part: dict(owner.named_parameters()) for part, owner in parts.items()}
        filled: set[tuple[str, str]] = set()

        def language_weights() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                part, inner = _checkpoint_name(name)
                if part == "language":
                    yield inner, tensor
                    continue
                target = parameters.get(part, {}).get(inner)
                if target is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(module).__name__}")
                copy_checked(target.data, as_slice(tensor).load(), name)
                filled.add((part, inner))

        self.language.load_weights(module.language_model, language_weights())
        missing = sorted(
            f"{part}.{name}" for part, names in parameters.items() for name in names if (part, name) not in filled
        )
        if missing:
            raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameter(s), e.g. {missing[:3]}")

    def encode(self, module: nn.Module, items: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per image, ``[patches, hidden]`` rows: its patches through the tower and the projector (module docstring).

        Every image has the same size (the processor crops them all alike), so they run as one batch."""
        pixels = torch.stack([item["pixel_values"] for item in items])
        features = module.image_features(pixels)
        return list(features.to(module.language_model.dtype).unbind(0))
