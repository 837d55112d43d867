"""What a captured decode graph reads host entries through: a static page table and a hot buffer on the device.

A graph replays the same kernels every step, and the indexer's picks come out of its forward layer by layer, so
its reads (the core contract's ``CapturedSparseEntryReader``) take no decision on the host: their per-step state
lives in static buffers, sized once for the graph's ``rows`` (:class:`GraphReader`):

* the **page table**: per row, the host row of each page of its request (-1: read on the GPU), and the row's
  **slice** of the hot buffer, refilled on the host before every replay (:meth:`GraphReader.prepare`);
* the **hot buffer**, per layer: ``slices`` slices of ``hot_entries`` entries, one per request holding one, each
  entry with the host-pool entry it is a copy of (``keys``, -1: none) and the replay that last read it (``used``).

Each layer's read (:meth:`GraphReader.read`) resolves the picks of host pages on the device: one whose host-pool
entry is in the row's slice (a sort and a binary search of the slice's keys) is read from the hot buffer; a miss
is read from the host pool through its device address and kept, in pick order, in the least recently used entries
of the slice that this step did not read (a step's picks never evict each other; misses beyond those are read and
not kept). The reads are exact: the slice holds copies of host-pool entries, keyed by where they are in the pool,
and a host row written again drops its copies (:meth:`GraphReader.invalidate`), so a slice handed from one request
to another never serves bytes its new owner's rows no longer hold.

The last step, each pick from the hot buffer, the host pool or the GPU entries and the misses kept written to
their entries, is one Triton kernel on CUDA (:mod:`weft_hisparse.read_kernel`) which loads from the host pool only for
the misses, so only they cross the bus; on the CPU, or where Triton is not installed, torch ops (a
gather from the host pool over every pick, which on a GPU would load the pool's first entry for every pick that
is not a miss).

Slices: there are ``slices`` of them (``plugins.hisparse.graph_hot_requests``, at most the graph's rows), however
large the graph, so the hot buffer's memory does not grow with it. A request with host pages gets one in the first
replay that reads them and keeps it until it ends (:meth:`GraphReader.forget`) or a replay needs a slice when none
is free (then the request least recently replayed and not in that replay gives its up). A request that finds none
(every slice held by requests in the replay), rows without host pages and the padding rows point at the empty
slice (index ``slices``), which holds no copy and keeps none: such a row reads every miss from the host, exactly.

Order: all of it runs on the stream the graphs replay on. The table and slices are copied in before a replay and
after the previous one's reads; the hot buffer is read and written only inside replays; a host row is written
(the connector's ``wait_for_save``) after a synchronous copy from the device, so after every replay launched
before, and its copies are dropped before any later one. Nothing comes back to the host but the counts of hot and
host reads (:meth:`GraphReader.reads`), copied without waiting and taken once an event says they landed.

Memory: per layer ``slices * hot_entries`` entries (and one the torch path writes misses not kept to) with their
keys and stamps, and the page table's ``rows * pages``; allocated with the graphs, outside the KV-cache budget, and
logged then (:attr:`GraphReader.device_bytes`).
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch.nn.functional import pad

from weft.api import Kernel, compile_many


class GraphReader:
    """The static buffers decode graphs read host entries through, for up to ``rows`` rows of ``pages`` pages.

    ``caches``: the group's GPU caches by layer name (block first, ``[blocks, entries_per_page, entry_dim]``);
    ``host``: each layer's host pool, the same layout (pinned on a GPU); ``hot_entries``: entries per slice and
    layer in the hot buffer; ``slices``: requests holding a slice at once (at most ``rows``).
    """

    def __init__(
        self,
        caches: Mapping[str, torch.Tensor],
        host: Mapping[str, torch.Tensor],
        hot_entries: int,
        rows: int,
        pages: int,
        slices: int,
    ) -> None:
        cache = next(iter(caches.values()))
        device, width = cache.device, cache.shape[-1]
        self.per_page = cache.shape[1]
        self.hot_entries = hot_entries
        self.layers = {name: index for index, name in enumerate(caches)}
        self.empty_slice = slices
        """The slice of rows that cache nothing: its keys stay -1 and no miss is kept in it."""
        self.row_pages = torch.full((rows, pages), -1, dtype=torch.long, device=device)
        self.row_slices = torch.full((rows,), slices, dtype=torch.long, device=device)
        self.keys = torch.full((len(caches), slices + 1, hot_entries), -1, dtype=torch.long, device=device)
        """Per layer and slice: the host-pool entry (host row * entries per page + slot) each hot entry holds."""
        self.used = torch.zeros_like(self.keys)
        """Per layer and slice: the replay (:attr:`replay`) that last read each hot entry (0: never)."""
        self.hot = [cache.new_zeros((slices * hot_entries + 1, width)) for _ in caches]
        """Per layer: the slices' entries one after the other, then the row the torch path writes misses not kept to
        (one allocation each: the kernel's compiled variant assumes aligned rows)."""
        self.pools = [on_device(host[name], device).view(-1, width) for name in caches]
        self.replay = torch.zeros((), dtype=torch.long, device=device)
        """Counts the replays prepared: what a read stamps the entries it reads with."""
        self.counts = torch.zeros(2, dtype=torch.long, device=device)
        """Picks of host pages read from the hot buffer and from the host pool, over every replay."""
        self.device_bytes = sum(tensor.nbytes for tensor in (*self.hot, self.keys, self.used, self.row_pages))
        """What these buffers take on the device, beside the KV cache."""
        self.kernel = read_kernel(cache.dtype, width) if device.type == "cuda" else None
        """The final select's Triton kernel (:mod:`weft_hisparse.read_kernel`), compiled; None: torch ops."""
        self._host_counts = self.counts if device.type == "cpu" else torch.zeros(2, dtype=torch.long, pin_memory=True)
        self._counts_landing: torch.Event | None = None
        self._counts_reported = (0, 0)
        self._slices: OrderedDict[str, int] = OrderedDict()
        """The requests holding a slice, least recently replayed first."""
        self._free_slices = list(range(slices))

    def prepare(self, request_ids: Sequence[str], host_pages: Mapping[str, Mapping[int, int]], rows: int) -> None:
        """Before a replay of ``rows`` rows: row ``i`` holds ``request_ids[i]``, whose pages ``host_pages`` maps to
        their host rows; the rows after them are padding. Every row's table and slice are written afresh (one copy
        each to the device, on the stream, after the previous replay's reads)."""
        table = torch.full((rows, self.row_pages.shape[1]), -1, dtype=torch.long)
        slices = torch.full((rows,), self.empty_slice, dtype=torch.long)
        replayed = set(request_ids)
        for row, request_id in enumerate(request_ids):
            pages = host_pages.get(request_id)
            if pages:
                table[row, list(pages)] = torch.tensor(list(pages.values()))
                slices[row] = self._slice(request_id, replayed)
        self.row_pages[:rows].copy_(table, non_blocking=True)
        self.row_slices[:rows].copy_(slices, non_blocking=True)
        self.replay += 1

    def read(self, layer_name: str, selected: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """``selected`` ``[rows, k]`` picks (entry indices in each row's request, -1: none), ``entries`` what the
        model gathered for them from the GPU blocks: the picks of host pages replaced, from the hot buffer or the
        host pool; misses kept in the hot buffer. Device operations only."""
        layer, width = self.layers[layer_name], self.hot_entries
        rows = selected.shape[0]
        chosen = selected.clamp(min=0)
        host_rows = self.row_pages[:rows].gather(1, chosen // self.per_page)
        on_host = (selected >= 0) & (host_rows >= 0)
        wanted = torch.where(on_host, host_rows * self.per_page + chosen % self.per_page, -1)  # host-pool entries
        slices = self.row_slices[:rows]
        keys, used = self.keys[layer][slices], self.used[layer][slices]
        ordered, order = keys.sort(dim=1)
        found = torch.searchsorted(ordered, wanted).clamp(max=width - 1)
        hit = on_host & (ordered.gather(1, found) == wanted)
        column = order.gather(1, found)  # a hit's entry in its slice
        used = used.scatter_reduce(1, column, torch.where(hit, self.replay, 0), "amax")
        # Misses, in pick order, go to the least recently used entries this replay did not read (its picks never
        # evict each other); none in the empty slice. Column `width` takes the ones not kept and is dropped.
        miss = on_host & ~hit
        rank = miss.cumsum(1) - 1
        free = torch.where(slices == self.empty_slice, 0, (used < self.replay).sum(1))
        kept = miss & (rank < free[:, None])
        victim = used.argsort(dim=1, stable=True).gather(1, rank.clamp(0, width - 1))
        into = torch.where(kept, victim, width)
        now = self.replay.expand(into.shape)
        self.keys[layer].index_copy_(0, slices, pad(keys, (0, 1)).scatter(1, into, wanted)[:, :width])
        self.used[layer].index_copy_(0, slices, pad(used, (0, 1)).scatter(1, into, now)[:, :width])
        self.counts += torch.stack((hit.sum(), miss.sum()))
        first = slices[:, None] * width
        return self._select(
            layer,
            entries,
            torch.where(hit, first + column, -1),
            torch.where(miss, wanted, -1),
            torch.where(kept, first + victim, -1),
        )

    def _select(
        self,
        layer: int,
        entries: torch.Tensor,
        hot_rows: torch.Tensor,
        host_rows: torch.Tensor,
        keep_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Each pick from hot-buffer row ``hot_rows``, else host-pool row ``host_rows`` (also written to hot-buffer
        row ``keep_rows``), else ``entries`` (-1: none). The kernel loads from the host only the rows asked for."""
        hot, pool = self.hot[layer], self.pools[layer]
        if self.kernel is not None:
            entries = entries.contiguous()
            self.kernel(
                dtype=entries.dtype,
                width=entries.shape[-1],
                entries=entries,
                hot=hot,
                pool=pool,
                hot_rows=hot_rows,
                host_rows=host_rows,
                keep_rows=keep_rows,
            )
            return entries
        from_host = pool[host_rows.clamp(min=0)]
        read = torch.where(
            (hot_rows >= 0)[..., None],
            hot[hot_rows.clamp(min=0)],
            torch.where((host_rows >= 0)[..., None], from_host, entries),
        )
        discard = hot.shape[0] - 1
        hot.index_copy_(0, torch.where(keep_rows >= 0, keep_rows, discard).flatten(), from_host.flatten(0, 1))
        return read

    def invalidate(self, host_rows: Sequence[int]) -> None:
        """``host_rows`` of the pool were written again: drop their entries' copies, in every layer and slice."""
        stale = torch.isin(self.keys // self.per_page, torch.tensor(host_rows, device=self.keys.device))
        self.keys.masked_fill_(stale, -1)
        self.used.masked_fill_(stale, 0)

    def forget(self, request_id: str) -> None:
        """The request ended or was preempted: its slice is free (its copies stay valid copies of host entries)."""
        slice_index = self._slices.pop(request_id, None)
        if slice_index is not None:
            self._free_slices.append(slice_index)

    def reads(self) -> tuple[int, int]:
        """Picks of host pages read from the hot buffer and from the host pool since the last call, as far as the
        device's counts have reached the host: they are copied without waiting (counting on the host would
        synchronise it), so on a GPU a step's come with a later call."""
        if self._counts_landing is not None and not self._counts_landing.query():
            return 0, 0
        hits, misses = self._host_counts.tolist()
        reported, self._counts_reported = self._counts_reported, (hits, misses)
        if self._host_counts is not self.counts:
            self._host_counts.copy_(self.counts, non_blocking=True)
            self._counts_landing = torch.Event(device=self.counts.device)
            self._counts_landing.record()
        return hits - reported[0], misses - reported[1]

    def _slice(self, request_id: str, replayed: set[str]) -> int:
        """The request's slice: its own, a free one, or the one of the request least recently replayed that is not
        in this replay; the empty slice when every slice is held by a request in this replay."""
        if request_id not in self._slices:
            if self._free_slices:
                self._slices[request_id] = self._free_slices.pop(0)
            else:
                owner = next((owner for owner in self._slices if owner not in replayed), None)
                if owner is None:
                    return self.empty_slice
                self._slices[request_id] = self._slices.pop(owner)
        self._slices.move_to_end(request_id)
        return self._slices[request_id]


def read_kernel(dtype: torch.dtype, width: int) -> Kernel | None:
    """The final select's Triton kernel, compiled for ``dtype`` entries of ``width`` (so before any capture); None
    where Triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    from weft_hisparse.read_kernel import ReadHostEntriesKernel

    kernel = ReadHostEntriesKernel()
    compile_many(kernel, [kernel.dispatch(dtype, width)])
    return kernel


def on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (pinned on a GPU) as ``device``'s kernels address it: itself on the CPU; on CUDA the same memory
    through its device address (with unified addressing a pinned allocation's host pointer is its device pointer),
    so a kernel, and a graph replaying it, reads host rows over the bus with no copy launched from the host."""
    if device.type == "cpu":
        return host
    if not host.is_pinned():
        raise ValueError(f"weft-hisparse: the host pool must be pinned to be read from {device}")

    class Mapped:  # what torch.as_tensor reads a foreign device pointer from
        __cuda_array_interface__ = {
            "shape": (host.numel() * host.element_size(),),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "version": 3,
        }

    return torch.as_tensor(Mapped(), device=device).view(host.dtype).view(host.shape)
