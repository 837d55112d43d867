"""This process's place in the model's world: its process groups and what runs over them.

:func:`init_parallel` joins torch.distributed (the store from
:mod:`weft.distributed.rendezvous`) and creates the groups every rank creates, in
the same order: one tensor-parallel group per stage, one pipeline group per tensor
rank, and a gloo group over the whole world for small host-side exchanges (NCCL
moves device tensors only). The model's layers find the tensor-parallel
:class:`~weft.contracts.parallel.Communicator` through :func:`current_parallel`
while the model is built; the runner uses the rest (pipeline sends, the sampled
tokens' broadcast, the KV connector's reports).

Outside a multi-process engine (one device, a model built by hand),
:func:`current_parallel` is :data:`SINGLE`: one rank, every collective a no-op.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from weft.contracts.parallel import Communicator, ParallelLayout

if TYPE_CHECKING:
    from weft.contracts.platform import Platform


class ParallelGroups:
    """The groups of one rank (or of a single-process engine, with none)."""

    def __init__(
        self,
        layout: ParallelLayout,
        tensor: Communicator,
        device: torch.device,
        world_cpu_group: Any = None,
        distributed: bool = False,
    ) -> None:
        self.layout = layout
        self.tensor = tensor
        """Collectives over this stage's tensor-parallel ranks."""
        self.device = device
        self.world_cpu_group = world_cpu_group
        """gloo over every rank of the model, for host objects."""
        self.distributed = distributed

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def send_to_next_stage(self, tensors: dict[str, torch.Tensor]) -> list[Any]:
        """Send a stage's output to the same tensor rank of the next stage; returns the pending sends."""
        import torch.distributed as dist

        destination = self.layout.rank + self.layout.tensor_parallel_size
        return [dist.isend(tensors[name].contiguous(), dst=destination) for name in sorted(tensors)]

    def receive_from_previous_stage(
        self, spec: dict[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> dict[str, torch.Tensor]:
        """The previous stage's output, shaped as ``spec`` says (every stage knows the step's token counts)."""
        import torch.distributed as dist

        source = self.layout.rank - self.layout.tensor_parallel_size
        received = {}
        for name in sorted(spec):
            shape, dtype = spec[name]
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(tensor, src=source)
            received[name] = tensor
        return received

    def broadcast_from_output_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """The output rank's ``tensor`` (same shape and dtype on every rank), on every rank."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        dist.broadcast(tensor, src=self.layout.output_rank)
        return tensor

    def all_gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value``, rank 0 first (over gloo: host objects)."""
        if self.world_size == 1:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.world_cpu_group)
        return gathered

    def close(self) -> None:
        self.tensor.close()
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.distributed = False


SINGLE = ParallelGroups(ParallelLayout(), Communicator(None, torch.device("cpu")), torch.device("cpu"))
"""One rank: what a model built outside a multi-process engine sees."""

_current: contextvars.ContextVar[ParallelGroups] = contextvars.ContextVar("weft_parallel", default=SINGLE)


@contextlib.contextmanager
def using_parallel(groups: ParallelGroups) -> Iterator[None]:
    """Build models inside the block with ``groups`` (their layers keep what they read)."""
    token = _current.set(groups)
    try:
        yield
    finally:
        _current.reset(token)


def current_parallel() -> ParallelGroups:
    """The groups of the model being built; :data:`SINGLE` outside :func:`using_parallel`."""
    return _current.get()


def init_parallel(
    layout: ParallelLayout, platform: Platform, device: torch.device, store: Any, timeout: float
) -> ParallelGroups:
    """Join the model's world through ``store`` and create its groups (every rank calls this together)."""
    import torch.distributed as dist

    backend = platform.distributed_backend
    expire = datetime.timedelta(seconds=timeout)
    options: dict[str, Any] = {}
    if device.type != "cpu":
        options["device_id"] = device
    dist.init_process_group(
        backend, store=store, rank=layout.rank, world_size=layout.world_size, timeout=expire, **options
    )
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    tensor_group = None
    for stage in range(pp):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks, timeout=expire) if tp > 1 else None
        if layout.rank in ranks:
            tensor_group = group
    world_cpu = dist.new_group(backend="gloo", timeout=expire) if backend != "gloo" else dist.group.WORLD
    tensor = platform.communicator(tensor_group, device) if tensor_group is not None else Communicator(None, device)
    return ParallelGroups(layout, tensor, device, world_cpu, distributed=True)
