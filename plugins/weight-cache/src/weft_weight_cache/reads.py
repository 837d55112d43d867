"""What one rank reads of its checkpoint: recorded by the daemon, replayed by the engine.

Under tensor and pipeline parallelism a rank needs only part of the checkpoint, and its model
family decides which part: its layers narrow each :class:`~weft.contracts.loader.WeightSlice` to
the rank's rows or columns (:mod:`weft.layers.tensor_parallel`), a pipeline stage skips the other
stages' layers, an expert-parallel rank the other ranks' experts. The daemon learns those reads
by running the family itself (:func:`rank_reads`): it builds the rank's model on the meta device
(no memory: the layers only work out their shards) under the rank's parallel layout, and hands
the family's ``load_weights`` the disk loader's slices wrapped in :class:`RecordingSlice`, which
keeps the result of every ``narrow`` and ``load``. The daemon holds those results and nothing
else. An engine rank gets each checkpoint tensor as a :class:`ResidentSlice` that answers exactly
those reads from the mapped arena, so it copies, byte for byte, what it would have read from disk.

A family that takes whole tensors (``reads_weight_slices`` false) reads them whole from disk too,
so its daemon holds them whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from weft.contracts.loader import ModelSource, WeightLoader, WeightSlice
from weft.contracts.model import ModelFamily
from weft.contracts.parallel import Communicator
from weft_weight_cache.protocol import TensorEntry

Narrow = list[int] | None
"""A read: ``[dim, start, length]`` for :meth:`WeightSlice.narrow`, None for :meth:`WeightSlice.load`."""


class TensorReads(NamedTuple):
    """One checkpoint tensor: its name, its whole shape, and what a rank read of it (each read once)."""

    name: str
    shape: tuple[int, ...]
    parts: list[tuple[Narrow, torch.Tensor]]


def whole_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[TensorReads]:
    for name, tensor in weights:
        yield TensorReads(name, tuple(tensor.shape), [(None, tensor)])


def _describe(narrow: Narrow) -> str:
    if narrow is None:
        return "the whole tensor"
    dim, start, length = narrow
    return f"{start}..{start + length - 1} along dim {dim}"


class RecordingSlice(WeightSlice):
    """A disk loader's slice that keeps what the model family reads of it in ``reads``."""

    def __init__(self, stored: WeightSlice, reads: TensorReads) -> None:
        self.stored, self.reads = stored, reads
        self.shape = tuple(stored.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._read([int(dim), int(start), int(length)])

    def load(self) -> torch.Tensor:
        return self._read(None)

    def _read(self, narrow: Narrow) -> torch.Tensor:
        for held, part in self.reads.parts:
            if held == narrow:  # read before: a tied head beside its embedding reads the same rows twice
                return part
        part = self.stored.load() if narrow is None else self.stored.narrow(*narrow)
        # A disk loader without partial reads narrows a whole tensor it read: keeping the view would keep all of it.
        part = part.clone() if part._is_view() else part
        self.reads.parts.append((narrow, part))
        return part


class ResidentSlice(WeightSlice):
    """A checkpoint tensor as a daemon holds it for one rank: the recorded reads, answered from the arena."""

    def __init__(self, entry: TensorEntry, views: list[torch.Tensor]) -> None:
        self.name = entry.name
        self.shape = tuple(entry.shape)
        self.parts = [(part.narrow, view) for part, view in zip(entry.parts, views, strict=False)]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._part([dim, start, length])

    def load(self) -> torch.Tensor:
        return self._part(None)

    def _part(self, narrow: Narrow) -> torch.Tensor:
        for held, view in self.parts:
            if held == narrow:
                return view
        held = ", ".join(_describe(held) for held, _ in self.parts) or "nothing"
        raise ValueError(
            f"weight-cache: the daemon holds {held} of {self.name!r} for this rank, and the model reads "
            f"{_describe(narrow)}: the daemon was started with other settings than this engine "
            "(engine.pipeline_partition, engine.enable_expert_parallel); restart `weft weights serve` with the "
            "engine's settings"
        )


class _TensorRank(Communicator):
    """A tensor-parallel group's size and one rank's place in it, for a model built only to learn its shards
    (it never runs a collective)."""

    def __init__(self, size: int, rank: int) -> None:
        super().__init__(None, torch.device("meta"))
        self.size, self.rank = size, rank


def rank_reads(
    config: Any, load_config: Any, loader: WeightLoader, source: ModelSource, family: ModelFamily, dtype: str
) -> list[TensorReads]:
    """What the engine worker that ``load_config`` places reads of ``source`` through ``loader``, with its results.

    ``dtype``: the worker's runtime dtype (the family's load dtype is what the reads come in)."""
    from weft.api import ParallelGroups, model_config, parallel_layout, using_parallel

    load_dtype = family.load_dtype(dtype)
    if not family.reads_weight_slices:
        return list(whole_tensors(loader.iter_weights(source, load_dtype)))
    layout = parallel_layout(
        config,
        rank=load_config.pipeline_parallel_rank * load_config.tensor_parallel_size + load_config.tensor_parallel_rank,
    )
    configured = model_config(config, source, dtype, layout)
    family.check_parallel(configured)
    meta = torch.device("meta")
    with using_parallel(ParallelGroups(layout, _TensorRank(layout.tensor_parallel_size, layout.tensor_rank), meta)):
        module = family.build(configured, meta)
    reads: list[TensorReads] = []

    def recording() -> Iterator[tuple[str, WeightSlice]]:
        for name, stored in loader.iter_weight_slices(source, load_dtype):
            reads.append(TensorReads(name, tuple(stored.shape), []))
            yield name, RecordingSlice(stored, reads[-1])

    family.load_weights(module, recording())
    return reads
