"""DeepSeek V4's MoE: the router (hash-routed ``tid2eid`` layers or scored top-k), the routed experts
(core's :class:`~weft.layers.moe.FusedMoE` and ``moe`` op: this rank's experts, stacked) and the shared expert.

Tensor parallelism alone splits every routed expert's columns over the ranks: each rank routes every
token, runs its columns of the experts picked, and one all-reduce sums the ranks' shares. Expert
parallelism spreads whole experts over the ranks and exchanges the tokens between them
(:class:`~weft.layers.moe.ExpertParallelExchange`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weft.api import ColumnParallelLinear, FusedMoE, MoEActivation, MoERouting, RowParallelLinear, Shard, select_experts
from weft_dsv4.config import DeepseekV4Settings


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return MoEActivation(limit=limit)(gate, up)


def routing(s: DeepseekV4Settings) -> MoERouting:
    return MoERouting(
        top_k=s.experts_per_token, scoring=s.scoring_func, renormalize=True, scaling=s.routed_scaling_factor
    )


class SharedExpert(nn.Module):
    """This rank's columns of the shared expert; returns its partial sum (the MoE all-reduces once)."""

    def __init__(self, s: DeepseekV4Settings) -> None:
        super().__init__()
        self.limit = s.swiglu_limit
        columns = Shard(s.layout.tensor_rank * s.shared_intermediate, s.shared_intermediate)
        self.gate_proj = ColumnParallelLinear(s.hidden_size, [columns], bias=False)
        self.up_proj = ColumnParallelLinear(s.hidden_size, [columns], bias=False)
        self.down_proj = RowParallelLinear(columns, s.hidden_size, bias=False, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """Expert weights from the learned gate; the experts themselves from ``tid2eid[token]`` (hash
    layers) or the top-k of ``score + e_score_correction_bias`` (core's :func:`~weft.layers.moe.select_experts`)."""

    def __init__(self, s: DeepseekV4Settings, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.routing = hashed, routing(s)
        self.weight = nn.Parameter(torch.empty(s.num_experts, s.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(s.vocab_size, s.experts_per_token, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(s.num_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden, self.weight)
        if not self.hashed:
            return select_experts(logits, self.routing, self.e_score_correction_bias)
        if self.routing.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.routing.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        experts = self.tid2eid[input_ids].long()
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.routing.scaling


class Experts(FusedMoE):
    """This rank's routed experts (:class:`~weft.layers.moe.FusedMoE`): ``gate_up_proj`` ``[E, 2I, H]``,
    ``down_proj`` ``[E, H, I]``; called with ``(hidden, experts, weights)`` it returns this rank's partial sum."""

    def __init__(self, s: DeepseekV4Settings) -> None:
        super().__init__(
            s.num_experts, s.hidden_size, s.moe_intermediate_size, routing(s), MoEActivation(limit=s.swiglu_limit)
        )
        self.limit = s.swiglu_limit

    def partial(self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.compute(hidden, None, None, (experts, weights))


class MoE(nn.Module):
    def __init__(self, s: DeepseekV4Settings, index: int) -> None:
        super().__init__()
        self.gate = Router(s, s.mlp_layer_types[index] == "hash_moe")
        self.experts = Experts(s)
        self.shared_experts = SharedExpert(s)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        own = self.experts.own_rows
        topk = self.gate(own(hidden), own(input_ids))
        return self.experts(hidden, topk=topk, shared=self.shared_experts(hidden))
