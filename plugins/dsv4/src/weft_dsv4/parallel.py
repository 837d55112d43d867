"""The parallel layout of a DSpark draft (speculative) model, derived from its target's.

The draft copies the target's whole parallel config and overrides only the tensor and pipeline
parallel sizes. Enumerating fields one by one to build the draft's config silently drops fields
added later (expert parallelism was lost that way, and the MoE draft failed to start).
Derived values (the world size) are computed from the fields, so they follow the copy; a dense
draft has no experts to spread, so it does not inherit expert parallelism.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

Layout = TypeVar("Layout", bound=msgspec.Struct)


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How one model is spread over devices."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    """Spread routed experts over the tensor x data parallel ranks instead of sharding each one."""
    distributed_backend: str = "nccl"

    def __post_init__(self) -> None:
        for field in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"ParallelConfig.{field} = {getattr(self, field)}: must be at least 1")

    @property
    def world_size(self) -> int:
        """Devices one replica spans (recomputed from the fields, so a copy can never carry a stale one)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size if self.enable_expert_parallel else 1


def draft_parallel_config(
    target: Layout, tensor_parallel_size: int, pipeline_parallel_size: int = 1, draft_is_moe: bool = True
) -> Layout:
    """The draft's config: the target's, whole, with only the tensor and pipeline parallel sizes replaced
    (and expert parallelism off for a dense draft).

    ``target`` is any frozen msgspec Struct with those fields: core's
    :class:`~weft.contracts.parallel.ParallelLayout` (``ModelConfig.parallel``, what the MTP speculator builds its
    layers with) or this module's :class:`ParallelConfig`. A per-stage partition of the target's layers
    (``pipeline_partition``) describes the target's stages, not the draft's: it is dropped when the stage
    count changes."""
    overrides: dict[str, object] = {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
    }
    if not draft_is_moe:
        overrides["enable_expert_parallel"] = False
    if (
        getattr(target, "pipeline_partition", None) is not None
        and pipeline_parallel_size != target.pipeline_parallel_size
    ):
        overrides["pipeline_partition"] = None
    return msgspec.structs.replace(target, **overrides)
