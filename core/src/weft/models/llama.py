"""The Llama family: Llama 2/3 (llama3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM2.

One file, top to bottom, following Hugging Face's ``modeling_llama.py``; the
projections q/k/v and gate/up are stacked into one matrix each, and attention
goes through the paged :class:`weft.layers.attention.Attention`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weft.contracts.attention import AttentionLayer
from weft.contracts.kv_cache import FullAttentionSpec, KVCacheGroupSpec
from weft.contracts.model import ModelConfig, ModelFamily
from weft.layers.attention import Attention, ForwardContext
from weft.layers.linear import Embedding, Linear, default_dtype
from weft.layers.norm import RMSNorm
from weft.layers.ops import current_op
from weft.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters


class LlamaSettings:
    """The numbers of one checkpoint's config, with each family's defaults."""

    def __init__(self, config: dict[str, Any], architecture: str) -> None:
        self.hidden_size = config["hidden_size"]
        self.num_layers = config["num_hidden_layers"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or self.hidden_size // self.num_heads
        self.intermediate_size = config["intermediate_size"]
        self.vocab_size = config["vocab_size"]
        self.rms_norm_eps = config.get("rms_norm_eps", 1e-6)
        self.tie_word_embeddings = config.get("tie_word_embeddings", False)
        self.max_position_embeddings = config.get("max_position_embeddings", 4096)
        self.rope = rope_parameters(config)
        qwen2 = architecture == "Qwen2ForCausalLM"
        self.attention_bias = config.get("attention_bias", qwen2)
        self.mlp_bias = config.get("mlp_bias", False)
        self.qk_norm = architecture == "Qwen3ForCausalLM"
        self.sliding_windows = self._sliding_windows(config, architecture)

    def _sliding_windows(self, config: dict[str, Any], architecture: str) -> list[int | None]:
        window = config.get("sliding_window")
        layer_types = config.get("layer_types")
        if layer_types:
            return [window if kind == "sliding_attention" else None for kind in layer_types]
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            if not config.get("use_sliding_window", False):
                return [None] * self.num_layers
            first = config.get("max_window_layers", self.num_layers)
            return [window if index >= first else None for index in range(self.num_layers)]
        return [window] * self.num_layers


class LlamaAttention(nn.Module):
    def __init__(self, settings: LlamaSettings, index: int) -> None:
        super().__init__()
        s = settings
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_size, self.kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.qkv_proj = Linear(s.hidden_size, self.q_size + 2 * self.kv_size, bias=s.attention_bias)
        self.o_proj = Linear(self.q_size, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        spec = AttentionLayer(
            num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
            scale=s.head_dim**-0.5, sliding_window=s.sliding_windows[index],
        )
        self.attn = Attention(layer_name(index), 0, spec)
        self.rotary = current_op("rotary")
        if self.rotary is not None:
            self.rotary.declare(num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, dtype=self.o_proj.weight.dtype)

    def forward(self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(tokens, self.num_heads, self.head_dim)
        key = key.view(tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = (self.rotary or apply_rotary)(query, key, *rotary)
        output = self.attn(query, key, value, context)
        return self.o_proj(output.reshape(tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, settings: LlamaSettings) -> None:
        super().__init__()
        self.intermediate_size = settings.intermediate_size
        self.gate_up_proj = Linear(settings.hidden_size, 2 * settings.intermediate_size, bias=settings.mlp_bias)
        self.down_proj = Linear(settings.intermediate_size, settings.hidden_size, bias=settings.mlp_bias)
        self.act = current_op("silu_and_mul")
        if self.act is not None:
            self.act.declare(width=settings.intermediate_size, dtype=self.down_proj.weight.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)
        if self.act is not None:
            return self.down_proj(self.act(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, settings: LlamaSettings, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(settings, index)
        self.mlp = LlamaMLP(settings)
        self.input_layernorm = RMSNorm(settings.hidden_size, settings.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(settings.hidden_size, settings.rms_norm_eps)

    def forward(
        self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, residual: torch.Tensor | None,
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream before it)``; the next norm adds them (fused)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rotary, hidden, context)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, settings: LlamaSettings, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(settings.vocab_size, settings.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(settings, index) for index in range(settings.num_layers))
        self.norm = RMSNorm(settings.hidden_size, settings.rms_norm_eps)
        self.rotary = RotaryEmbedding(settings.head_dim, max_positions, settings.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rotary = self.rotary.table(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rotary, hidden, residual, context)
        return self.norm(hidden, residual)[0] if residual is not None else self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, settings: LlamaSettings, max_positions: int) -> None:
        super().__init__()
        self.settings = settings
        self.model = LlamaModel(settings, max_positions)
        self.lm_head = Linear(settings.hidden_size, settings.vocab_size, bias=False)
        if settings.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, context)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn"


# Checkpoint name -> (our parameter, slice index within the stacked matrix).
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaFamily(ModelFamily):
    """Llama-architecture decoders: Llama, Mistral, Qwen2, Qwen3, SmolLM2."""

    def kv_cache_groups(self, config: ModelConfig) -> tuple[KVCacheGroupSpec, ...]:
        settings = LlamaSettings(config.hf_config, config.architecture)
        spec = FullAttentionSpec(
            block_size=config.block_size, dtype=config.dtype, num_kv_heads=settings.num_kv_heads, head_dim=settings.head_dim
        )
        return (KVCacheGroupSpec("attention", tuple(layer_name(i) for i in range(settings.num_layers)), spec),)

    def build(self, config: ModelConfig, device: torch.device) -> LlamaForCausalLM:
        settings = LlamaSettings(config.hf_config, config.architecture)
        # Weft's Linear and Embedding skip random initialisation (load_weights fills every
        # parameter), so building directly on the device in the runtime dtype costs nothing.
        with torch.device(device), default_dtype(getattr(torch, config.dtype)):
            module = LlamaForCausalLM(settings, config.max_model_len)
        module.model.rotary.to(device)
        return module.eval()

    def load_weights(self, module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        parameters = dict(module.named_parameters())
        settings: LlamaSettings = module.settings
        sizes = {
            "qkv_proj": [settings.num_heads * settings.head_dim] + [settings.num_kv_heads * settings.head_dim] * 2,
            "gate_up_proj": [settings.intermediate_size] * 2,
        }
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and settings.tie_word_embeddings:
                continue
            target, shard = name, None
            for checkpoint_part, (stacked, index) in _STACKED.items():
                if f".{checkpoint_part}." in name:
                    target, shard = name.replace(checkpoint_part, stacked), index
                    break
            if target not in parameters:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(module).__name__}")
            parameter = parameters[target]
            with torch.no_grad():
                if shard is None:
                    _copy(parameter.data, tensor, name)
                    filled.add(target)
                else:
                    split = sizes[target.split(".")[-2]]
                    offset = sum(split[:shard])
                    _copy(parameter.data.narrow(0, offset, split[shard]), tensor, name)
                    filled.add(f"{target}#{shard}")
        expected = set()
        for name in parameters:
            stacked = name.split(".")[-2]
            if stacked in sizes:
                expected |= {f"{name}#{i}" for i in range(len(sizes[stacked]))}
            else:
                expected.add(name)
        if settings.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameter(s), e.g. {missing[:3]}")


def _copy(destination: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if destination.shape != source.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(source.shape)}, expected {tuple(destination.shape)}")
    destination.copy_(source)
