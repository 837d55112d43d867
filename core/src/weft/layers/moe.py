"""Mixture of experts: routing, the expert computation (the ``moe`` op's reference) and the layer families use.

``select_experts``  router logits -> each token's ``top_k`` experts and their weights: softmax, sigmoid or
                    sqrt-softplus scores, an optional score-correction bias that steers the choice only,
                    grouped top-k (DeepSeek V3), renormalisation and a scaling factor
``fused_experts``   every (token, expert) pair sorted by expert and each expert's rows through one grouped
                    GEMM, gate/up then down, weighted and summed over a token's choices; no host
                    synchronisation, so a decode step that calls it stays capturable in a CUDA graph
``FusedMoE``        the layer: stacked expert weights (this rank's experts and columns), routing, an
                    optional shared expert, the ``moe`` op, and the collective that completes the sum

Tensor parallelism alone splits every expert's intermediate columns over the tensor ranks: each rank
routes every token, runs its columns of the experts picked, and one all-reduce sums the shares. Expert
parallelism (``engine.enable_expert_parallel``) spreads whole experts over the tensor ranks and exchanges
the tokens (:class:`ExpertParallelExchange`): each rank routes only its share of the rows and computes
only the pairs that land on its experts.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from weft.contracts.loader import WeightSlice, as_slice
from weft.contracts.parallel import Communicator
from weft.distributed.state import current_parallel
from weft.layers.ops import current_op
from weft.layers.tensor_parallel import copy_checked

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
ACTIVATIONS = ("silu", "swiglu_oai")


class MoERouting(msgspec.Struct, frozen=True, kw_only=True):
    """How a router's logits ``[T, E]`` pick experts (the static part of a ``moe`` call)."""

    top_k: int
    scoring: str = "softmax"
    """``softmax`` (over all experts, in float32), ``sigmoid`` or ``sqrtsoftplus`` (DeepSeek V4)."""
    renormalize: bool = True
    """Divide the chosen experts' scores by their sum."""
    num_groups: int = 1
    """Grouped top-k: experts split into ``num_groups`` equal groups, a group scored by the sum of its two
    best (bias-corrected) scores, experts chosen only from the best ``topk_groups`` groups."""
    topk_groups: int = 1
    scaling: float = 1.0
    """``routed_scaling_factor``: multiplies the final weights."""

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoERouting.scoring: {self.scoring!r} is not one of {', '.join(SCORINGS)}")
        if self.num_groups > 1 and not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"MoERouting.topk_groups: {self.topk_groups} must be within 1..num_groups ({self.num_groups})"
            )


