"""Mixtral (``MixtralForCausalLM``): Mistral's attention (a sliding window on every layer when the config sets
one) with a sparse MoE block in every layer.

Each token goes to ``num_experts_per_tok`` of ``num_local_experts`` experts by a softmax over the router's
logits, renormalised over the chosen ones. Checkpoint names follow Hugging Face's ``modeling_mixtral.py``:
``block_sparse_moe.gate.weight`` and ``block_sparse_moe.experts.<e>.w1/w3/w2.weight`` (gate, up, down).
"""

from __future__ import annotations

from typing import Any

from weft.contracts.parallel import ParallelLayout
from weft.layers.moe import MoERouting
from weft.models.sparse_moe import SparseMoeFamily, SparseMoeForCausalLM, SparseMoeSettings


class MixtralSettings(SparseMoeSettings):
    def __init__(self, config: dict[str, Any], architecture: str, layout: ParallelLayout | None = None) -> None:
        super().__init__(config, architecture, layout)
        self.routing = MoERouting(top_k=self.experts_per_token, renormalize=True)


class MixtralFamily(SparseMoeFamily):
    """Mixtral checkpoints (Mixtral-8x7B, 8x22B)."""

    settings_class = MixtralSettings
    module_class = SparseMoeForCausalLM
    expert_parts = {"w1": "gate", "w3": "up", "w2": "down"}
    checkpoint_names = {".block_sparse_moe.": ".mlp."}
