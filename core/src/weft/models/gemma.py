"""The Gemma 2 and Gemma 3 (text) family, following Hugging Face's ``modeling_gemma2.py`` and ``modeling_gemma3.py``.

What sets Gemma apart from the Llama family it borrows its sharded layers and weight mapping from:
- embeddings scaled by ``sqrt(hidden_size)``, the factor rounded to the model's dtype as HF does;
- RMSNorm multiplying by ``1 + weight`` in float32, and four norms per layer (before and after
  attention, before and after the MLP), each sub-block's output normed before the residual add;
- a GELU (tanh) gated MLP;
- attention scaled by ``query_pre_attn_scalar ** -0.5`` rather than the head size;
- local (sliding window) and global layers alternating as ``layer_types`` says (Gemma 2: every
  other layer; Gemma 3: five local to one global by default);
- Gemma 2: attention scores and final logits soft-capped (``cap * tanh(x / cap)``);
- Gemma 3: q/k norms, and two rope bases: ``rope_local_base_freq`` for local layers, ``rope_theta``
  (with its scaling) for global ones.

Tensor parallelism shards as the Llama family does; pipeline parallelism is refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weft.contracts.attention import AttentionLayer
from weft.contracts.model import ModelConfig
from weft.contracts.parallel import ParallelLayout
from weft.layers.attention import Attention, ForwardContext
from weft.layers.linear import default_dtype
from weft.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from weft.layers.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
)
from weft.models.llama import LlamaFamily, LlamaSettings, layer_name

_DEFAULT_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
"""Every how many layers a global one comes when the config has no ``layer_types`` (HF's defaults)."""


class GemmaSettings(LlamaSettings):
    """Llama's numbers plus Gemma's: soft caps, the attention scale, local/global layers and their rope bases."""

    def __init__(self, config: dict[str, Any], architecture: str, layout: ParallelLayout | None = None) -> None:
        if config.get("use_bidirectional_attention"):
            raise ValueError(
                "use_bidirectional_attention = true (an embedding model) is not supported: Weft decodes causally; "
                "serve a causal Gemma checkpoint"
            )
        pattern = config.get("sliding_window_pattern") or _DEFAULT_PATTERN[architecture]
        layers = config["num_hidden_layers"]
        self.layer_types = config.get("layer_types") or [
            "sliding_attention" if (index + 1) % pattern else "full_attention" for index in range(layers)
        ]
        super().__init__({**config, "layer_types": self.layer_types}, architecture, layout)
        self.gemma3 = architecture == "Gemma3ForCausalLM"
        self.tie_word_embeddings = config.get("tie_word_embeddings", True)
        self.attention_bias = config.get("attention_bias", False)
        self.scale = float(config.get("query_pre_attn_scalar", 256)) ** -0.5
        default_cap = 50.0 if not self.gemma3 else None
        self.attention_soft_cap = config.get("attn_logit_softcapping", default_cap)
        self.final_soft_cap = config.get("final_logit_softcapping", 30.0 if not self.gemma3 else None)
        activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"hidden_activation {activation!r} is not supported; Gemma uses 'gelu_pytorch_tanh'")
        self.gelu_approximate = "tanh" if activation == "gelu_pytorch_tanh" else "none"
        self.qk_norm = self.gemma3
        self.ropes = self._ropes(config)

    def _ropes(self, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Rope settings per layer type: one for both in Gemma 2, a local and a global base in Gemma 3."""
        if not self.gemma3:
            parameters = rope_parameters(config)
            return {"sliding_attention": parameters, "full_attention": parameters}
        nested = config.get("rope_parameters") or {}
        if "full_attention" in nested:  # transformers 5 writes one entry per layer type
            return {kind: {"rope_type": "default", **nested[kind]} for kind in ("sliding_attention", "full_attention")}
        full = rope_parameters({**config, "rope_theta": config.get("rope_theta", 1_000_000.0)})
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
        return {"sliding_attention": local, "full_attention": full}


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, all in float32, then cast back (HF's ``Gemma2RMSNorm``)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, settings: GemmaSettings, index: int) -> None:
        super().__init__()
        s = settings
        self.layer_type = s.layer_types[index]
        self.num_heads, self.num_kv_heads, self.head_dim = s.local_heads, s.local_kv_heads, s.head_dim
        self.q_size, self.kv_size = self.num_heads * s.head_dim, self.num_kv_heads * s.head_dim
        query = Shard(s.layout.tensor_rank * self.q_size, self.q_size)
        key_value = Shard(s.first_kv_head * s.head_dim, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(s.hidden_size, [query, key_value, key_value], bias=s.attention_bias)
        self.o_proj = RowParallelLinear(query, s.hidden_size, bias=s.attention_bias)
        self.q_norm = GemmaRMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        self.k_norm = GemmaRMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        spec = AttentionLayer(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=s.head_dim,
            scale=s.scale,
            sliding_window=s.sliding_windows[index],
            logits_soft_cap=s.attention_soft_cap,
        )
        self.attn = Attention(layer_name(index), 0, spec)

    def forward(
        self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(tokens, self.num_heads, self.head_dim)
        key = key.view(tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = apply_rotary(query, key, *rotary)
        output = self.attn(query, key, value, context)
        return self.o_proj(output.reshape(tokens, self.q_size))


class GemmaMLP(nn.Module):
    def __init__(self, settings: GemmaSettings) -> None:
        super().__init__()
        self.intermediate_size = settings.local_intermediate
        columns = Shard(settings.layout.tensor_rank * self.intermediate_size, self.intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(settings.hidden_size, [columns, columns], bias=False)
        self.down_proj = RowParallelLinear(columns, settings.hidden_size, bias=False)
        self.approximate = settings.gelu_approximate

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, settings: GemmaSettings, index: int) -> None:
        super().__init__()
        size, eps = settings.hidden_size, settings.rms_norm_eps
        self.self_attn = GemmaAttention(settings, index)
        self.mlp = GemmaMLP(settings)
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        attended = self.self_attn(rotary, self.input_layernorm(hidden), context)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(nn.Module):
    def __init__(self, settings: GemmaSettings, max_positions: int) -> None:
        super().__init__()
        self.layer_types = settings.layer_types
        self.embed_tokens = VocabParallelEmbedding(settings.vocab_size, settings.hidden_size)
        # HF multiplies by the factor cast to the weights' dtype (sqrt(2304) = 48.0 is exact, sqrt(640) is not).
        self.register_buffer(
            "normalizer",
            torch.tensor(settings.hidden_size**0.5, dtype=torch.float32).to(self.embed_tokens.weight.dtype),
            persistent=False,
        )
        self.layers = nn.ModuleList(GemmaDecoderLayer(settings, index) for index in range(settings.num_layers))
        self.norm = GemmaRMSNorm(settings.hidden_size, settings.rms_norm_eps)
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(settings.head_dim, max_positions, settings.ropes[kind])
                for kind in set(self.layer_types)
            }
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.normalizer
        tables = {kind: rotary.table(positions, hidden.dtype) for kind, rotary in self.rotary.items()}
        for kind, layer in zip(self.layer_types, self.layers, strict=False):
            hidden = layer(tables[kind], hidden, context)
        return self.norm(hidden)


class GemmaForCausalLM(nn.Module):
    def __init__(self, settings: GemmaSettings, max_positions: int) -> None:
        super().__init__()
        self.settings = settings
        self.dtype = torch.get_default_dtype()
        self.model = GemmaModel(settings, max_positions)
        self.lm_head = ParallelLMHead(settings.hidden_size, settings.vocab_size)
        if settings.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, context)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.settings.final_soft_cap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class GemmaFamily(LlamaFamily):
    """Gemma 2 and Gemma 3 (text-only ``Gemma3ForCausalLM``) decoders; weights load as the Llama family's."""

    splits_decode_batches = False  # its own layers, not the Llama family's stages

    def check_parallel(self, config: ModelConfig) -> None:
        super().check_parallel(config)
        if config.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                f"engine.pipeline_parallel_size = {config.parallel.pipeline_parallel_size}: {config.architecture} "
                f"runs in one pipeline stage; set it to 1 (tensor parallelism is supported)"
            )

    def build(self, config: ModelConfig, device: torch.device) -> GemmaForCausalLM:
        settings = GemmaSettings(config.hf_config, config.architecture, config.parallel)
        with torch.device(device), default_dtype(getattr(torch, config.dtype)):
            module = GemmaForCausalLM(settings, config.max_model_len)
        module.model.rotary.to(device)
        return module.eval()
