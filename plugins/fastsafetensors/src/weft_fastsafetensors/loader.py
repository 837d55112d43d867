"""The "fastsafetensors" loader: a Hugging Face safetensors folder read with the fastsafetensors package.

Sources and resolution are the plain ``safetensors`` loader's (folders, repo ids, downloads); only
reading differs. The shards are read straight into the worker's device: with GPU-direct storage
(cuFile) where it works, through a pinned bounce buffer otherwise, and into host memory on the CPU.

Under torch.distributed (the world group, once initialised with more than one rank) the reading is
split over the ranks: each batch gives every rank one shard to read, and each tensor reaches every
rank by a broadcast from the one that read it. That makes loading collective: every rank of the world
must load the same model at the same time. A model that only some ranks hold (a draft model on the
last pipeline stage) would wait forever, so this loader names the plain reader as its
``single_stage_fallback`` and :func:`weft.resolve.draft_load_config` hands such a model to it.

Ranks given to torch.distributed calls are global ranks (:func:`global_rank`), never a subgroup's own
numbering: a subgroup's rank 0 is not the world's rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec

from weft.api import SafetensorsLoader, cast, weight_files
from weft.contracts.loader import ModelSource

if TYPE_CHECKING:  # torch loads where tensors are read: weft serve's API process resolves with this loader
    import torch

logger = logging.getLogger("weft.fastsafetensors")


class FastSafetensorsOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    gds: Annotated[
        Literal["auto", "off"],
        msgspec.Meta(
            description="GPU-direct storage: auto (used where cuFile works, else a bounce buffer), off (never)"
        ),
    ] = "auto"
    max_threads: Annotated[int, msgspec.Meta(ge=1, description="threads copying file data")] = 16
    bounce_buffer_kb: Annotated[int, msgspec.Meta(ge=64, description="bounce buffer per copy thread, KiB")] = 16 * 1024


def world_group() -> Any:
    """The world process group when torch.distributed runs with several ranks, else None (one reader)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def global_rank(group: Any, group_rank: int) -> int:
    """The world rank of ``group``'s rank ``group_rank``: what ``src``/``dst`` of torch.distributed take."""
    import torch.distributed as dist

    return dist.get_global_rank(group, group_rank)


def agree_on_files(files: list[str], group: Any) -> list[str]:
    """The shard list every rank of ``group`` reads: the group's first rank's, checked against each rank's own.

    Ranks that see different checkpoints (a stale copy on one node) would otherwise pair tensors
    wrongly or wait for one another forever.
    """
    import torch.distributed as dist

    if group is None:
        return files
    chosen = [files]
    dist.broadcast_object_list(chosen, src=global_rank(group, 0), group=group)
    if [Path(file).name for file in chosen[0]] != [Path(file).name for file in files]:
        raise ValueError(
            f"fastsafetensors: rank {dist.get_rank()} sees shards {[Path(f).name for f in files]} but the group's "
            f"first rank (world rank {global_rank(group, 0)}) sees {[Path(f).name for f in chosen[0]]}: every rank "
            "must load the same checkpoint"
        )
    return files


def batches(files: list[str], readers: int) -> list[dict[int, list[str]]]:
    """Shards in batches of one per reader: ``{group rank: [file]}``, so each rank reads a 1/readers share."""
    return [
        {rank: [file] for rank, file in enumerate(files[start : start + readers])}
        for start in range(0, len(files), readers)
    ]


class FastSafetensorsLoader(SafetensorsLoader):
    """Safetensors folders read with fastsafetensors: GPU-direct where available, reading split over ranks."""

    Options = FastSafetensorsOptions
    priority: ClassVar[int] = -10
    """Never chosen by ``auto`` over the plain reader: ``use.loader = "fastsafetensors"`` asks for it."""
    single_stage_fallback: ClassVar[str | None] = "safetensors"

    def iter_weights(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        from fastsafetensors import SafeTensorsFileLoader

        options: FastSafetensorsOptions = self.options
        group = world_group()
        files = agree_on_files([str(file) for file in weight_files(Path(source.path))], group)
        device = self.load_config.device
        reader = SafeTensorsFileLoader(
            group,
            device,
            nogds=device == "cpu" or options.gds == "off",
            max_threads=options.max_threads,
            bbuf_size_kb=options.bounce_buffer_kb,
        )
        logger.info(
            "fastsafetensors: %d shards to %s with %s, %d reader(s)",
            len(files),
            device,
            reader.copier_class.__name__,
            reader.pg.size(),
        )
        try:
            for batch in batches(files, reader.pg.size()):
                reader.add_filenames(batch)
                buffer = reader.copy_files_to_device()
                try:
                    for name in reader.get_keys():
                        yield name, cast(buffer.get_tensor(name), dtype)
                finally:
                    buffer.close()
                    reader.reset()
        finally:
            reader.close()
