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
renormalised and multiplied by ``routed_scaling_factor``, plus shared experts: core's shared ``moe`` op
(:class:`~weft.layers.moe.FusedMoE`). The router runs in float32 as HF's does (its weight and bias stay
float32 whatever the runtime dtype).

Tensor parallelism: each rank holds its query heads and their rows of ``kv_b_proj`` (so its heads' keys
and values), its columns of the dense MLPs, of the shared experts and of every routed expert, and its
share of the vocabulary; the latent projection, its norm and the router are replicated, so every rank
caches the same latents. With ``engine.enable_expert_parallel`` the routed experts are spread whole over
the tensor ranks and the tokens exchanged (:class:`~weft.layers.moe.ExpertParallelExchange`). One pipeline
stage. Checkpoints as published (FP8 blocks with ``weight_scale_inv``) are refused: dequantize first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weft.contracts.kv_cache import KVCacheGroupSpec, KVCacheSpec, LatentAttentionSpec
from weft.contracts.loader import as_slice
from weft.contracts.model import ModelConfig, ModelFamily
from weft.contracts.parallel import ParallelLayout, check_heads
from weft.layers.attention import ForwardContext
from weft.layers.linear import Linear, default_dtype
from weft.layers.moe import FusedMoE, MoERouting, check_expert_layout
from weft.layers.norm import RMSNorm
from weft.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters, yarn_mscale
from weft.layers.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    copy_checked,
)


