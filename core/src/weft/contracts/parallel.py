"""How one model is spread over devices: the layout every worker and model family reads.

A model is split over ``tensor_parallel_size x pipeline_parallel_size`` ranks
(its world). Ranks are numbered stage by stage::

    rank = pipeline_rank * tensor_parallel_size + tensor_rank

so the ranks of one pipeline stage are consecutive and, with one launcher per
node, a node holds whole stages where it can. Within a stage the tensor ranks
shard every layer (attention heads, MLP columns, the vocabulary); the stages
hold consecutive runs of layers (:meth:`ParallelLayout.stage_layers`). With
``enable_expert_parallel`` a mixture-of-experts model spreads its routed experts
over the tensor ranks of its stage instead of sharding each expert.

A family reads the layout from :attr:`weft.contracts.model.ModelConfig.parallel`
(sizes, its rank, its layers) and the collectives from
:func:`weft.distributed.state.current_parallel` while its module is built.

The collectives of one process group are a :class:`Communicator`: plain
torch.distributed calls (gloo on CPU, NCCL on CUDA, whatever the platform names).
A platform may return a faster subclass from
:meth:`weft.contracts.platform.Platform.communicator`; weft-cuda's reduces small
messages through symmetric memory so decode graphs can capture them. With one
rank every collective returns its input: the same layers serve one device and
many. Like the rest of the contracts, importing this module imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch


class ParallelLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The parallel sizes of one model and the rank of the process that reads it."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    """Mixture-of-experts models: routed experts spread over the tensor ranks (each rank holds whole experts)."""
    pipeline_partition: tuple[int, ...] | None = None
    """Layers of each stage, first stage first; None splits them evenly (extra layers on the stages before the last)."""
    rank: int = 0
    """This process's rank in the model's world."""

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def pipeline_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_rank == self.pipeline_parallel_size - 1

    @property
    def output_rank(self) -> int:
        """The rank whose sampled tokens the executor returns: the last stage's first tensor rank."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        return self.tensor_parallel_size if self.enable_expert_parallel else 1

    def at_rank(self, rank: int) -> ParallelLayout:
        return msgspec.structs.replace(self, rank=rank)

    def stage_sizes(self, num_layers: int) -> list[int]:
        """Layers per stage: the explicit partition, or an even split."""
        if self.pipeline_partition is not None:
            return list(self.pipeline_partition)
        stages = self.pipeline_parallel_size
        sizes = [num_layers // stages] * stages
        # The last stage also runs the final norm and the LM head: the remainder goes to the ones before it.
        for stage in range(num_layers % stages):
            sizes[-2 - stage] += 1
        return sizes

    def stage_layers(self, num_layers: int, stage: int | None = None) -> range:
        """The layer indices of ``stage`` (default: this rank's stage)."""
        stage = self.pipeline_rank if stage is None else stage
        sizes = self.stage_sizes(num_layers)
        start = sum(sizes[:stage])
        return range(start, start + sizes[stage])

    def check_layers(self, num_layers: int) -> None:
        """Raise ValueError, with the numbers and the fix, when the stages cannot hold ``num_layers`` layers."""
        stages = self.pipeline_parallel_size
        if self.pipeline_partition is not None:
            partition = list(self.pipeline_partition)
            if sum(partition) != num_layers or min(partition) < 1:
                raise ValueError(
                    f"engine.pipeline_partition = {partition} gives {sum(partition)} layers, but the model has "
                    f"{num_layers}; list {stages} positive layer counts that sum to {num_layers}"
                )
        elif stages > num_layers:
            raise ValueError(
                f"engine.pipeline_parallel_size = {stages} is more stages than the model's {num_layers} layers; "
                f"use at most {num_layers} stages"
            )


def head_range(num_heads: int, tensor_parallel_size: int, tensor_rank: int) -> tuple[int, int]:
    """``(first head, count)`` of one tensor rank.

    Heads split evenly when ``tensor_parallel_size`` divides them; with fewer heads than ranks
    (key/value heads under grouped-query attention) each head is replicated on
    ``tensor_parallel_size // num_heads`` consecutive ranks.
    """
    if num_heads >= tensor_parallel_size:
        count = num_heads // tensor_parallel_size
        return tensor_rank * count, count
    return tensor_rank * num_heads // tensor_parallel_size, 1


def check_heads(name: str, num_heads: int, tensor_parallel_size: int, replicable: bool = False) -> None:
    """Raise ValueError naming the numbers when ``num_heads`` cannot be split over the tensor ranks.

    ``replicable`` heads (key/value heads) may also be fewer than the ranks when they divide them.
    """
    if num_heads % tensor_parallel_size == 0:
        return
    if replicable and num_heads < tensor_parallel_size and tensor_parallel_size % num_heads == 0:
        return
    choices = [size for size in range(1, num_heads + 1) if num_heads % size == 0]
    if replicable:
        choices = sorted(set(choices) | {size for size in range(num_heads, 4 * num_heads + 1) if size % num_heads == 0})
    raise ValueError(
        f"engine.tensor_parallel_size = {tensor_parallel_size} does not divide the model's {num_heads} {name}; "
        f"use a tensor_parallel_size among {', '.join(map(str, choices[:8]))}"
    )


class Communicator:
    """All-reduce, all-gather and reduce-scatter over ``group`` (a torch.distributed process group; None: one rank)."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.device = device
        if group is None:
            self.size, self.rank = 1, 0
        else:
            import torch.distributed as dist

            self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (may reuse ``tensor``'s memory)."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim``, rank 0 first."""
        if self.size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the sum over ranks: ``tensor``'s first dimension (which ``size`` divides) cut into
        ``size`` equal runs of rows, rank 0's first; this rank gets its run, summed over every rank."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        if tensor.shape[0] % self.size:
            raise ValueError(f"reduce_scatter: {tensor.shape[0]} rows do not split evenly over {self.size} ranks")
        output = tensor.new_empty((tensor.shape[0] // self.size, *tensor.shape[1:]))
        dist.reduce_scatter_tensor(output, tensor.contiguous(), group=self.group)
        return output

    def can_capture(self, dtype: torch.dtype) -> bool:
        """Whether collectives on ``dtype`` may be captured in the platform's graphs. Not plain
        torch.distributed's (NCCL hung there): with such a communicator decode runs eagerly under
        tensor parallelism."""
        return False

    def close(self) -> None:
        """Release what the communicator holds."""
