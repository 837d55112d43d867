"""DeepSeek V4's MoE: the router (hash-routed ``tid2eid`` layers or scored top-k), the routed experts
(this rank's, stacked) and the shared expert.

Tensor parallelism alone splits every routed expert's columns over the ranks: each rank routes every
token, runs its columns of the experts picked, and one all-reduce sums the ranks' shares. Expert
parallelism spreads whole experts over the ranks and exchanges the tokens between them
(:class:`ExpertParallelExchange`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from weft.contracts.loader import WeightSlice, as_slice
from weft.contracts.parallel import Communicator
from weft.api import ColumnParallelLinear, RowParallelLinear, Shard, copy_checked, current_parallel
from weft_dsv4.config import DeepseekV4Settings

def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``rows[ends[e-1]:ends[e]] @ weights[e].T`` for every expert ``e`` (``weights`` ``[E, out, in]``); rows
    past ``ends[-1]`` are left undefined. One grouped GEMM where torch has it for these tensors
    (``torch._grouped_mm``: CPU, and CUDA's bf16 on sm90+), else one matmul per expert."""
    if _grouped_mm_runs(rows, weights):
        return torch._grouped_mm(rows, weights.transpose(1, 2), offs=ends)
    output = rows.new_empty((rows.shape[0], weights.shape[1]))
    start = 0
    for expert, end in enumerate(ends.tolist()):
        output[start:end] = F.linear(rows[start:end], weights[expert])
        start = end
    return output


