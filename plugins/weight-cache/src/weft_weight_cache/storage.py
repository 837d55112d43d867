"""The arena: every part of a checkpoint tensor one rank reads (:mod:`weft_weight_cache.reads`), in one
block of memory another process can map.

On the CPU the block is a ``memfd`` (anonymous shared memory), sealed against writes and resizing
once filled, and handed to engines as a file descriptor over the socket; an engine maps it
copy-on-write, so nothing it does reaches the daemon's copy. On a GPU it is one CUDA allocation
whose IPC handle (``cudaIpcGetMemHandle``, through torch's storage sharing) engines open on the
same device. Parts sit at 256-byte aligned offsets.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from weft_weight_cache.protocol import Arena, CudaHandle, TensorEntry, TensorPart
from weft_weight_cache.reads import TensorReads

ALIGN = 256
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout(reads: list[TensorReads]) -> tuple[list[TensorEntry], int]:
    entries, offset = [], 0
    for read in reads:
        parts = []
        for narrow, tensor in read.parts:
            offset = -(-offset // ALIGN) * ALIGN
            parts.append(TensorPart(narrow, dtype_name(tensor.dtype), list(tensor.shape), offset))
            offset += tensor.numel() * tensor.element_size()
        entries.append(TensorEntry(read.name, list(read.shape), parts))
    return entries, max(offset, 1)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class ResidentWeights:
    """A daemon's weights (the parts its rank reads of each checkpoint tensor), packed into one arena on its device."""

    def __init__(self, reads: Iterable[TensorReads], device: str) -> None:
        reads = list(reads)
        self.entries, self.nbytes = layout(reads)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.fd = -1
            self.block = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            self._fill(self.block, reads)
            torch.cuda.synchronize(self.device)
        else:
            self.fd = os.memfd_create("weft-weight-cache", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(self.fd, self.nbytes)
            with mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED) as writable:
                block = torch.frombuffer(writable, dtype=torch.uint8)
                self._fill(block, reads)
                del block
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)

    def _fill(self, block: torch.Tensor, reads: list[TensorReads]) -> None:
        for entry in self.entries:
            read = reads.pop(0)  # drop the loader's copies as soon as they are in the arena
            for part, (_, tensor) in zip(entry.parts, read.parts, strict=False):
                source = _byte_view(tensor)
                block[part.offset : part.offset + source.numel()].copy_(source)

    def describe(self) -> tuple[Arena, tuple[int, ...]]:
        """The arena for one engine, and the descriptors to pass with it."""
        if self.device.type == "cuda":
            storage = self.block.untyped_storage()
            device, handle, size, offset, counter, counter_offset, event, sync = storage._share_cuda_()
            cuda = CudaHandle(
                int(device),
                bytes(handle),
                int(size),
                int(offset),
                bytes(counter),
                int(counter_offset),
                None if event is None else bytes(event),
                bool(sync),
            )
            return Arena(kind="cuda", nbytes=self.nbytes, cuda=cuda), ()
        return Arena(kind="host", nbytes=self.nbytes), (self.fd,)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_arena(arena: Arena, fds: list[int], device: str) -> torch.Tensor:
    """The arena as a uint8 tensor in this process (a private copy-on-write map, or the opened CUDA handle)."""
    if arena.kind == "host":
        if len(fds) != 1:
            raise ValueError(f"weight-cache: a host arena comes with one descriptor, got {len(fds)}")
        size = os.fstat(fds[0]).st_size
        if size < arena.nbytes:
            raise ValueError(f"weight-cache: the shared arena holds {size} bytes, {arena.nbytes} announced")
        mapped = mmap.mmap(fds[0], arena.nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return torch.frombuffer(mapped, dtype=torch.uint8)
    if arena.kind == "cuda" and arena.cuda is not None:
        handle: Any = arena.cuda
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            handle.device,
            handle.handle,
            handle.size,
            handle.offset,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle,
            handle.event_sync_required,
        )
        block = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", handle.device))
        return block.set_(storage, 0, (arena.nbytes,), (1,))
    raise ValueError(f"weight-cache: arena kind {arena.kind!r} is not one this loader maps")


def part_views(block: torch.Tensor, entries: list[TensorEntry]) -> Iterator[tuple[TensorEntry, list[torch.Tensor]]]:
    """Each checkpoint tensor's entry with views of its parts in ``block``."""
    for entry in entries:
        views = []
        for part in entry.parts:
            dtype = getattr(torch, part.dtype)
            count = 1
            for size in part.shape:
                count *= size
            nbytes = count * torch.empty(0, dtype=dtype).element_size()
            views.append(block[part.offset : part.offset + nbytes].view(dtype).view(part.shape))
        yield entry, views