class DeepseekV3Settings:
    """The numbers of one checkpoint's config, with HF's defaults."""

    def __init__(self, config: dict[str, Any], layout: ParallelLayout | None = None) -> None:
        self.layout = layout or ParallelLayout()
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
        self.routing = MoERouting(
            top_k=self.top_k,
            scoring="sigmoid",
            renormalize=self.norm_topk_prob,
            num_groups=self.num_groups,
            topk_groups=self.top_k_groups,
            scaling=self.routed_scaling_factor,
        )
        self.local_heads = self.num_heads // self.layout.tensor_parallel_size

    def check(self) -> None:
        """Raise ValueError, with the numbers and the fix, for a layout this checkpoint cannot take."""
        layout, tp = self.layout, self.layout.tensor_parallel_size
        if layout.pipeline_parallel_size > 1:
            raise ValueError(
                f"engine.pipeline_parallel_size = {layout.pipeline_parallel_size}: DeepseekV3ForCausalLM runs one "
                f"pipeline stage; set it to 1 (engine.tensor_parallel_size and expert parallelism split the model)"
            )
        check_heads("attention heads", self.num_heads, tp)
        widths = [("intermediate_size", self.intermediate_size)] if self.first_dense else []
        if self.num_shared_experts:
            widths.append(("shared experts' width", self.moe_intermediate_size * self.num_shared_experts))
        for name, width in widths:
            if width % tp:
                raise ValueError(
                    f"engine.tensor_parallel_size = {tp} does not divide the model's {name} {width}; "
                    f"use a tensor_parallel_size that divides it"
                )
        check_expert_layout(self.num_experts, self.moe_intermediate_size, layout)

    def head_rows(self, head_dim: int) -> Shard:
        """This rank's rows of a projection that stacks every head's ``head_dim`` outputs."""
        return Shard(self.layout.tensor_rank * self.local_heads * head_dim, self.local_heads * head_dim)

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
    """Multi-head latent attention over a cache of latents and rotated keys, in the absorbed form; this rank's
    heads (the latent and the rotated key, shared by all heads, are computed on every rank)."""

    def __init__(self, settings: DeepseekV3Settings, index: int) -> None:
        super().__init__()
        s = settings
        self.settings = s
        self.layer_name = layer_name(index)
        self.num_heads = s.local_heads
        self.qk_head_dim = s.qk_nope_head_dim + s.qk_rope_head_dim
        query_rows = s.head_rows(self.qk_head_dim)
        if s.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(s.hidden_size, [query_rows], bias=False)
        else:
            self.q_a_proj = Linear(s.hidden_size, s.q_lora_rank, bias=s.attention_bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, s.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(s.q_lora_rank, [query_rows], bias=False)
        self.kv_a_proj_with_mqa = Linear(s.hidden_size, s.entry_dim, bias=s.attention_bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, s.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            s.kv_lora_rank, [s.head_rows(s.qk_nope_head_dim + s.v_head_dim)], bias=False
        )
        self.o_proj = RowParallelLinear(s.head_rows(s.v_head_dim), s.hidden_size, bias=s.attention_bias)
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
    """The gated SiLU MLP of the dense layers and of the shared experts (gate and up stacked): this rank's
    columns. ``reduce=False`` (the shared experts) returns this rank's partial sum, which the MoE adds to its
    own before its one collective."""

    def __init__(self, settings: DeepseekV3Settings, intermediate_size: int, reduce: bool = True) -> None:
        super().__init__()
        tp = settings.layout.tensor_parallel_size
        self.intermediate_size = intermediate_size // tp
        columns = Shard(settings.layout.tensor_rank * self.intermediate_size, self.intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(settings.hidden_size, [columns, columns], bias=False)
        self.down_proj = RowParallelLinear(columns, settings.hidden_size, bias=False, reduce=reduce)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DeepseekV3Router(nn.Module):
    """The router's logits in float32 (its weight and score-correction bias stay float32, as HF keeps them);
    the grouped top-k on them is the ``moe`` op's (``settings.routing``)."""

    def __init__(self, settings: DeepseekV3Settings) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(settings.num_experts, settings.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(settings.num_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)


class DeepseekV3MoE(nn.Module):
    """Routed experts (:class:`~weft.layers.moe.FusedMoE`: this rank's experts, or its columns of every expert)
    plus the shared experts, whose partial sum joins the routed one before the collective that completes both."""

    def __init__(self, settings: DeepseekV3Settings) -> None:
        super().__init__()
        s = settings
        self.gate = DeepseekV3Router(s)
        self.experts = FusedMoE(s.num_experts, s.hidden_size, s.moe_intermediate_size, s.routing)
        self.shared_experts = (
            DeepseekV3MLP(s, s.moe_intermediate_size * s.num_shared_experts, reduce=False)
            if s.num_shared_experts
            else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.gate(self.experts.own_rows(hidden))
        shared = None if self.shared_experts is None else self.shared_experts(hidden)
        return self.experts(hidden, logits, self.gate.e_score_correction_bias, shared=shared)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, settings: DeepseekV3Settings, index: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV3Attention(settings, index)
        dense = index < settings.first_dense
        self.mlp = DeepseekV3MLP(settings, settings.intermediate_size) if dense else DeepseekV3MoE(settings)
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
        self.embed_tokens = VocabParallelEmbedding(settings.vocab_size, settings.hidden_size)
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
        self.lm_head = ParallelLMHead(settings.hidden_size, settings.vocab_size)
        if settings.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, context)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


# Checkpoint name part -> (our stacked parameter, which half).
_STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_EXPERT = re.compile(r"^(?P<block>model\.layers\.\d+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)_proj\.weight$")
"""One routed expert's tensor (``model.layers.3.mlp.experts.17.gate_proj.weight``): its part is
:meth:`FusedMoE.load_expert`'s (``gate``, ``up``, ``down``)."""


class DeepseekV3Family(ModelFamily):
    """``DeepseekV3ForCausalLM``: multi-head latent attention with a latent KV cache, dense then MoE layers."""

    reads_weight_slices = True

    def settings(self, config: ModelConfig) -> DeepseekV3Settings:
        return DeepseekV3Settings(config.hf_config, config.parallel)

    def check_parallel(self, config: ModelConfig) -> None:
        self.settings(config).check()

    def kv_cache_groups(self, config: ModelConfig) -> tuple[KVCacheGroupSpec, ...]:
        settings = self.settings(config)
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
        settings = self.settings(config)
        with torch.device(device), default_dtype(getattr(torch, config.dtype)):
            module = DeepseekV3ForCausalLM(settings, config.max_model_len)
        module.model.rotary.to(device)
        return module.eval()

    def load_weights(self, module: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
        """Whole tensors or :class:`~weft.contracts.loader.WeightSlice` objects; each rank copies (and reads) its
        part: its heads, its columns, its experts."""
        settings: DeepseekV3Settings = module.settings
        parameters = dict(module.named_parameters(remove_duplicate=False))
        filled: set[str] = set()
        expert_tensors: dict[str, int] = {}
        for name, tensor in weights:
            if name.endswith("weight_scale_inv"):
                raise ValueError(
                    f"checkpoint tensor {name!r}: FP8 block-quantized DeepSeek V3 checkpoints are not supported; "
                    f"load a bfloat16 conversion of the checkpoint"
                )
            if "rotary_emb.inv_freq" in name or _layer_index(name) >= settings.num_layers:
                continue  # the multi-token-prediction layers after the last one serve speculative decoding
            expert = _EXPERT.match(name)
            if expert is not None and f"{expert['block']}.gate_up_proj" in parameters:
                block: FusedMoE = module.get_submodule(expert["block"])
                block.load_expert(int(expert["expert"]), expert["part"], tensor, name)
                expert_tensors[expert["block"]] = expert_tensors.get(expert["block"], 0) + 1
                continue
            target, index = _target(name)
            if target not in parameters:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(module).__name__}")
            owner_name, _, parameter = target.rpartition(".")
            loader = getattr(module.get_submodule(owner_name), "load_checkpoint_tensor", None)
            if loader is not None:
                loader(parameter, tensor, name, index or 0)
            else:
                copy_checked(parameters[target].data, as_slice(tensor).load(), name)
            filled.add(target if index is None else f"{target}#{index}")
        for block_name, block in module.named_modules():
            if isinstance(block, FusedMoE):
                expected = 3 * block.num_experts
                if expert_tensors.get(block_name, 0) != expected:
                    raise ValueError(
                        f"the checkpoint has {expert_tensors.get(block_name, 0)} expert tensor(s) for {block_name}, "
                        f"expected {expected} (gate, up and down of {block.num_experts} experts)"
                    )
                filled.update(f"{block_name}.{parameter}" for parameter, _ in block.named_parameters())
        expected = {
            name if index is None else f"{name}#{index}"
            for name in parameters
            for index in ((0, 1) if name.endswith("gate_up_proj.weight") else (None,))
        }
        if settings.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameter(s), e.g. {missing[:3]}")


def _target(name: str) -> tuple[str, int | None]:
    """Our parameter for checkpoint tensor ``name`` and the stacked part it fills (None: all of it)."""
    for checkpoint_part, (stacked, index) in _STACKED.items():
        if f".{checkpoint_part}." in name:
            return name.replace(checkpoint_part, stacked), index
    return name, None


def _layer_index(name: str) -> int:
    """``model.layers.7.mlp.up_proj.weight`` -> 7; -1 outside the layers."""
    return int(name.split(".")[2]) if name.startswith("model.layers.") else -1
