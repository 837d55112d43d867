"""A DeepSeek V4 ``config.json`` read into validated numbers (HF's field names and defaults), the
layer types and the KV-cache groups each type keeps state in."""

from __future__ import annotations

from typing import Any

from weft.contracts.parallel import ParallelLayout, check_heads

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


class DeepseekV4Settings:
    """The numbers of a DeepSeek V4 ``config.json`` (HF's field names and defaults), validated."""

    def __init__(self, config: dict[str, Any], layout: ParallelLayout | None = None, lookahead: int = 0) -> None:
        self.lookahead = lookahead
        """``ModelConfig.num_lookahead_tokens``: the compressors' state rings keep this many positions more."""
        self.vocab_size = config.get("vocab_size", 129280)
        self.hidden_size = config.get("hidden_size", 4096)
        self.num_layers = config.get("num_hidden_layers", 43)
        self.num_heads = config.get("num_attention_heads", 64)
        self.head_dim = config.get("head_dim", 512)
        self.q_lora_rank = config.get("q_lora_rank", 1024)
        self.moe_intermediate_size = config.get("moe_intermediate_size", 2048)
        self.num_experts = config.get("n_routed_experts", 256)
        self.experts_per_token = config.get("num_experts_per_tok", 6)
        self.scoring_func = config.get("scoring_func", "sqrtsoftplus")
        self.routed_scaling_factor = config.get("routed_scaling_factor", 1.5)
        self.swiglu_limit = config.get("swiglu_limit", 10.0)
        self.sliding_window = config.get("sliding_window", 128)
        self.o_groups = config.get("o_groups", 8)
        self.o_lora_rank = config.get("o_lora_rank", 1024)
        self.index_heads = config.get("index_n_heads", 64)
        self.index_head_dim = config.get("index_head_dim", 128)
        self.index_topk = config.get("index_topk", 512)
        self.hc_mult = config.get("hc_mult", 4)
        self.hc_sinkhorn_iters = config.get("hc_sinkhorn_iters", 20)
        self.hc_eps = config.get("hc_eps", 1e-6)
        self.rms_norm_eps = config.get("rms_norm_eps", 1e-6)
        self.max_position_embeddings = config.get("max_position_embeddings", 1048576)
        num_kv_heads = config.get("num_key_value_heads", 1)
        if num_kv_heads != 1:
            raise ValueError(
                f"DeepSeek V4: num_key_value_heads is {num_kv_heads}; the architecture has one shared KV head"
            )
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(
                f"DeepSeek V4: scoring_func {self.scoring_func!r}; expected sqrtsoftplus, sigmoid or softmax"
            )
        rates = dict(config.get("compress_rates") or {CSA: 4, HCA: 128})
        for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if config.get(legacy) is not None:
                rates[kind] = config[legacy]
        self.compress_rates = rates
        self.layer_types = self._layer_types(config)
        self.mlp_layer_types = self._mlp_layer_types(config)
        self.rope_dim, self.rope = self._rope(config)
        self.layout = layout or ParallelLayout()
        tp, rank = self.layout.tensor_parallel_size, self.layout.tensor_rank
        self.local_heads, self.local_groups = self.num_heads // tp, self.o_groups // tp
        self.shared_intermediate = self.moe_intermediate_size // tp
        """The shared expert's columns on this rank."""
        if self.layout.enable_expert_parallel:
            self.local_experts, self.first_expert = self.num_experts // tp, rank * (self.num_experts // tp)
            self.expert_intermediate = self.moe_intermediate_size
        else:
            self.local_experts, self.first_expert = self.num_experts, 0
            self.expert_intermediate = self.moe_intermediate_size // tp
        """The routed experts this rank holds (``first_expert ..``) and each one's columns here."""

    def check(self) -> None:
        """Raise ValueError, with the numbers and the fix, for a layout this checkpoint cannot take."""
        layout = self.layout
        tp = layout.tensor_parallel_size
        if layout.pipeline_parallel_size > 1:
            raise ValueError(
                f"engine.pipeline_parallel_size = {layout.pipeline_parallel_size}: DeepSeek V4 runs on one pipeline "
                f"stage; use tensor_parallel_size (with enable_expert_parallel) to spread it"
            )
        check_heads("attention heads", self.num_heads, tp)
        divided = [
            ("o_groups (output head groups)", self.o_groups),
            ("moe_intermediate_size (shared expert columns)", self.moe_intermediate_size),
        ]
        if layout.enable_expert_parallel:
            divided.append(("n_routed_experts", self.num_experts))
        for name, value in divided:
            if value % tp:
                raise ValueError(
                    f"engine.tensor_parallel_size = {tp} does not divide the model's {name} {value}; use a "
                    f"tensor_parallel_size that divides {self.num_heads} heads, {self.o_groups} output groups, "
                    f"moe_intermediate_size {self.moe_intermediate_size}"
                    + (f" and {self.num_experts} routed experts" if layout.enable_expert_parallel else "")
                )

    def _layer_types(self, config: dict[str, Any]) -> list[str]:
        kinds = config.get("layer_types")
        if kinds is None and config.get("compress_ratios") is not None:
            by_ratio = {0: SLIDING, 4: CSA, 128: HCA}
            kinds = [by_ratio[ratio] for ratio in config["compress_ratios"]]
        if kinds is None:
            n = self.num_layers
            kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        kinds = list(kinds[: self.num_layers])
        bad = [kind for kind in kinds if kind not in LAYER_TYPES]
        if len(kinds) != self.num_layers or bad:
            raise ValueError(
                f"DeepSeek V4: layer_types must list {self.num_layers} entries from {LAYER_TYPES}; got {kinds}"
            )
        return kinds

    def _mlp_layer_types(self, config: dict[str, Any]) -> list[str]:
        kinds = config.get("mlp_layer_types")
        if kinds is None:
            hashed = config.get("num_hash_layers", 3)
            kinds = ["hash_moe"] * min(self.num_layers, hashed) + ["moe"] * max(0, self.num_layers - hashed)
        kinds = list(kinds[: self.num_layers])
        if len(kinds) != self.num_layers or any(kind not in ("hash_moe", "moe") for kind in kinds):
            raise ValueError(
                f"DeepSeek V4: mlp_layer_types must list {self.num_layers} of 'hash_moe'/'moe'; got {kinds}"
            )
        return kinds

    def _rope(self, config: dict[str, Any]) -> tuple[int, dict[str, dict[str, Any]]]:
        factor = config.get("partial_rotary_factor")
        if factor is None:
            rope_head_dim = config.get("qk_rope_head_dim")
            factor = rope_head_dim / self.head_dim if rope_head_dim is not None else 64 / 512
        parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if isinstance(parameters.get("main"), dict) and isinstance(parameters.get("compress"), dict):
            rope = {"main": dict(parameters["main"]), "compress": dict(parameters["compress"])}
        else:
            scaling = {key: value for key, value in parameters.items() if key not in ("main", "compress")}
            rope = {
                "main": {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)},
                "compress": {**scaling, "rope_theta": config.get("compress_rope_theta", 160000.0)},
            }
            rope["compress"].setdefault("rope_type", rope["compress"].pop("type", "default"))
            if rope["compress"]["rope_type"] == "yarn":
                rope["compress"].setdefault("attention_factor", 1.0)
        for name, entry in rope.items():
            entry.setdefault("partial_rotary_factor", factor)
            entry.setdefault("rope_type", "default")
            if entry["rope_type"] not in ("default", "yarn"):
                raise ValueError(
                    f"DeepSeek V4: rope_parameters.{name}.rope_type {entry['rope_type']!r}; expected default or yarn"
                )
        return int(self.head_dim * factor), rope

    def ratio(self, kind: str) -> int:
        return self.compress_rates[kind]

    def state_elements(self, kind: str) -> int:
        """fp32 elements of one layer's compressor state: projected kv and gate of a ring of positions (the
        compressors' ``ring_length``)."""
        if kind == CSA:  # the compressor's and the indexer's rings, each of 2m positions and the lookahead
            return (2 * self.ratio(CSA) + self.lookahead) * 2 * (2 * self.head_dim + 2 * self.index_head_dim)
        if kind == HCA:
            return (self.ratio(HCA) + self.lookahead) * 2 * self.head_dim
        return 0


def layer_groups(kind: str) -> tuple[str, ...]:
    """The KV-cache groups a layer of this type holds state in (the checkpoint groups only exist
    under prefix caching)."""
    if kind == CSA:
        return ("window", "csa_kv", "indexer_keys", "compressor_state", "window_checkpoint", "state_checkpoint")
    if kind == HCA:
        return ("window", "hca_kv", "compressor_state", "window_checkpoint", "state_checkpoint")
    return ("window", "window_checkpoint")
