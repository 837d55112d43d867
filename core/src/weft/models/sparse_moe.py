"""Llama-architecture decoders whose feed-forward blocks are mixtures of experts (Qwen3-MoE, Mixtral).

The attention, norms, embedding and head are :mod:`weft.models.llama`'s; a layer's MLP is a
:class:`SparseMoeBlock`: a replicated router (``gate``) and :class:`~weft.layers.moe.FusedMoE` experts.
Each family module says how its checkpoint names the experts and how its config reads
(:class:`SparseMoeFamily`'s class attributes).

Parallelism: tensor parallelism splits every expert's columns; with ``engine.enable_expert_parallel``
each tensor rank holds whole experts and reads only theirs from the checkpoint, and the tokens are
exchanged between the ranks (:class:`~weft.layers.moe.ExpertParallelExchange`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from weft.contracts.model import ModelConfig
from weft.contracts.parallel import ParallelLayout
from weft.layers.linear import Linear
from weft.layers.moe import FusedMoE, MoEActivation, MoERouting, check_expert_layout
from weft.models.llama import LlamaDecoderLayer, LlamaFamily, LlamaForCausalLM, LlamaModel, LlamaSettings


class SparseMoeSettings(LlamaSettings):
    """:class:`LlamaSettings` plus the experts: how many, how many per token, their width, which layers have them."""

    def __init__(self, config: dict[str, Any], architecture: str, layout: ParallelLayout | None = None) -> None:
        super().__init__({"intermediate_size": 0, **config}, architecture, layout)
        # transformers 5 writes ``num_local_experts`` for every MoE config; Qwen's own configs say ``num_experts``.
        self.num_experts = config.get("num_experts") or config["num_local_experts"]
        self.experts_per_token = config["num_experts_per_tok"]
        self.moe_intermediate_size = config.get("moe_intermediate_size") or config["intermediate_size"]
        step = config.get("decoder_sparse_step", 1) or 1
        dense = set(config.get("mlp_only_layers") or ())
        self.sparse_layers = frozenset(
            index for index in range(self.num_layers) if index not in dense and (index + 1) % step == 0
        )
        self.routing = MoERouting(top_k=self.experts_per_token, renormalize=config.get("norm_topk_prob", True))

    def check(self) -> None:
        super().check()
        check_expert_layout(self.num_experts, self.moe_intermediate_size, self.layout)


class SparseMoeBlock(nn.Module):
    """The router (one replicated linear layer) and the experts; ``forward(hidden)`` is the block's output."""

    def __init__(
        self,
        settings: SparseMoeSettings,
        activation: MoEActivation = MoEActivation(),
        router_bias: bool = False,
        expert_bias: bool = False,
    ) -> None:
        super().__init__()
        s = settings
        self.gate = Linear(s.hidden_size, s.num_experts, bias=router_bias)
        self.experts = FusedMoE(
            s.num_experts, s.hidden_size, s.moe_intermediate_size, s.routing, activation, bias=expert_bias
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(self.experts.own_rows(hidden)))


class SparseMoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, settings: SparseMoeSettings, index: int) -> nn.Module:
        if index in settings.sparse_layers:
            return SparseMoeBlock(settings)
        return super().build_mlp(settings, index)


class SparseMoeFamily(LlamaFamily):
    """A Llama-architecture family with :class:`SparseMoeBlock` experts. Subclasses name their checkpoint's expert
    tensors: ``expert_parts`` maps the last name part of one expert's tensor (``gate_proj``) to its
    :meth:`FusedMoE.load_expert` part (``gate``)."""

    settings_class = SparseMoeSettings
    expert_parts: dict[str, str] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    stacked_parts: dict[str, str] = {"gate_up_proj": "gate_up", "down_proj": "down"}
    """transformers 5 may save the experts stacked (``experts.gate_up_proj`` ``[E, 2I, H]``): their parts."""

    def check_parallel(self, config: ModelConfig) -> None:
        self.settings(config).check()

    checkpoint_names: dict[str, str] = {}
    """Parts of checkpoint names spelled otherwise here (Mixtral's ``.block_sparse_moe.`` is ``.mlp.``)."""

    def load_weights(self, module: nn.Module, weights: Any) -> None:
        self._expert_tensors: dict[str, int] = {}
        super().load_weights(module, ((self._rename(name), tensor) for name, tensor in weights))
        for name, submodule in module.named_modules():
            if isinstance(submodule, FusedMoE):
                expected = self._tensors_per_block(submodule)
                seen = self._expert_tensors.get(name, 0)
                if seen != expected:
                    raise ValueError(
                        f"the checkpoint has {seen} expert tensor(s) for {name}, expected {expected} "
                        f"({submodule.num_experts} experts, parts {sorted(set(self.expert_parts.values()))})"
                    )

    def _rename(self, name: str) -> str:
        for theirs, ours in self.checkpoint_names.items():
            name = name.replace(theirs, ours)
        return name

    def _tensors_per_block(self, block: FusedMoE) -> int:
        if self._stacked_seen:
            return len(self.stacked_parts)
        return block.num_experts * len(self.expert_parts)

    _stacked_seen = False
    _expert = re.compile(r"^(?P<block>.*\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")
    _stacked = re.compile(r"^(?P<block>.*\.experts)\.(?P<part>\w+)$")

    def load_other_tensor(self, module: nn.Module, name: str, tensor: Any, filled: set[str]) -> bool:
        match = self._expert.match(name)
        if match is not None and match["part"] in self.expert_parts:
            block: FusedMoE = module.get_submodule(match["block"])
            block.load_expert(int(match["expert"]), self.expert_parts[match["part"]], tensor, name)
        else:
            match = self._stacked.match(name)
            if match is None or match["part"] not in self.stacked_parts:
                return False
            self._stacked_seen = True
            block = module.get_submodule(match["block"])
            block.load_stacked(self.stacked_parts[match["part"]], tensor, name)
        self._expert_tensors[match["block"]] = self._expert_tensors.get(match["block"], 0) + 1
        filled.update(f"{match['block']}.{parameter}" for parameter, _ in block.named_parameters())
        return True


class SparseMoeModel(LlamaModel):
    layer_class = SparseMoeDecoderLayer


class SparseMoeForCausalLM(LlamaForCausalLM):
    model_class = SparseMoeModel
