"""The DeepSeek V3 family (``DeepseekV3ForCausalLM``: V3, V3.1, R1 and their distillations of this shape),
following Hugging Face's ``modeling_deepseek_v3.py``.

Multi-head latent attention (MLA). Queries go through a low-rank bottleneck (``q_a_proj``, its norm,
``q_b_proj``; or one ``q_proj`` without ``q_lora_rank``) and split into a part without position
(``qk_nope_head_dim``) and a rotated part (``qk_rope_head_dim``). Keys and values of every head come
from one latent per token (``kv_lora_rank``, normed) through ``kv_b_proj``, and one rotated key part is
shared by all heads. The KV cache holds only the latent and the rotated key
(:class:`~weft.contracts.kv_cache.LatentAttentionSpec`), and attention runs in the absorbed form: each
query's position-free part is taken into the latent space through ``kv_b_proj``'s key half, scores are
taken against the latents, and the weighted latents leave through its value half; equal, up to rounding,
to expanding every cached latent into keys and values as HF does. Rope is yarn-scaled, its mscale also
scaling the softmax (``mscale_all_dim``), and interleaved by default (``rope_interleave``).

The first ``first_k_dense_replace`` layers have a dense MLP, the others a mixture of experts: sigmoid
scores, expert choice among the ``topk_group`` best of ``n_group`` groups (a group scores by its two best
experts) on scores plus ``e_score_correction_bias``, weights taken from the scores without the bias,
renormalised and multiplied by ``routed_scaling_factor``, plus shared experts. The router runs in float32
as HF's does (its weight and bias stay float32 whatever the runtime dtype).

One device only. Checkpoints as published (FP8 blocks with ``weight_scale_inv``) are refused: dequantize first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weft.contracts.kv_cache import KVCacheGroupSpec, KVCacheSpec, LatentAttentionSpec
from weft.contracts.loader import as_slice
from weft.contracts.model import ModelConfig, ModelFamily
from weft.layers.attention import ForwardContext
from weft.layers.linear import Embedding, Linear, default_dtype
from weft.layers.norm import RMSNorm
from weft.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters, yarn_mscale
from weft.layers.tensor_parallel import copy_checked


class DeepseekV3Settings:
    """The numbers of one checkpoint's config, with HF's defaults."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.hidden_size = config["hidden_size"]
        self.num_layers = config["num_hidden_layers"]
        self.num_heads = config["num_attention_heads"]
        self.vocab_size = config["vocab_size"]
        self.rms_norm_eps = config.get("rms_norm_eps", 1e-6)
        self.tie_word_embeddings = config.get("tie_word_embeddings", False)
        self.q_lora_rank = config.get("q_lora_rank")
        self.kv_lora_rank = config["kv_lora_rank"]
        self.qk_nope_head_dim = config["qk_nope_head_dim"]
        self.qk_rope_head_dim = config["qk_rope_head_dim"]
        self.v_head_dim = config["v_head_dim"]
        self.attention_bias = config.get("attention_bias", False)
        self.rope_interleave = config.get("rope_interleave", True)
        self.rope = rope_parameters(config)
        self.rope.setdefault("max_position_embeddings", config.get("max_position_embeddings", 4096))
        self.scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope["rope_type"] != "default" and self.rope.get("mscale_all_dim"):
            self.scale *= yarn_mscale(self.rope["factor"], self.rope["mscale_all_dim"]) ** 2
        self.intermediate_size = config["intermediate_size"]
        self.moe_intermediate_size = config["moe_intermediate_size"]
        self.num_experts = config["n_routed_experts"]
        self.num_shared_experts = config.get("n_shared_experts") or 0
        self.top_k = config["num_experts_per_tok"]
        self.num_groups = config.get("n_group") or 1
        self.top_k_groups = config.get("topk_group") or 1
        self.norm_topk_prob = config.get("norm_topk_prob", True)
        self.routed_scaling_factor = config.get("routed_scaling_factor", 1.0)
        self.first_dense = config.get("first_k_dense_replace", 0)
        activation = config.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"hidden_act {activation!r} is not supported; DeepSeek V3 uses 'silu'")
        scoring = config.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"scoring_func {scoring!r} is not supported; DeepSeek V3 routes on 'sigmoid' scores")
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_routed_experts {self.num_experts} is not a multiple of n_group {self.num_groups}")

    @property
    def entry_dim(self) -> int:
        """Elements one token stores per layer: its latent and its rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn"


class LatentStep:
    """What every attention layer of one step needs of the batch, read from the host once per step: each
    request's query rows, its cache blocks and which of its positions each query sees (causal)."""

    def __init__(self, context: ForwardContext, device: torch.device) -> None:
        batch = context.batches[0]
        query_start, seq_lens = batch.query_start.tolist(), batch.seq_lens.tolist()
        self.slots = batch.slot_mapping.long()
        self.requests: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []
        for row, seq_len in enumerate(seq_lens):
            first, last = query_start[row], query_start[row + 1]
            if first == last:
                continue
            blocks = batch.block_table[row, : -(-seq_len // batch.block_size)].long()
            query_positions = torch.arange(seq_len - (last - first), seq_len, device=device)
            visible = torch.arange(seq_len, device=device) <= query_positions.unsqueeze(1)
            self.requests.append((first, last, seq_len, blocks, visible))


def apply_interleaved_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout), writing the results de-interleaved as HF does
    (evens' results then odds'; queries and keys alike, so their products are unchanged)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]

    def turn(x: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)

    return turn(query), turn(key)


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention over a cache of latents and rotated keys, in the absorbed form."""

    def __init__(self, settings: DeepseekV3Settings, index: int) -> None:
        super().__init__()
        s = settings
        self.settings = s
        self.layer_name = layer_name(index)
        self.num_heads = s.num_heads
        self.qk_head_dim = s.qk_nope_head_dim + s.qk_rope_head_dim
        if s.q_lora_rank is None:
            self.q_proj = Linear(s.hidden_size, s.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(s.hidden_size, s.q_lora_rank, bias=s.attention_bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, s.rms_norm_eps)
            self.q_b_proj = Linear(s.q_lora_rank, s.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(s.hidden_size, s.entry_dim, bias=s.attention_bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, s.rms_norm_eps)
        self.kv_b_proj = Linear(s.kv_lora_rank, s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), bias=False)
        self.o_proj = Linear(s.num_heads * s.v_head_dim, s.hidden_size, bias=s.attention_bias)
        self.rotate = apply_interleaved_rotary if s.rope_interleave else apply_rotary

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        context: ForwardContext,
        step: LatentStep,
    ) -> torch.Tensor:
        s, tokens = self.settings, hidden.shape[0]
        query = (
            self.q_proj(hidden) if s.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        )
        query_nope, query_rope = query.view(tokens, self.num_heads, self.qk_head_dim).split(
            [s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1
        )
        latent, key_rope = self.kv_a_proj_with_mqa(hidden).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        query_rope, key_rope = self.rotate(query_rope, key_rope.unsqueeze(1), *rotary)

        cache = context.kv_caches[self.layer_name]  # [blocks, block_size, entry_dim]
        cache.view(-1, s.entry_dim).index_copy_(0, step.slots, torch.cat((latent, key_rope.squeeze(1)), dim=-1))

        # kv_b_proj's rows, per head: the key's position-free part, then the value.
        up = self.kv_b_proj.weight.view(self.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        key_up, value_up = up.split([s.qk_nope_head_dim, s.v_head_dim], dim=1)
        query_latent = torch.einsum("thn,hnc->thc", query_nope, key_up)
        output = query.new_empty(tokens, self.num_heads, s.v_head_dim)
        for first, last, seq_len, blocks, visible in step.requests:
            stored = cache.index_select(0, blocks).view(-1, s.entry_dim)[:seq_len]
            cached_latent, cached_rope = stored.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
            scores = (
                torch.einsum("thc,lc->htl", query_latent[first:last], cached_latent)
                + torch.einsum("thr,lr->htl", query_rope[first:last], cached_rope)
            ) * s.scale
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1, dtype=torch.float32).to(query.dtype)
            attended_latent = torch.einsum("htl,lc->thc", weights, cached_latent)
            output[first:last] = torch.einsum("thc,hvc->thv", attended_latent, value_up)
        return self.o_proj(output.reshape(tokens, self.num_heads * s.v_head_dim))


class DeepseekV3MLP(nn.Module):
    """The gated SiLU MLP of the dense layers and of the shared experts (gate and up stacked)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DeepseekV3Router(nn.Module):
    """Sigmoid scores, grouped top-k on the bias-corrected scores, weights from the plain scores (float32)."""

    def __init__(self, settings: DeepseekV3Settings) -> None:
        super().__init__()
        self.settings = settings
        self.weight = nn.Parameter(torch.zeros(settings.num_experts, settings.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(settings.num_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, top_k] float32, experts [T, top_k])``."""
        s = self.settings
        scores = F.linear(hidden.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(-1, s.num_groups, s.num_experts // s.num_groups).topk(2, dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(s.top_k_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        expert_mask = group_mask.repeat_interleave(s.num_experts // s.num_groups, dim=1)
        experts = choice.masked_fill(~expert_mask, float("-inf")).topk(s.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, experts


class DeepseekV3MoE(nn.Module):
    """Routed experts plus shared ones.

    The routing and the expert loop are plain torch here; when core's shared ``moe`` op lands, the lead
    switches this module to it (routing: sigmoid, grouped top-k with a score-correction bias, renormalised,
    scaled by ``routed_scaling_factor``; a shared expert added).
    """

    def __init__(self, settings: DeepseekV3Settings) -> None:
        super().__init__()
        size, width, count = settings.hidden_size, settings.moe_intermediate_size, settings.num_experts
        self.num_experts, self.width = count, width
        self.gate = DeepseekV3Router(settings)
        self.experts_gate_up = nn.Parameter(torch.empty(count, 2 * width, size))
        self.experts_down = nn.Parameter(torch.empty(count, size, width))
        self.shared_experts = (
            DeepseekV3MLP(size, width * settings.num_shared_experts) if settings.num_shared_experts else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(hidden)
        routed = torch.zeros_like(hidden)
        for expert in experts.unique().tolist():
            tokens, slot = torch.where(experts == expert)
            gate, up = F.linear(hidden[tokens], self.experts_gate_up[expert]).split(self.width, dim=-1)
            out = F.linear(F.silu(gate) * up, self.experts_down[expert]) * weights[tokens, slot, None]
            routed.index_add_(0, tokens, out.to(hidden.dtype))
        return routed if self.shared_experts is None else routed + self.shared_experts(hidden)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, settings: DeepseekV3Settings, index: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV3Attention(settings, index)
        dense = index < settings.first_dense
        self.mlp = DeepseekV3MLP(settings.hidden_size, settings.intermediate_size) if dense else DeepseekV3MoE(settings)
        self.input_layernorm = RMSNorm(settings.hidden_size, settings.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(settings.hidden_size, settings.rms_norm_eps)

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        context: ForwardContext,
        step: LatentStep,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(rotary, self.input_layernorm(hidden), context, step)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekV3Model(nn.Module):
    def __init__(self, settings: DeepseekV3Settings, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(settings.vocab_size, settings.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(settings, index) for index in range(settings.num_layers))
        self.norm = RMSNorm(settings.hidden_size, settings.rms_norm_eps)
        self.rotary = RotaryEmbedding(settings.qk_rope_head_dim, max_positions, settings.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rotary = self.rotary.table(positions, hidden.dtype)
        step = LatentStep(context, hidden.device)
        for layer in self.layers:
            hidden = layer(rotary, hidden, context, step)
        return self.norm(hidden)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, settings: DeepseekV3Settings, max_positions: int) -> None:
        super().__init__()
        self.settings = settings
        self.dtype = torch.get_default_dtype()
        self.model = DeepseekV3Model(settings, max_positions)
        self.lm_head = Linear(settings.hidden_size, settings.vocab_size, bias=False)
        if settings.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, context)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


# Checkpoint name part -> (our stacked parameter, which half).
_STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DeepseekV3Family(ModelFamily):
    """``DeepseekV3ForCausalLM``: multi-head latent attention with a latent KV cache, dense then MoE layers."""

    def kv_cache_groups(self, config: ModelConfig) -> tuple[KVCacheGroupSpec, ...]:
        settings = DeepseekV3Settings(config.hf_config)
        spec = LatentAttentionSpec(block_size=config.block_size, dtype=config.dtype, entry_dim=settings.entry_dim)
        return (KVCacheGroupSpec("latent", tuple(layer_name(i) for i in range(settings.num_layers)), spec),)

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...] | None:
        if isinstance(spec, LatentAttentionSpec):
            return (num_blocks, spec.block_size, spec.entry_dim)
        return super().kv_cache_shape(spec, num_blocks)

    def load_dtype(self, dtype: str) -> str:
        """float32: the router's weight and bias keep the checkpoint's precision (HF keeps them in float32)."""
        return "float32"

    def build(self, config: ModelConfig, device: torch.device) -> DeepseekV3ForCausalLM:
        settings = DeepseekV3Settings(config.hf_config)
        with torch.device(device), default_dtype(getattr(torch, config.dtype)):
            module = DeepseekV3ForCausalLM(settings, config.max_model_len)
        module.model.rotary.to(device)
        return module.eval()

    def load_weights(self, module: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
        settings: DeepseekV3Settings = module.settings
        parameters = dict(module.named_parameters(remove_duplicate=False))
        filled: set[str] = set()
        for name, tensor in weights:
            if name.endswith("weight_scale_inv"):
                raise ValueError(
                    f"checkpoint tensor {name!r}: FP8 block-quantized DeepSeek V3 checkpoints are not supported; "
                    f"load a bfloat16 conversion of the checkpoint"
                )
            if "rotary_emb.inv_freq" in name or _layer_index(name) >= settings.num_layers:
                continue  # the multi-token-prediction layers after the last one serve speculative decoding
            target, part = self._target(name)
            if target not in parameters:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(module).__name__}")
            destination = parameters[target].data
            if part is not None:
                destination = self._part(destination, target, part)
            copy_checked(destination, as_slice(tensor).load(), name)
            filled.add(target if part is None else f"{target}#{part}")
        expected = {
            name if part is None else f"{name}#{part}"
            for name, parameter in parameters.items()
            for part in _parts(name, parameter)
        }
        if settings.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameter(s), e.g. {missing[:3]}")

    @staticmethod
    def _target(name: str) -> tuple[str, Any]:
        """Our parameter for checkpoint tensor ``name`` and the part of it the tensor fills (None: all of it)."""
        pieces = name.split(".")
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight
            layer_prefix, expert, projection = ".".join(pieces[:4]), int(pieces[5]), pieces[6]
            if projection == "down_proj":
                return f"{layer_prefix}.experts_down", (expert, None)
            return f"{layer_prefix}.experts_gate_up", (expert, _STACKED[projection][1])
        for checkpoint_part, (stacked, half) in _STACKED.items():
            if f".{checkpoint_part}." in name:
                return name.replace(checkpoint_part, stacked), half
        return name, None

    @staticmethod
    def _part(destination: torch.Tensor, target: str, part: Any) -> torch.Tensor:
        if isinstance(part, tuple):
            expert, half = part
            destination = destination[expert]
            if half is None:
                return destination
        else:
            half = part
        rows = destination.shape[0] // 2
        return destination.narrow(0, half * rows, rows)


def _parts(name: str, parameter: torch.Tensor) -> list[Any]:
    """The parts of a parameter that checkpoint tensors fill (``[None]``: one tensor fills it whole)."""
    if name.endswith("gate_up_proj.weight"):
        return [0, 1]
    if name.endswith("experts_gate_up"):
        return [(expert, half) for expert in range(parameter.shape[0]) for half in (0, 1)]
    if name.endswith("experts_down"):
        return [(expert, None) for expert in range(parameter.shape[0])]
    return [None]


def _layer_index(name: str) -> int:
    """``model.layers.7.mlp.up_proj.weight`` -> 7; -1 outside the layers."""
    return int(name.split(".")[2]) if name.startswith("model.layers.") else -1
