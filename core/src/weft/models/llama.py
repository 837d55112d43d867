"""The Llama family: Llama 2/3 (llama3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM2.

One file, top to bottom, following Hugging Face's ``modeling_llama.py``; the
projections q/k/v and gate/up are stacked into one matrix each, and attention
goes through the paged :class:`weft.layers.attention.Attention`.

Tensor parallelism (:mod:`weft.layers.tensor_parallel`): each rank holds its query heads,
its key/value heads (replicated when the ranks outnumber them), its share of the MLP
columns and of the vocabulary, and reads only those from the checkpoint. Pipeline
parallelism: a stage builds its own layers (the others are empty placeholders, so
parameter names keep the checkpoint's), the first stage the embedding, the last the
final norm and the LM head; stages pass ``hidden`` and ``residual`` on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weft.contracts.attention import AttentionLayer
from weft.contracts.kv_cache import FullAttentionSpec, KVCacheGroupSpec
from weft.contracts.loader import as_slice
from weft.contracts.model import ModelConfig, ModelFamily
from weft.contracts.parallel import ParallelLayout, check_heads, head_range
from weft.layers.attention import Attention, ForwardContext
from weft.layers.linear import default_dtype
from weft.layers.multimodal import merge_multimodal_embeddings
from weft.layers.nano_batches import NanoBatchState
from weft.layers.norm import RMSNorm
from weft.layers.ops import current_op
from weft.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from weft.layers.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    copy_checked,
)


class LlamaSettings:
    """The numbers of one checkpoint's config, with each family's defaults."""

    def __init__(self, config: dict[str, Any], architecture: str, layout: ParallelLayout | None = None) -> None:
        self.layout = layout or ParallelLayout()
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
        self.output_bias = False
        """Whether ``o_proj`` has a bias (gpt-oss's does; Llama's and Qwen's never do here)."""
        self.attention_sinks = False
        """Whether each attention head has a learned sink logit (gpt-oss)."""
        self.mlp_bias = config.get("mlp_bias", False)
        self.qk_norm = architecture == "Qwen3ForCausalLM"
        self.sliding_windows = self._sliding_windows(config, architecture)
        tp, tensor_rank = self.layout.tensor_parallel_size, self.layout.tensor_rank
        self.local_heads = self.num_heads // tp
        self.first_kv_head, self.local_kv_heads = head_range(self.num_kv_heads, tp, tensor_rank)
        self.local_intermediate = self.intermediate_size // tp
        self.stage_layers = self.layout.stage_layers(self.num_layers)

    def check(self) -> None:
        """Raise ValueError, with the numbers and the fix, for a layout this checkpoint cannot take."""
        tp = self.layout.tensor_parallel_size
        check_heads("attention heads", self.num_heads, tp)
        check_heads("key/value heads", self.num_kv_heads, tp, replicable=True)
        if self.intermediate_size % tp:
            raise ValueError(
                f"engine.tensor_parallel_size = {tp} does not divide the model's intermediate_size "
                f"{self.intermediate_size}; use a tensor_parallel_size that divides both it and the heads"
            )
        self.layout.check_layers(self.num_layers)

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
        self.num_heads, self.num_kv_heads, self.head_dim = s.local_heads, s.local_kv_heads, s.head_dim
        self.q_size, self.kv_size = self.num_heads * s.head_dim, self.num_kv_heads * s.head_dim
        query = Shard(s.layout.tensor_rank * self.q_size, self.q_size)
        key_value = Shard(s.first_kv_head * s.head_dim, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(s.hidden_size, [query, key_value, key_value], bias=s.attention_bias)
        self.o_proj = RowParallelLinear(query, s.hidden_size, bias=s.output_bias)
        self.first_head = s.layout.tensor_rank * self.num_heads
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if s.attention_sinks else None
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        spec = AttentionLayer(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=s.head_dim,
            scale=s.head_dim**-0.5,
            sliding_window=s.sliding_windows[index],
            sinks=s.attention_sinks,
        )
        self.attn = Attention(layer_name(index), 0, spec)
        heads = dict(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=s.head_dim,
            dtype=self.o_proj.weight.dtype,
        )
        self.rotary = current_op("rotary")
        if self.rotary is not None:
            self.rotary.declare(**heads)
        # Qwen3's q/k norms and the rotation in one op where a platform fuses them; the reference is
        # the two ops apart, so without a fused implementation the chosen norm and rotary ops run.
        self.qk_norm_rotary = current_op("qk_norm_rotary") if s.qk_norm else None
        if self.qk_norm_rotary is not None and getattr(self.qk_norm_rotary, "reference", False):
            self.qk_norm_rotary = None
        if self.qk_norm_rotary is not None:
            self.qk_norm_rotary.declare(**heads)

    def forward(
        self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        return self.output(self.attend(*self.project(rotary, hidden), context))

    def project(
        self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rotated queries and keys, and the values, of ``hidden`` (``[tokens, heads, head_dim]`` each)."""
        tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(tokens, self.num_heads, self.head_dim)
        key = key.view(tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm_rotary is not None:
            query, key = self.qk_norm_rotary(
                query,
                key,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.eps,
                *rotary,
            )
        else:
            if self.q_norm is not None:
                query, key = self.q_norm(query), self.k_norm(key)
            query, key = (self.rotary or apply_rotary)(query, key, *rotary)
        return query, key, value

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        """The paged attention (it stores the keys and values first): ``[tokens, heads, head_dim]``."""
        # Sinks only where the layer has them: a subclass of Attention (a test's, a plugin's) need not take them.
        sinks = {} if self.sinks is None else {"sinks": self.sinks}
        return self.attn(query, key, value, context, **sinks)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """The output projection of :meth:`attend`'s result."""
        return self.o_proj(attended.reshape(attended.shape[0], self.q_size))

    def load_checkpoint_tensor(self, parameter: str, weight: Any, name: str, index: int = 0) -> None:
        """The sink logits (the only parameter of the attention module itself): this rank's heads."""
        copy_checked(self.sinks.data, as_slice(weight).narrow(0, self.first_head, self.num_heads), name)


class LlamaMLP(nn.Module):
    def __init__(self, settings: LlamaSettings) -> None:
        super().__init__()
        self.intermediate_size = settings.local_intermediate
        columns = Shard(settings.layout.tensor_rank * self.intermediate_size, self.intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(settings.hidden_size, [columns, columns], bias=settings.mlp_bias)
        self.down_proj = RowParallelLinear(columns, settings.hidden_size, bias=settings.mlp_bias)
        self.act = current_op("silu_and_mul")
        if self.act is not None:
            self.act.declare(width=self.intermediate_size, dtype=self.down_proj.weight.dtype)

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
        self.mlp = self.build_mlp(settings, index)
        self.input_layernorm = RMSNorm(settings.hidden_size, settings.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(settings.hidden_size, settings.rms_norm_eps)

    def build_mlp(self, settings: LlamaSettings, index: int) -> nn.Module:
        """The feed-forward block of layer ``index`` (a mixture-of-experts family builds its experts here)."""
        return LlamaMLP(settings)

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream before it)``; the next norm adds them (fused). The three stages
        of :class:`~weft.layers.nano_batches.StagedLayer`, in order."""
        inputs, residual = self.attention_inputs(rotary, hidden, residual)
        return self.after_attention(self.attend(inputs, context), residual)

    def attention_inputs(
        self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """``((query, key, value), residual stream)``: the input norm (adding the residual), QKV, rotation."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.self_attn.project(rotary, hidden), residual

    def attend(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], context: ForwardContext) -> torch.Tensor:
        return self.self_attn.attend(*inputs, context)

    def after_attention(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output projection, the post-attention norm (adding the residual) and the MLP."""
        hidden, residual = self.post_attention_layernorm(self.self_attn.output(attended), residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer
    rotary_class: type[RotaryEmbedding] = RotaryEmbedding

    def __init__(self, settings: LlamaSettings, max_positions: int) -> None:
        super().__init__()
        layout = settings.layout
        self.stage_layers = settings.stage_layers
        self.is_first_stage, self.is_last_stage = layout.is_first_stage, layout.is_last_stage
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(settings.vocab_size, settings.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(settings, index) if index in self.stage_layers else nn.Module()
            for index in range(settings.num_layers)
        )
        if self.is_last_stage:
            self.norm = RMSNorm(settings.hidden_size, settings.rms_norm_eps)
        self.rotary = self.rotary_class(settings.head_dim, max_positions, settings.rope)
        self.nano_batches = current_op("nano_batches")
        """Runs the layers over a decode step's nano-batches (``ForwardContext.nano_batches``); None: a model
        built outside the engine's ops, which runs every step whole."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        if self.is_first_stage:
            hidden, residual = merge_multimodal_embeddings(self.embed_tokens(input_ids), context), None
        else:
            assert intermediate is not None
            hidden, residual = intermediate["hidden"], intermediate["residual"]
        rotary = self.rotary.table(positions, hidden.dtype)
        if context.nano_batches and self.nano_batches is not None:
            hidden, residual = self._forward_nano_batches(rotary, hidden, residual, context)
        else:
            for index in self.stage_layers:
                hidden, residual = self.layers[index](rotary, hidden, residual, context)
        if not self.is_last_stage:
            return {"hidden": hidden, "residual": residual}
        return self.norm(hidden, residual)[0] if residual is not None else self.norm(hidden)

    def _forward_nano_batches(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over each of the step's nano-batches (the ``nano_batches`` op), their rows put back together."""
        parts = [
            NanoBatchState(
                (rotary[0][part.start : part.stop], rotary[1][part.start : part.stop]),
                hidden[part.start : part.stop],
                None if residual is None else residual[part.start : part.stop],
                part.context,
            )
            for part in context.nano_batches
        ]
        outputs = self.nano_batches([self.layers[index] for index in self.stage_layers], parts)
        return torch.cat([output[0] for output in outputs]), torch.cat([output[1] for output in outputs])


class LlamaForCausalLM(nn.Module):
    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, settings: LlamaSettings, max_positions: int) -> None:
        super().__init__()
        self.settings = settings
        self.dtype = torch.get_default_dtype()
        """The activations' dtype (the default dtype the family builds under)."""
        self.model = self.model_class(settings, max_positions)
        if settings.layout.is_last_stage:
            self.lm_head = ParallelLMHead(settings.hidden_size, settings.vocab_size)
            if settings.tie_word_embeddings and settings.layout.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        return self.model(input_ids, positions, context, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def intermediate_spec(self, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What a stage hands the next for ``num_tokens`` tokens."""
        shape = (num_tokens, self.settings.hidden_size)
        return {"hidden": (shape, self.dtype), "residual": (shape, self.dtype)}


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

    reads_weight_slices = True
    splits_decode_batches = True
    settings_class: type[LlamaSettings] = LlamaSettings
    module_class: type[LlamaForCausalLM] = LlamaForCausalLM

    def settings(self, config: ModelConfig) -> LlamaSettings:
        return self.settings_class(config.hf_config, config.architecture, config.parallel)

    def check_parallel(self, config: ModelConfig) -> None:
        self.settings(config).check()
        if config.parallel.enable_expert_parallel:
            raise ValueError(
                f"engine.enable_expert_parallel: {config.architecture} has no experts to spread; set it to false"
            )

    def kv_cache_groups(self, config: ModelConfig) -> tuple[KVCacheGroupSpec, ...]:
        settings = self.settings(config)
        spec = FullAttentionSpec(
            block_size=config.block_size,
            dtype=config.dtype,
            num_kv_heads=settings.local_kv_heads,
            head_dim=settings.head_dim,
        )
        return (KVCacheGroupSpec("attention", tuple(layer_name(i) for i in settings.stage_layers), spec),)

    def build(self, config: ModelConfig, device: torch.device) -> LlamaForCausalLM:
        settings = self.settings(config)
        # Weft's Linear and Embedding skip random initialisation (load_weights fills every
        # parameter), so building directly on the device in the runtime dtype costs nothing.
        with torch.device(device), default_dtype(getattr(torch, config.dtype)):
            module = self.module_class(settings, config.max_model_len)
        module.model.rotary.to(device)
        return module.eval()

    def load_weights(self, module: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
        """Whole tensors or :class:`~weft.contracts.loader.WeightSlice` objects; each rank copies (and reads) its
        part."""
        settings: LlamaSettings = module.settings
        parameters = dict(module.named_parameters(remove_duplicate=False))
        shared_head = settings.tie_word_embeddings and "model.embed_tokens.weight" in parameters
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            layer = _layer_index(name)
            if layer is not None and layer not in settings.stage_layers:
                continue  # another pipeline stage's
            if self.load_other_tensor(module, name, tensor, filled):
                continue
            targets = self._targets(name, settings, parameters, shared_head)
            if targets is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(module).__name__}")
            for target, shard in targets:
                owner_name, _, parameter = target.rpartition(".")
                owner = module.get_submodule(owner_name)
                loader = getattr(owner, "load_checkpoint_tensor", None)
                if loader is not None:
                    loader(parameter, tensor, name, shard or 0)
                else:
                    copy_checked(parameters[target].data, as_slice(tensor).load(), name)
                filled.add(target if shard is None else f"{target}#{shard}")
        expected = set()
        for name in parameters:
            stacked = name.split(".")[-2]
            if stacked == "qkv_proj":
                expected |= {f"{name}#{i}" for i in range(3)}
            elif stacked == "gate_up_proj":
                expected |= {f"{name}#{i}" for i in range(2)}
            else:
                expected.add(name)
        if shared_head:
            expected.discard("lm_head.weight")
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameter(s), e.g. {missing[:3]}")

    def load_other_tensor(self, module: nn.Module, name: str, tensor: Any, filled: set[str]) -> bool:
        """Load a checkpoint tensor the stacked Llama layout does not describe (a family's experts), adding what
        it fills to ``filled``; False: not such a tensor."""
        return False

    @staticmethod
    def _targets(
        name: str, settings: LlamaSettings, parameters: dict[str, Any], shared_head: bool
    ) -> list[tuple[str, int | None]] | None:
        """The parameters (and stacked parts) checkpoint tensor ``name`` fills on this rank; None: it has no home."""
        if name in _STAGE_TENSORS:  # on the first or the last pipeline stage only
            targets = [(name, None)] if name in parameters and not (name == "lm_head.weight" and shared_head) else []
            if (
                name == "model.embed_tokens.weight"
                and settings.tie_word_embeddings
                and not shared_head
                and "lm_head.weight" in parameters
            ):
                targets.append(("lm_head.weight", None))  # a tied head on a last stage without the embedding
            return targets
        for checkpoint_part, (stacked, index) in _STACKED.items():
            if f".{checkpoint_part}." in name:
                target = name.replace(checkpoint_part, stacked)
                return [(target, index)] if target in parameters else None
        return [(name, None)] if name in parameters else None


_STAGE_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def _layer_index(name: str) -> int | None:
    """``model.layers.7.mlp.up_proj.weight`` -> 7."""
    if not name.startswith("model.layers."):
        return None
    return int(name.split(".")[2])
