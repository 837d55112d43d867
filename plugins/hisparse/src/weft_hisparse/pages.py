"""The scheduler side of HiSparse: where each page of a request's compressed KV lives.

A request's compressed KV is a list of pages (one engine block each). A page starts **dirty**
(on the GPU only). The scheduler plans its copy to a row of the pinned host pool; the plan
travels to the workers in the step's connector metadata (:class:`SpillPlan`), and the page
becomes **clean** only when every worker acknowledged the copy (:meth:`PagePlanner.acknowledge`).
While free GPU blocks stay above ``transition_watermark = max(hot buffer blocks, num_blocks // 10)``
requests keep their pages pinned; below it, clean pages are **unpinned**, tail-first, except the
last ``keep_tail`` pages of each request: the GPU block goes back to the pool (counted free), but
the request keeps reading it until the pool hands the block out again (:meth:`PagePlanner.reused`);
from then on that page is read from the host.

Only the contiguous durable prefix of a request (leading pages whose host copy every worker
acknowledged) is published to the host prefix cache (:attr:`PagePlanner.host_prefix`), when the
request finishes: the host rows of each full prefix block of it stay, keyed by the block's chained
hash (the engine's, ``ConnectorRequest.block_hashes``), least recently used first, and go back to the
pool when it runs out of free rows. A preempted request's planned copies are dropped, never
published. Each piece of state has one writer: this planner, on the scheduler.

A later request whose prompt starts with published blocks has them copied back from the host
(:meth:`PagePlanner.cached_prefix`, :meth:`PagePlanner.take_prefix`): only this group is on the host,
so the connector fills this group of the engine's own prefix hit of the others (the core contract's
"Filling groups of a local hit"), which is what makes such a hit exact.
"""

from __future__ import annotations

import bisect
import enum
from collections import OrderedDict, deque
from collections.abc import Sequence

import msgspec


class PageState(enum.Enum):
    DIRTY = "dirty"
    """On the GPU only (a copy to the host may be planned)."""
    CLEAN = "clean"
    """On the GPU and, acknowledged by every worker, on the host."""
    UNPINNED = "unpinned"
    """On the host; the GPU block is free in the pool but still readable until it is reused."""


class Page(msgspec.Struct):
    gpu_block: int | None
    """None once the pool reused the block: the page is read from the host."""
    host_row: int | None = None
    state: PageState = PageState.DIRTY
    pending: frozenset[int] = frozenset()
    """Workers whose acknowledgement of the planned copy is still missing."""