def _grouped_mm_runs(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if rows.device.type == "cpu":
        return True
    if rows.device.type != "cuda" or rows.dtype != torch.bfloat16:
        return False
    # CUTLASS's grouped GEMM wants 16-byte aligned rows on both sides.
    return torch.cuda.get_device_capability(rows.device) >= (9, 0) and rows.shape[-1] % 8 == 0 and weights.shape[1] % 8 == 0


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
    layers) or the top-k of ``score + e_score_correction_bias``."""

    def __init__(self, s: DeepseekV4Settings, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.top_k = hashed, s.experts_per_token
        self.scoring_func, self.scaling = s.scoring_func, s.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(s.num_experts, s.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(s.vocab_size, s.experts_per_token, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(s.num_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden, self.weight)
        if self.scoring_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        if self.hashed:
            experts = self.tid2eid[input_ids].long()
        else:
            experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling


class Experts(nn.Module):
    """This rank's routed experts as stacked tensors: ``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``
    (``E`` the experts it holds, ``I`` each one's columns it holds); returns its partial sum."""

    def __init__(self, s: DeepseekV4Settings) -> None:
        super().__init__()
        self.limit = s.swiglu_limit
        self.first, self.count = s.first_expert, s.local_experts
        self.columns = Shard(0 if s.layout.enable_expert_parallel else s.layout.tensor_rank * s.expert_intermediate,
                             s.expert_intermediate)
        self.full_intermediate = s.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.count, 2 * s.expert_intermediate, s.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.count, s.hidden_size, s.expert_intermediate))

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count

    def forward(self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every (token, expert) pair sorted by expert, each expert's rows through one grouped GEMM:
        no host synchronisation, so the step stays capturable in a CUDA graph."""
        k = experts.shape[1]
        local = experts.flatten() - self.first
        held = (local >= 0) & (local < self.count)
        # Another rank's experts sort after this rank's last group and are left out of the GEMMs.
        local = torch.where(held, local, self.count)
        order = local.argsort(stable=True)
        tokens = order // k
        # Where each expert's rows end in the sorted order (a bincount would synchronise with the host).
        bounds = torch.arange(1, self.count + 1, device=local.device)
        ends = torch.searchsorted(local[order], bounds).to(torch.int32)
        gate, up = grouped_matmul(hidden[tokens], self.gate_up_proj, ends).chunk(2, dim=-1)
        current = grouped_matmul(clamped_swiglu(gate, up, self.limit), self.down_proj, ends)
        scale = torch.where(held, weights.flatten(), 0.0)[order, None]
        contribution = torch.where(held[order, None], current.float() * scale, 0.0)
        # Back to (token, choice) order and a sum over the k choices: the same order every run (an
        # index_add_ sums with atomics on CUDA, so a token's k terms would add up in a varying order).
        unsorted = torch.empty_like(contribution)
        unsorted[order] = contribution
        return unsorted.view(-1, k, unsorted.shape[-1]).sum(dim=1).to(hidden.dtype)

    def load_expert(self, parameter: str, expert: int, part: str, weight: WeightSlice | torch.Tensor, name: str) -> None:
        """One expert's ``gate``/``up`` (``[I, H]``) or ``down`` (``[H, I]``) tensor: this rank's columns of it."""
        weight, local, columns = as_slice(weight), expert - self.first, self.columns
        if part == "down":
            copy_checked(self.down_proj.data[local], weight.narrow(1, columns.start, columns.length), name)
            return
        offset = 0 if part == "gate" else columns.length
        copy_checked(self.gate_up_proj.data[local].narrow(0, offset, columns.length),
                     weight.narrow(0, columns.start, columns.length), name)

    def load_stacked(self, parameter: str, weight: WeightSlice | torch.Tensor, name: str) -> None:
        """The stacked tensor of every expert (``[E, 2I, H]`` or ``[E, H, I]``): this rank's experts and columns."""
        stacked = as_slice(weight).narrow(0, self.first, self.count)
        columns = self.columns
        if parameter == "down_proj":
            copy_checked(self.down_proj.data, stacked.narrow(2, columns.start, columns.length), name)
            return
        gate = stacked.narrow(1, columns.start, columns.length)
        up = stacked.narrow(1, self.full_intermediate + columns.start, columns.length)
        copy_checked(self.gate_up_proj.data, torch.cat([gate, up], dim=1), name)


class ExpertParallelExchange:
    """The token exchange of expert parallelism over the stage's tensor ranks, which hold the same
    activations (the attention before the MoE is tensor-parallel).

    The step's ``N`` token rows are cut into ``size`` runs of ``S = ceil(N / size)`` (the last ones
    short or empty, padded): rank ``r`` owns rows ``r*S ..``. A rank routes only its own rows;
    :meth:`dispatch` all-gathers every rank's routing, so each rank knows which of every shard's
    (token, expert) pairs land on its experts and runs those rows only (their hidden states it holds
    already: gathering them too would move the activations every rank has). :meth:`combine`
    reduce-scatters each rank's partial output (its experts' pairs plus its columns of the shared
    expert) to the rank owning the token, then all-gathers the summed rows back to every rank for
    the tensor-parallel layers that follow. Every size is fixed by ``N``: no count goes to the host,
    so a decode graph captures the exchange like any other collective."""

    UNROUTED = -1
    """The expert of a padding row: no rank holds it, so no GEMM sees the row."""

    def __init__(self, communicator: Communicator) -> None:
        self.communicator = communicator

    def shard_rows(self, num_tokens: int) -> int:
        """``S``: the rows each rank owns (the last ranks' partly or wholly padding)."""
        return math.ceil(num_tokens / self.communicator.size)

    def own_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``tensor`` (``N`` rows, the same on every rank); fewer than ``S`` (or none) at the end."""
        rows = self.shard_rows(tensor.shape[0])
        start = min(self.communicator.rank * rows, tensor.shape[0])
        return tensor[start : min(start + rows, tensor.shape[0])]

    def dispatch(self, experts: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's ``(experts, weights)`` (``[N, k]``), from each rank's routing of its own rows."""
        rows, k = self.shard_rows(num_tokens), experts.shape[1]
        # Experts and weights travel in one float32 tensor (expert ids are exact below 2**24), its rows padded
        # to 16 bytes so the one-shot all-reduce behind weft-cuda's all-gather takes it in a graph.
        width = 4 * math.ceil(2 * k / 4)
        packed = torch.zeros((rows, width), dtype=torch.float32, device=experts.device)
        packed[:, :k] = self.UNROUTED
        packed[: experts.shape[0], :k] = experts.float()
        packed[: experts.shape[0], k : 2 * k] = weights.float()
        gathered = self.communicator.all_gather(packed, dim=0)[:num_tokens]
        return gathered[:, :k].long(), gathered[:, k : 2 * k].to(weights.dtype)

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of every token's ``partial`` output (``[N, H]``), on every rank."""
        num_tokens = partial.shape[0]
        padding = self.shard_rows(num_tokens) * self.communicator.size - num_tokens
        if padding:
            partial = torch.cat([partial, partial.new_zeros((padding, partial.shape[1]))])
        owned = self.communicator.reduce_scatter(partial)
        return self.communicator.all_gather(owned, dim=0)[:num_tokens]


class MoE(nn.Module):
    def __init__(self, s: DeepseekV4Settings, index: int) -> None:
        super().__init__()
        self.gate = Router(s, s.mlp_layer_types[index] == "hash_moe")
        self.experts = Experts(s)
        self.shared_experts = SharedExpert(s)
        self.tensor = current_parallel().tensor
        self.exchange = ExpertParallelExchange(self.tensor) if s.layout.enable_expert_parallel and self.tensor.size > 1 else None

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.exchange is None:
            experts, weights = self.gate(hidden, input_ids)
            return self.tensor.all_reduce(self.experts(hidden, experts, weights) + self.shared_experts(hidden))
        own = self.exchange.own_rows
        experts, weights = self.exchange.dispatch(*self.gate(own(hidden), own(input_ids)), hidden.shape[0])
        return self.exchange.combine(self.experts(hidden, experts, weights) + self.shared_experts(hidden))
