"""What the vision-language families share: core's Llama as the language model, a vision part beside it, and the
checkpoint names of both.

A family here is a :class:`weft.api.LlamaFamily` whose module is a :class:`weft.api.LlamaForCausalLM` (the
language model: ``model.*`` and ``lm_head``, merging the step's encoder rows after its token embedding, see
:mod:`weft.layers.multimodal`) with the vision tower and projector as further submodules. The settings are the
text config's (``text_config`` over the top-level keys, so the flat configs of older checkpoints read the same);
the full config stays on the settings for the vision part. :meth:`VisionLanguageFamily.encode` runs the vision
part on one item's encoder inputs at a time (their shapes differ from item to item).

Checkpoint names: each family lists prefix renames (:attr:`VisionLanguageFamily.renames`) from the names
transformers writes (its legacy layout, which 5.x still saves) and the ones it loads (``model.language_model.*``)
to this module's; the language model's tensors then load as core's Llama loads them (stacked q/k/v and gate/up,
tensor-parallel slices), the rest are copied whole into the vision part, which every tensor rank holds.

The vision part is built from torch modules that skip random initialisation (the checkpoint fills them, and
:meth:`load_weights` fails on any it leaves empty) and runs in plain torch: it is not quantized and takes no
ops, as vLLM leaves most vision towers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from weft.api import LlamaFamily, LlamaForCausalLM, LlamaSettings, default_dtype
from weft.contracts.loader import as_slice
from weft.contracts.model import ModelConfig

TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen2_vl_text": "Qwen2ForCausalLM",
}
"""The text config's ``model_type`` -> the architecture core's Llama reads it as."""


def text_config(hf_config: dict[str, Any], default_model_type: str) -> dict[str, Any]:
    """The language model's config: ``text_config`` over the top-level keys, rope settings in core's terms
    (Qwen2.5-VL's ``"mrope"`` rope type is the default rotation; its sections are read apart)."""
    # The top level's model_type names the whole model; the language model's is text_config's, or the family's.
    config = {key: value for key, value in hf_config.items() if key not in ("text_config", "vision_config")}
    config["model_type"] = default_model_type
    config.update(hf_config.get("text_config") or {})
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if isinstance(rope, dict) and "mrope" in (rope.get("rope_type"), rope.get("type")):
            config[key] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "default"}
    return config


class VisionLanguageSettings(LlamaSettings):
    """The language model's settings (:class:`weft.api.LlamaSettings`), with the checkpoint's whole config."""

    def __init__(self, hf_config: dict[str, Any], default_model_type: str, layout: Any) -> None:
        text = text_config(hf_config, default_model_type)
        model_type = text["model_type"]
        if model_type not in TEXT_ARCHITECTURES:
            raise ValueError(
                f"text_config.model_type = {model_type!r}: the vision-language families build a language model of "
                f"type {sorted(TEXT_ARCHITECTURES)}"
            )
        super().__init__(text, TEXT_ARCHITECTURES[model_type], layout)
        self.hf_config = hf_config
        self.text_config = text
        self.vision_config: dict[str, Any] = hf_config.get("vision_config") or {}


class VisionLanguageModel(LlamaForCausalLM):
    """Core's Llama with a vision part: a subclass adds its vision modules in :meth:`build_vision`."""

    def __init__(self, settings: VisionLanguageSettings, max_positions: int) -> None:
        super().__init__(settings, max_positions)
        self.build_vision(settings)

    def build_vision(self, settings: VisionLanguageSettings) -> None:
        raise NotImplementedError

    def encode_item(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One item's ``[num_embeddings, hidden]`` rows from its encoder inputs."""
        raise NotImplementedError


class VisionLanguageFamily(LlamaFamily):
    """A vision-language family on core's Llama (module docstring); a subclass sets the class attributes."""

    settings_class: ClassVar[type[VisionLanguageSettings]] = VisionLanguageSettings
    module_class: ClassVar[type[VisionLanguageModel]]
    default_text_model_type: ClassVar[str] = "llama"
    renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    """``(checkpoint prefix, module prefix)``, the first that matches a name applies."""
    vision_prefixes: ClassVar[tuple[str, ...]] = ()
    """Module prefixes of the vision part's parameters (copied whole, not through the Llama layout)."""

    def settings(self, config: ModelConfig) -> VisionLanguageSettings:
        return self.settings_class(config.hf_config, self.default_text_model_type, config.parallel)

    def check_parallel(self, config: ModelConfig) -> None:
        super().check_parallel(config)
        if config.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                f"engine.pipeline_parallel_size = {config.parallel.pipeline_parallel_size}: {config.architecture} "
                f"keeps its vision tower beside the first layers and is not split into stages; set it to 1"
            )

    def build(self, config: ModelConfig, device: torch.device) -> VisionLanguageModel:
        settings = self.settings(config)
        with torch.device(device), default_dtype(getattr(torch, config.dtype)):
            module = self.module_class(settings, config.max_model_len)
        module.model.rotary.to(device)
        return module.eval()

    def encode(self, module: nn.Module, items: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [module.encode_item(item) for item in items]

    def rename(self, name: str) -> str:
        for prefix, target in self.renames:
            if name.startswith(prefix):
                return target + name[len(prefix) :]
        return name

    def load_weights(self, module: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(module, ((self.rename(name), tensor) for name, tensor in weights))

    def load_other_tensor(self, module: nn.Module, name: str, tensor: Any, filled: set[str]) -> bool:
        if not name.startswith(self.vision_prefixes):
            return False
        try:
            target = module.get_parameter(name).data
        except AttributeError:
            raise ValueError(
                f"checkpoint tensor {name!r} has no parameter in {type(module).__name__}'s vision part"
            ) from None
        source = as_slice(tensor).load()
        if target.shape != source.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(source.shape)}, expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(source)
        filled.add(name)
        return True


class Linear(nn.Linear):
    """``nn.Linear`` without random initialisation (the checkpoint fills it)."""

    def reset_parameters(self) -> None:
        pass


class Conv2d(nn.Conv2d):
    def reset_parameters(self) -> None:
        pass


class Conv3d(nn.Conv3d):
    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Bidirectional attention of ``[batch, tokens, heads, dim]`` tensors -> ``[batch, tokens, heads * dim]``."""
    output = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scale
    )
    return output.transpose(1, 2).flatten(2)