class PlannedCopy(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    page: int
    gpu_block: int
    host_row: int


class SpillPlan(msgspec.Struct, frozen=True):
    """What the workers do this step: copy these pages to the host; these GPU blocks are unpinned."""

    copies: tuple[PlannedCopy, ...] = ()
    unpinned: tuple[int, ...] = ()


class PagePlanner:
    """Page states of every request, spill planning and the host pool's rows."""

    def __init__(
        self, num_blocks: int, hot_buffer_blocks: int, host_rows: int, workers: int, keep_tail: int = 2
    ) -> None:
        if host_rows < 1 or workers < 1:
            raise ValueError(f"HiSparse needs host rows and workers; got host_rows={host_rows}, workers={workers}")
        self.transition_watermark = max(hot_buffer_blocks, num_blocks // 10)
        self.workers = frozenset(range(workers))
        self.keep_tail = keep_tail
        self.free_host_rows = list(range(host_rows))
        self.pages: dict[str, list[Page]] = {}
        self._unpinned_blocks: dict[int, tuple[str, int]] = {}
        self._unplanned: deque[tuple[str, int]] = deque()
        """Dirty pages without a host row yet, oldest first (entries of released requests are skipped)."""
        self._clean: dict[str, list[int]] = {}
        """Per request: its clean (pinned) pages, ascending: what may be unpinned, without scanning every page."""
        self._num_unpinned: dict[str, int] = {}
        self.host_prefix: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        """The host prefix cache: per chained hash of a prefix block of a finished request, the host rows of its
        pages, least recently used first (taken back for copies when no row is free)."""

    def add_pages(self, request_id: str, gpu_blocks: list[int]) -> None:
        """New full pages of a request, in token order (dirty)."""
        pages = self.pages.setdefault(request_id, [])
        self._unplanned.extend((request_id, index) for index in range(len(pages), len(pages) + len(gpu_blocks)))
        pages.extend(Page(gpu_block=block) for block in gpu_blocks)

    def plan(self, free_gpu_blocks: int, demand: int = 0) -> SpillPlan:
        """Copies for dirty pages (while host rows last) and, below the watermark plus ``demand`` (blocks
        that admitted prefills are still to take), unpins."""
        copies = []
        while self._unplanned:
            request_id, index = self._unplanned[0]
            pages = self.pages.get(request_id)
            if (
                pages is None
                or index >= len(pages)
                or pages[index].state is not PageState.DIRTY
                or pages[index].pending
            ):
                self._unplanned.popleft()
                continue  # released, or planned already
            if not self.free_host_rows and self.host_prefix:
                _, rows = self.host_prefix.popitem(last=False)  # evict the least recently used prefix block
                self.free_host_rows.extend(rows)
            if not self.free_host_rows:
                break
            self._unplanned.popleft()
            page = pages[index]
            page.host_row = self.free_host_rows.pop(0)
            page.pending = self.workers
            copies.append(PlannedCopy(request_id, index, page.gpu_block, page.host_row))
        unpinned: list[int] = []
        target = self.transition_watermark + demand
        for request_id, clean in self._clean.items():
            if free_gpu_blocks + len(unpinned) >= target:
                break
            position = bisect.bisect_left(clean, len(self.pages[request_id]) - self.keep_tail)  # the last few kept
            while position and free_gpu_blocks + len(unpinned) < target:
                position -= 1
                index = clean.pop(position)  # tail-first
                page = self.pages[request_id][index]
                page.state = PageState.UNPINNED
                self._num_unpinned[request_id] = self._num_unpinned.get(request_id, 0) + 1
                unpinned.append(page.gpu_block)
                self._unpinned_blocks[page.gpu_block] = (request_id, index)
        return SpillPlan(copies=tuple(copies), unpinned=tuple(unpinned))

    def pinned(self, request_id: str) -> int:
        """The request's full pages that stay on the GPU until more of them are clean: the dirty ones
        (copies in flight) and the last ``keep_tail``; its clean pages before those can be lent at once."""
        count = len(self.pages.get(request_id, ()))
        lendable = bisect.bisect_left(self._clean.get(request_id, []), count - self.keep_tail)
        return count - self._num_unpinned.get(request_id, 0) - lendable

    def owner(self, gpu_block: int) -> tuple[str, int]:
        """The request and page an unpinned block still belongs to."""
        return self._unpinned_blocks[gpu_block]

    def acknowledge(self, worker: int, copies: tuple[PlannedCopy, ...]) -> None:
        """A worker finished these copies; a page is clean once every worker has."""
        for copy in copies:
            pages = self.pages.get(copy.request_id)
            if pages is None or copy.page >= len(pages) or pages[copy.page].host_row != copy.host_row:
                continue  # the request was preempted or finished meanwhile: nothing to mark
            page = pages[copy.page]
            page.pending = page.pending - {worker}
            if not page.pending and page.state is PageState.DIRTY:
                page.state = PageState.CLEAN
                bisect.insort(self._clean.setdefault(copy.request_id, []), copy.page)

    def reused(self, gpu_block: int) -> None:
        """The pool handed out an unpinned block: its page is read from the host from now on."""
        owner = self._unpinned_blocks.pop(gpu_block, None)
        if owner is not None:
            request_id, index = owner
            self.pages[request_id][index].gpu_block = None

    def cached_prefix(self, block_hashes: Sequence[bytes], first: int) -> int:
        """How many prefix blocks from block ``first`` on are in the host prefix cache, without a gap; no side
        effects (a lookup)."""
        count = 0
        while first + count < len(block_hashes) and block_hashes[first + count] in self.host_prefix:
            count += 1
        return count

    def take_prefix(self, block_hashes: Sequence[bytes]) -> list[tuple[int, ...]]:
        """The host rows of these cached prefix blocks (in order), which a request loads now: they become the most
        recently used, the deepest of them still taken back first."""
        rows = [self.host_prefix[key] for key in block_hashes]
        for key in reversed(block_hashes):
            self.host_prefix.move_to_end(key)
        return rows

    def durable_prefix(self, request_id: str) -> int:
        """Leading pages whose host copy is complete: what may be published to the host prefix cache."""
        count = 0
        for page in self.pages.get(request_id, ()):
            if page.state is PageState.DIRTY:
                break
            count += 1
        return count

    def release(self, request_id: str, block_hashes: Sequence[bytes] = (), pages_per_block: int = 1) -> list[int]:
        """A finished or preempted request: its host rows go back to the pool, planned copies included
        (never published); returns the GPU blocks it still pinned.

        A finished request passes the chained hashes of its prefix blocks (``pages_per_block`` pages each): the
        host rows of the blocks its contiguous durable prefix covers in full are published to the host prefix
        cache instead (a hash cached already keeps its rows: this request's go back to the pool)."""
        kept = self._publish(request_id, block_hashes, pages_per_block)
        pinned = []
        self._clean.pop(request_id, None)
        self._num_unpinned.pop(request_id, None)
        for page in self.pages.pop(request_id, ()):
            if page.host_row is not None and page.host_row not in kept:
                self.free_host_rows.append(page.host_row)
            if page.gpu_block is not None:
                if page.state is PageState.UNPINNED:
                    self._unpinned_blocks.pop(page.gpu_block, None)
                else:
                    pinned.append(page.gpu_block)
        return pinned

    def _publish(self, request_id: str, block_hashes: Sequence[bytes], pages_per_block: int) -> set[int]:
        """Publish the durable prefix's full blocks; returns the host rows the host prefix cache took."""
        pages = self.pages.get(request_id, [])
        kept: set[int] = set()
        # Deepest first, so that a request's deepest blocks are evicted first (the engine frees a request's blocks
        # tail-first likewise): a lookup by chained hash stops at the first block missing.
        for index in reversed(range(min(len(block_hashes), self.durable_prefix(request_id) // pages_per_block))):
            key = block_hashes[index]
            if key in self.host_prefix:
                self.host_prefix.move_to_end(key)
                continue
            rows = tuple(page.host_row for page in pages[index * pages_per_block : (index + 1) * pages_per_block])
            self.host_prefix[key] = rows  # durable pages have host rows
            kept.update(rows)
        return kept


class Location(msgspec.Struct, frozen=True, array_like=True):
    """Where one selected entry is read: ``kind`` is ``"gpu"`` (block), ``"hot"`` (row of the
    request's GPU hot buffer) or ``"host"`` (host row to copy into hot buffer row ``hot_row``)."""

    kind: str
    index: int
    hot_row: int = -1


class HotBuffer:
    """A request's GPU rows holding host pages copied in, least recently used evicted first."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._by_page: OrderedDict[int, int] = OrderedDict()

    def resolve(self, pages: list[Page], selected: list[int]) -> list[Location]:
        """Where each selected page is read this step; host pages are assigned hot rows (LRU)."""
        locations = []
        for index in selected:
            page = pages[index]
            if page.gpu_block is not None:
                locations.append(Location("gpu", page.gpu_block))
            elif index in self._by_page:
                self._by_page.move_to_end(index)
                locations.append(Location("hot", self._by_page[index]))
            else:
                if len(self._by_page) < self.rows:
                    row = len(self._by_page)
                else:
                    _, row = self._by_page.popitem(last=False)
                self._by_page[index] = row
                locations.append(Location("host", page.host_row, row))
        return locations
