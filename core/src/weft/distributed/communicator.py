"""The collectives tensor-parallel layers call, over one process group.

:class:`Communicator` runs them on torch.distributed (gloo on CPU, NCCL on CUDA,
whatever the platform names). A platform may return a faster one from
:meth:`weft.contracts.platform.Platform.communicator`; weft-cuda's reduces small
messages through symmetric memory so decode graphs can capture them.

With one rank every collective returns its input: the same layers serve one device
and many.
"""

from __future__ import annotations

from typing import Any

import torch


class Communicator:
    """All-reduce and all-gather over ``group`` (a torch.distributed process group; None: one rank)."""

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
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def can_capture(self, dtype: torch.dtype) -> bool:
        """Whether collectives on ``dtype`` may be captured in the platform's graphs. Not plain
        torch.distributed's (NCCL hung there): with such a communicator decode runs eagerly under
        tensor parallelism."""
        return False

    def close(self) -> None:
        """Release what the communicator holds."""