class MoEActivation(msgspec.Struct, frozen=True, kw_only=True):
    """The experts' gated activation of ``gate`` and ``up`` (the halves of ``x @ w13[e].T``)."""

    kind: str = "silu"
    """``silu``: ``silu(gate) * up``; ``swiglu_oai`` (gpt-oss): ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    limit: float | None = None
    """Clamp ``gate`` to at most ``limit`` and ``up`` to ``[-limit, limit]`` first (DeepSeek V4, gpt-oss)."""
    alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"MoEActivation.kind: {self.kind!r} is not one of {', '.join(ACTIVATIONS)}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        if self.kind == "silu":
            return F.silu(gate) * up
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def select_experts(
    router_logits: torch.Tensor, routing: MoERouting, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts ``[T, k]`` (int64) and their weights ``[T, k]`` (float32).

    The experts are the ``top_k`` of the scores plus ``correction_bias`` (within the best groups when
    grouped); the weights are the uncorrected scores of those experts, renormalised and scaled.
    """
    logits = router_logits.float()
    if routing.scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif routing.scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softplus(logits).sqrt()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.num_groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, routing.num_groups, experts // routing.num_groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best = group_scores.topk(routing.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
    experts = choice.topk(routing.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * routing.scaling if routing.scaling != 1.0 else weights


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``rows[ends[e-1]:ends[e]] @ weights[e].T`` for every expert ``e`` (``weights`` ``[E, out, in]``); rows
    past ``ends[-1]`` are left undefined. One grouped GEMM where torch has it for these tensors
    (``torch._grouped_mm``: CPU, and CUDA's bf16 on sm90+), else one matmul per expert."""
    if grouped_mm_runs(rows, weights):
        return torch._grouped_mm(rows, weights.transpose(1, 2), offs=ends)
    output = rows.new_empty((rows.shape[0], weights.shape[1]))
    start = 0
    for expert, end in enumerate(ends.tolist()):
        output[start:end] = F.linear(rows[start:end], weights[expert])
        start = end
    return output


def grouped_mm_runs(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM (``torch._grouped_mm``) computes ``rows`` against ``weights`` here: on the CPU
    for equal dtypes, on CUDA for bf16 on sm90+ with 16-byte aligned rows."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if rows.device.type == "cpu":
        return rows.dtype == weights.dtype
    if rows.device.type != "cuda" or rows.dtype != torch.bfloat16:
        return False
    # CUTLASS's grouped GEMM wants 16-byte aligned rows on both sides.
    return (
        torch.cuda.get_device_capability(rows.device) >= (9, 0)
        and rows.shape[-1] % 8 == 0
        and weights.shape[1] % 8 == 0
    )


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    activation: MoEActivation = MoEActivation(),
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    first_expert: int = 0,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(hidden[t])`` over the experts this rank holds.

    ``w13`` ``[E, 2I, H]`` stacks each expert's gate (first ``I`` rows) and up projections, ``w2`` ``[E, H, I]``
    its down projection, optional biases ``[E, 2I]`` and ``[E, H]``; they hold experts ``first_expert ..
    first_expert + E - 1``, and pairs routed elsewhere (another rank's experts, or -1) add nothing. The
    products and the sum over a token's choices are in float32, in the same order every run (an
    ``index_add_`` sums with atomics on CUDA), and the result is in ``hidden``'s dtype.
    """
    count, k = w13.shape[0], experts.shape[1]
    local = experts.flatten() - first_expert
    held = (local >= 0) & (local < count)
    # Another rank's experts sort after this rank's last group and are left out of the GEMMs.
    local = torch.where(held, local, count)
    order = local.argsort(stable=True)
    tokens = order // k
    sorted_experts = local[order]
    # Where each expert's rows end in the sorted order (a bincount would synchronise with the host).
    ends = torch.searchsorted(sorted_experts, torch.arange(1, count + 1, device=local.device)).to(torch.int32)
    gate_up = grouped_matmul(hidden[tokens], w13, ends)
    # Pairs past the last group point at a clamped expert: their bias is added and then masked out.
    bias_rows = sorted_experts.clamp(max=count - 1)
    if w13_bias is not None:
        gate_up = gate_up + w13_bias[bias_rows]
    gate, up = gate_up.chunk(2, dim=-1)
    current = grouped_matmul(activation(gate, up), w2, ends)
    if w2_bias is not None:
        current = current + w2_bias[bias_rows]
    scale = torch.where(held, weights.flatten().float(), 0.0)[order, None]
    contribution = torch.where(held[order, None], current.float() * scale, 0.0)
    unsorted = torch.empty_like(contribution)
    unsorted[order] = contribution
    return unsorted.view(-1, k, unsorted.shape[-1]).sum(dim=1).to(hidden.dtype)


def moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: MoERouting,
    *,
    activation: MoEActivation = MoEActivation(),
    correction_bias: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    first_expert: int = 0,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    experts_function: Any = None,
) -> torch.Tensor:
    """The ``moe`` op's definition (:class:`weft.builtins.moe.MoETorch` documents the arguments). An implementation
    that only computes the experts faster passes its own ``experts_function`` (:func:`fused_experts`'s arguments)."""
    experts, weights = topk if topk is not None else select_experts(router_logits, routing, correction_bias)
    output = (experts_function or fused_experts)(
        hidden, w13, w2, experts, weights, activation, w13_bias, w2_bias, first_expert
    )
    if shared_w13 is not None:
        gate, up = F.linear(hidden, shared_w13).chunk(2, dim=-1)
        output = output + F.linear(activation(gate, up), shared_w2)
    return output


class ExpertParallelExchange:
    """The token exchange of expert parallelism over the stage's tensor ranks, which hold the same
    activations (the attention before the MoE is tensor-parallel).

    The step's ``N`` token rows are cut into ``size`` runs of ``S = ceil(N / size)`` (the last ones
    short or empty, padded): rank ``r`` owns rows ``r*S ..``. A rank routes only its own rows;
    :meth:`dispatch` all-gathers every rank's routing, so each rank knows which of every shard's
    (token, expert) pairs land on its experts and runs those rows only (their hidden states it holds
    already: gathering them too would move the activations every rank has). :meth:`combine`
    reduce-scatters each rank's partial output (its experts' pairs plus its columns of a shared
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
        """This rank's rows of ``tensor`` (``N`` rows, the same on every rank); fewer than ``S`` (or none) at the
        end."""
        rows = self.shard_rows(tensor.shape[0])
        start = min(self.communicator.rank * rows, tensor.shape[0])
        return tensor[start : min(start + rows, tensor.shape[0])]

    def dispatch(
        self, experts: torch.Tensor, weights: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
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


class ExpertLayout(msgspec.Struct, frozen=True):
    """Which experts and columns one rank holds: experts ``first .. first + count - 1``, each one's
    intermediate columns ``column_start .. column_start + columns - 1``."""

    first: int
    count: int
    column_start: int
    columns: int

    @classmethod
    def of_rank(cls, num_experts: int, intermediate_size: int, layout: Any) -> ExpertLayout:
        """Expert parallelism: whole experts split evenly; else every expert, its columns split evenly."""
        tp, rank = layout.tensor_parallel_size, layout.tensor_rank
        if layout.enable_expert_parallel:
            count = num_experts // tp
            return cls(rank * count, count, 0, intermediate_size)
        columns = intermediate_size // tp
        return cls(0, num_experts, rank * columns, columns)


def check_expert_layout(num_experts: int, intermediate_size: int, layout: Any) -> None:
    """Raise ValueError, with the numbers and the fix, when the tensor ranks cannot split the experts."""
    tp = layout.tensor_parallel_size
    if layout.enable_expert_parallel and num_experts % tp:
        raise ValueError(
            f"engine.tensor_parallel_size = {tp} does not divide the model's {num_experts} experts, which "
            f"engine.enable_expert_parallel spreads over the tensor ranks; use a size that divides {num_experts}"
        )
    if not layout.enable_expert_parallel and intermediate_size % tp:
        raise ValueError(
            f"engine.tensor_parallel_size = {tp} does not divide the experts' intermediate size {intermediate_size}; "
            f"use a size that divides it, or set engine.enable_expert_parallel = true"
        )


class FusedMoE(nn.Module):
    """A sparse MoE block's experts: ``forward(hidden, router_logits)`` returns every token's full output.

    Parameters (this rank's part; the names and layout of transformers 5's stacked experts): ``gate_up_proj``
    ``[E, 2I, H]`` (gate rows then up rows, the op's ``w13``), ``down_proj`` ``[E, H, I]`` (``w2``), with
    ``bias=True`` also ``gate_up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias`` ``[E, H]``; :attr:`held` says which
    experts and columns they are. Families fill them with
    :meth:`load_expert` (one checkpoint tensor of one expert) or :meth:`load_stacked` (every expert's).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        routing: MoERouting,
        activation: MoEActivation = MoEActivation(),
        bias: bool = False,
    ) -> None:
        super().__init__()
        parallel = current_parallel()
        self.tensor = parallel.tensor
        self.routing, self.activation = routing, activation
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.held = ExpertLayout.of_rank(num_experts, intermediate_size, parallel.layout)
        count, columns = self.held.count, self.held.columns
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * columns, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(count, hidden_size, columns), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(count, 2 * columns), requires_grad=False) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(count, hidden_size), requires_grad=False) if bias else None
        self.exchange = (
            ExpertParallelExchange(self.tensor)
            if parallel.layout.enable_expert_parallel and self.tensor.size > 1
            else None
        )
        self.op = current_op("moe")
        if self.op is not None:
            self.op.declare(
                num_experts=count,
                top_k=routing.top_k,
                hidden_size=hidden_size,
                intermediate_size=columns,
                dtype=self.gate_up_proj.dtype,
                activation=activation,
                bias=bias,
            )

    def holds(self, expert: int) -> bool:
        return self.held.first <= expert < self.held.first + self.held.count

    def own_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rows of ``tensor`` (one per token) this rank routes: all of them, or under expert parallelism its
        share (:meth:`ExpertParallelExchange.own_rows`)."""
        return tensor if self.exchange is None else self.exchange.own_rows(tensor)

    def forward(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        correction_bias: torch.Tensor | None = None,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        shared: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every token's output, summed over the tensor ranks.

        ``router_logits`` (or ``topk``, the ``[rows, k]`` experts and weights of a router of the family's own) are
        those of :meth:`own_rows`; ``shared`` is this rank's partial output of a shared expert, added before the
        collective so that one collective completes both."""
        if self.exchange is not None:
            if topk is None:
                topk = select_experts(router_logits, self.routing, correction_bias)
            topk = self.exchange.dispatch(*topk, hidden.shape[0])
        partial = self.compute(hidden, router_logits, correction_bias, topk)
        if shared is not None:
            partial = partial + shared
        if self.exchange is not None:
            return self.exchange.combine(partial)
        return self.tensor.all_reduce(partial)

    def compute(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor | None,
        correction_bias: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """This rank's partial output (its experts, its columns)."""
        kwargs = dict(
            activation=self.activation,
            correction_bias=correction_bias,
            w13_bias=self.gate_up_proj_bias,
            # Under tensor parallelism the ranks' partial sums add up: one rank adds the bias.
            w2_bias=self.down_proj_bias if self.held.column_start == 0 else None,
            topk=topk,
            first_expert=self.held.first,
        )
        if self.op is None:
            return moe(hidden, router_logits, self.gate_up_proj, self.down_proj, self.routing, **kwargs)
        return self.op(hidden, router_logits, self.gate_up_proj, self.down_proj, self.routing, **kwargs)

    def load_expert(self, expert: int, part: str, weight: WeightSlice | torch.Tensor, name: str) -> None:
        """One expert's ``gate`` / ``up`` (``[I, H]``), ``down`` (``[H, I]``), ``gate_bias`` / ``up_bias`` (``[I]``)
        or ``down_bias`` (``[H]``) checkpoint tensor: this rank's columns of it (nothing for another rank's expert)."""
        if not self.holds(expert):
            return
        weight, local, layout = as_slice(weight), expert - self.held.first, self.held
        start, columns = layout.column_start, layout.columns
        if part == "down":
            copy_checked(self.down_proj.data[local], weight.narrow(1, start, columns), name)
        elif part == "down_bias":
            copy_checked(self.down_proj_bias.data[local], weight.load(), name)
        elif part in ("gate", "up"):
            offset = 0 if part == "gate" else columns
            rows = self.gate_up_proj.data[local].narrow(0, offset, columns)
            copy_checked(rows, weight.narrow(0, start, columns), name)
        elif part in ("gate_bias", "up_bias"):
            offset = 0 if part == "gate_bias" else columns
            bias = self.gate_up_proj_bias.data[local].narrow(0, offset, columns)
            copy_checked(bias, weight.narrow(0, start, columns), name)
        else:
            raise ValueError(f"checkpoint tensor {name!r}: unknown expert part {part!r}")

    def load_stacked(self, part: str, weight: WeightSlice | torch.Tensor, name: str, held_only: bool = False) -> None:
        """Every expert's tensor stacked on a first axis of ``num_experts``: ``gate_up`` (``[E, 2I, H]``, gate
        rows first), ``down`` (``[E, H, I]``), ``gate_up_bias`` (``[E, 2I]``) or ``down_bias`` (``[E, H]``);
        ``held_only``: the tensor stacks only the experts this rank holds."""
        weight = as_slice(weight)
        experts = self.held.count if held_only else self.num_experts
        if weight.shape[0] != experts:
            raise ValueError(f"checkpoint tensor {name!r} stacks {weight.shape[0]} experts, expected {experts}")
        stacked = weight.load() if held_only else weight.narrow(0, self.held.first, self.held.count)
        start, columns = self.held.column_start, self.held.columns
        if part == "down":
            copy_checked(self.down_proj.data, stacked.narrow(2, start, columns), name)
        elif part == "down_bias":
            copy_checked(self.down_proj_bias.data, stacked, name)
        elif part in ("gate_up", "gate_up_bias"):
            gate = stacked.narrow(1, start, columns)
            up = stacked.narrow(1, self.intermediate_size + start, columns)
            target = self.gate_up_proj if part == "gate_up" else self.gate_up_proj_bias
            copy_checked(target.data, torch.cat([gate, up], dim=1), name)
        else:
            raise ValueError(f"checkpoint tensor {name!r}: unknown stacked part {part!r}")
