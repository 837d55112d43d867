"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k RMSNorm) with sparse MoE blocks.

Layers listed in ``mlp_only_layers``, or not a multiple of ``decoder_sparse_step``, keep a dense MLP;
the others route each token to ``num_experts_per_tok`` of ``num_experts`` experts by a softmax over the
router's logits, renormalised when ``norm_topk_prob``. Checkpoint names follow Hugging Face's
``modeling_qwen3_moe.py``: ``mlp.gate.weight`` and ``mlp.experts.<e>.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from typing import Any

from weft.contracts.parallel import ParallelLayout
from weft.models.sparse_moe import SparseMoeFamily, SparseMoeForCausalLM, SparseMoeSettings


class Qwen3MoeSettings(SparseMoeSettings):
    def __init__(self, config: dict[str, Any], architecture: str, layout: ParallelLayout | None = None) -> None:
        # Qwen3's attention: its sliding-window rules and q/k norms.
        super().__init__(config, "Qwen3ForCausalLM", layout)


class Qwen3MoeFamily(SparseMoeFamily):
    """Qwen3-MoE checkpoints (Qwen3-30B-A3B, Qwen3-235B-A22B)."""

    settings_class = Qwen3MoeSettings
    module_class = SparseMoeForCausalLM
