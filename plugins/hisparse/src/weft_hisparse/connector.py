"""HiSparse as a KV connector (``use.kv_connector = "hisparse"``): both roles.

Scheduler role: the pages (blocks) of the sparse group (``csa_kv`` for DeepSeek V4) of each decoding
request join :class:`~weft_hisparse.pages.PagePlanner` once full; each step the planner's copies
travel to the workers in :class:`HiSparseStep`, the pages acknowledged by every rank turn clean,
and below the transition watermark clean pages are lent back to the engine's pool (the core
contract's "Lent blocks"). A lent block the pool hands to another request (``ConnectorStep.reclaimed``)
turns its page into host reads, sent to the workers as :class:`HostPage` s. A prefill holds every page
of its prompt (after a preemption: of its prompt and outputs), so a waiting request whose pages would not fit
beside what the others keep pinned waits (the lookup answers None) instead of being admitted and later
preempting a running request; it keeps its place in the queue (the requests behind it must leave its pages
free), and one asking for prompt logprobs is gated like the others. A finished request's contiguous durable
prefix stays in the planner's host prefix cache, keyed by the engine's prompt block hashes. A later request
whose prompt blocks are in it loads them (:meth:`get_num_new_matched_tokens`): the connector fills its group of
the engine's own prefix hit (:meth:`fills_groups`, the core contract's "Filling groups of a local hit"), its
workers copying the host rows into the request's GPU blocks before the forward (:meth:`start_load_kv`).

Worker role: the host pool (pinned on CUDA, plain host memory on the CPU platform) of every layer
of the group, the planned copies made after the forward (:meth:`wait_for_save`) and acknowledged
under this rank, and the model's sparse reads: of each row's selected entries, those of host pages
come from the request's hot buffer, copied in from the host only when missing (LRU). Eagerly
(:meth:`read`) the resolver runs on the host; in a captured decode graph (:meth:`read_rows`) on the
device, over static buffers refilled before every replay (:mod:`weft_hisparse.graph_reader`).

Only decoding requests (one token a step) take part: prefill reads every entry, decode only the top-k.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec
import torch
from msgspec import Meta

from weft.contracts.kv_connector import (
    ConnectorContext,
    ConnectorMetric,
    ConnectorOutput,
    ConnectorRequest,
    ConnectorStep,
    KVConnector,
    LentBlock,
    SparseEntryReader,
    block_axis,
    connector_block_size,
)
from weft_hisparse.graph_reader import GraphReader
from weft_hisparse.pages import HotBuffer, Page, PagePlanner, PlannedCopy

if TYPE_CHECKING:
    from weft.contracts.kv_cache import KVCacheGroupSpec

logger = logging.getLogger("weft.hisparse")


class HiSparseOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[plugins.hisparse]``: the host pool and the GPU hot buffer."""

    group: Annotated[str, Meta(min_length=1, description="the KV-cache group read sparsely (DeepSeek V4: csa_kv)")] = (
        "csa_kv"
    )
    host_pages: Annotated[int, Meta(ge=1, description="pages (blocks of the group, every layer) in the host pool")] = (
        4096
    )
    hot_buffer_blocks: Annotated[
        int,
        Meta(
            ge=1,
            description="GPU rows per request and layer for entries copied in from the host, in blocks of "
            "entries (decode graphs: per slice of graph_hot_requests, allocated with the graphs)",
        ),
    ] = 4
    graph_hot_requests: Annotated[
        int,
        Meta(
            ge=0,
            description="decode graphs: requests holding a slice of hot_buffer_blocks in the hot buffer at "
            "once (at most the largest graph's rows; the others read every miss from the host "
            "pool); it bounds the hot buffer's memory, which is outside the KV-cache budget",
        ),
    ] = 16
    keep_tail: Annotated[int, Meta(ge=1, description="last pages of each request that stay pinned on the GPU")] = 2
    gpu_share: Annotated[
        float,
        Meta(
            gt=0,
            lt=1,
            description="the group's GPU pages, as a share of what its requests would hold, when the "
            "engine sizes the cache from memory (the other groups get what theirs hold); "
            "it must hold one request of max_model_len, since a prefill reads every entry",
        ),
    ] = 0.1


class HostPage(msgspec.Struct, frozen=True, array_like=True):
    """Page ``page`` of a request is read from host row ``host_row`` from this step on."""

    request_id: str
    page: int
    host_row: int


class PageLoad(msgspec.Struct, frozen=True, array_like=True):
    """Copy host row ``host_row`` into GPU block ``gpu_block`` (a page of a host prefix hit)."""

    gpu_block: int
    host_row: int


class HiSparseStep(msgspec.Struct, frozen=True):
    """What the workers do in one step."""

    copies: tuple[PlannedCopy, ...] = ()
    """Pages to copy to the host after the forward, then acknowledge."""
    loads: tuple[PageLoad, ...] = ()
    """Pages of host prefix hits to copy into the GPU blocks before the forward (the step's synchronous loads)."""
    host_pages: tuple[HostPage, ...] = ()
    dropped: tuple[str, ...] = ()
    """Requests preempted since the last step: forget their host pages and hot buffers."""


class _Prefill(msgspec.Struct):
    """An admitted request computing its prompt (scheduler role)."""

    prompt_tokens: int
    pages: int
    """Blocks of the group it holds once its prompt is computed."""
    held: int = 0
    """Blocks of the group it holds so far."""


def copy_name(copy: PlannedCopy) -> str:
    """How a worker acknowledges a copy (``ConnectorOutput.acknowledged``)."""
    return f"{copy.host_row}:{copy.page}:{copy.request_id}"


class HiSparseConnector(KVConnector):
    """Host-resident sparse decode: the sparse group's pages in a host pool, GPU blocks a write-back cache."""

    name: ClassVar[str] = "hisparse"
    metadata_type: ClassVar[Any] = HiSparseStep
    metrics: ClassVar[tuple[ConnectorMetric, ...]] = (
        ConnectorMetric("pages_copied_total", "Pages of the sparse group copied to the host pool"),
        ConnectorMetric("host_entries_read_total", "Selected entries of host pages read from the host pool"),
        ConnectorMetric("hot_entries_read_total", "Selected entries of host pages read from the GPU hot buffer"),
        ConnectorMetric("host_prefix_pages_loaded_total", "Pages of prompt prefixes loaded from the host prefix cache"),
        ConnectorMetric(
            "graph_buffer_bytes_total",
            "Bytes of the decode graphs' hot buffer and page table on the GPU, "
            "outside the KV-cache budget (counted once, at capture)",
        ),
    )
    Options = HiSparseOptions
    gates_admission: ClassVar[bool] = True

    def __init__(
        self,
        options: HiSparseOptions | None,
        role: Literal["scheduler", "worker"],
        groups: Sequence[KVCacheGroupSpec],
        context: ConnectorContext,
    ) -> None:
        super().__init__(options, role, groups, context)
        names = [group.name for group in self.groups]
        if self.options.group not in names:
            raise ValueError(
                f"plugins.hisparse.group = {self.options.group!r}: the model has no such KV-cache group (it has "
                f"{names}); HiSparse needs a model that reads a compressed group sparsely, such as DeepSeek V4 (csa_kv)"
            )
        self.group = names.index(self.options.group)
        spec = self.groups[self.group].spec
        self.page_tokens = spec.block_size
        self.prefix_block_tokens = connector_block_size(self.groups) or self.page_tokens
        """Tokens of one prefix block (``ConnectorRequest.block_hashes``)."""
        self._pages_per_block = self.prefix_block_tokens // self.page_tokens
        """Pages of the group in one prefix block."""
        self.rank = context.pp_rank * context.tp_size + context.tp_rank
        # Scheduler role.
        self.planner: PagePlanner | None = None
        self._planned: dict[str, PlannedCopy] = {}
        self._lend: tuple[LentBlock, ...] = ()
        self._prefilling: dict[str, _Prefill] = {}
        """Admitted requests still computing their prompt: each holds (and reads) all its pages."""
        self._decoding: set[str] = set()
        self._admitted: set[str] = set()
        """Requests admitted since the last step: one preempted and admitted again in the same step keeps its record."""
        self._fitting: dict[str, int] = {}
        """Waiting requests the lookup found to fit since the last step, with their prefill's pages: unpinned for
        ahead of their admission, whose first chunk may need more than the watermark leaves free."""
        self._held_back: dict[str, int] = {}
        """Waiting requests the lookup held back since the last step, with their prefill's pages, in the order
        asked (the queue's): what a request asked after them must leave free."""
        self._ends: dict[str, int] = {}
        """Per request: the most tokens its steps so far computed (what a recompute after a preemption redoes)."""
        self._num_blocks: int | None = None
        """The group's pool, from the first step on."""
        self._filling: dict[str, tuple[bytes, ...]] = {}
        """Requests admitted since the last step with a host prefix hit: their prompt block hashes."""
        # Worker role.
        self.layers: dict[str, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}
        self._step: HiSparseStep | None = None
        self._host_pages: dict[str, dict[int, int]] = {}
        self._hot: dict[tuple[str, str], tuple[HotBuffer, int]] = {}
        """Per (request, layer): its resolver and the first row of its slice of the layer's hot pool."""
        self._slots: dict[str, list[str | None]] = {}
        """Per layer: the request holding each slice of its hot pool (None: free)."""
        self._hot_pools: dict[str, torch.Tensor] = {}
        self._acknowledged: list[str] = []
        self._observations: dict[str, list[float]] = {}
        self._graph: GraphReader | None = None
        """What captured decode graphs read through (from :meth:`capture_rows` on)."""

    # Scheduler role.

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The prompt's pages after the engine's local hit that the host prefix cache holds (:meth:`_host_hit`); but
        a request whose prefill (which reads, so holds, every page of its prompt, and after
        a preemption of its outputs so far) would not fit beside what the running ones keep on the GPU waits (None)
        rather than take blocks from a running one.

        A request held back keeps its place: the engine asks in queue order, and a request asked after one held
        back in the same step is let in only if it fits beside the pages of every request held back ahead of it,
        so that requests behind never take the pages the one ahead waits for (a large prefill at the head is not
        passed over for good by a stream of small ones). With nothing committed the first asked is let in whatever
        it needs, so the queue always moves.

        A decoding request keeps its dirty pages, its last ``keep_tail`` (once it has them) and the page it writes;
        its other clean pages can be lent. So each request counts at least ``keep_tail + 1`` pages: a short prompt
        grows to that many, and counting fewer lets in more requests than can keep their tails."""
        least = self.options.keep_tail + 1
        committed = sum(max(prefill.pages, least) for prefill in self._prefilling.values())
        if self.planner is not None:
            committed += sum(max(self.planner.pinned(request_id) + 1, least) for request_id in self._decoding)
        committed += sum(pages for request_id, pages in self._held_back.items() if request_id != request.request_id)
        pages = max(self._prefill_pages(request), least)
        # Memos for this step, as a store's lookup caches its hits: the order held back, and the next step's unpins.
        if committed and (self._num_blocks is None or committed + pages > self._num_blocks):
            self._held_back[request.request_id] = pages
            return None, False
        self._fitting[request.request_id] = pages
        return self._host_hit(request, num_computed_tokens), False

    def _host_hit(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        """Tokens after the engine's local hit whose pages the host prefix cache holds, in whole prefix blocks and
        short of the last prompt token (the engine caps it further at what its other groups hold)."""
        if self.planner is None:
            return 0
        size = self.prefix_block_tokens
        first, usable = num_computed_tokens // size, (len(request.prompt_token_ids) - 1) // size
        return min(self.planner.cached_prefix(request.block_hashes, first), max(usable - first, 0)) * size

    def fills_groups(self) -> tuple[int, ...]:
        """Only the sparse group is on the host: a host prefix hit fills it beside the engine's hit of the others
        (whose ring and compressor state the model restores from the snapshots that hit shares), so it is exact."""
        return (self.group,)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...], num_external_tokens: int
    ) -> None:
        self._decoding.discard(request.request_id)  # admitted again after a preemption: it computes its prompt afresh
        self._prefilling[request.request_id] = _Prefill(len(request.prompt_token_ids), self._prefill_pages(request))
        self._admitted.add(request.request_id)
        if num_external_tokens:
            self._filling[request.request_id] = request.block_hashes

    def _prefill_pages(self, request: ConnectorRequest) -> int:
        """Pages the request holds once it computed its tokens and writes the next one. After a preemption it
        recomputes its prompt and outputs: every output was sampled by a step ending at its position, so it
        has at most one token more than its steps computed (exactly that many, unless the step that computed
        the most was still in flight when it was preempted: then one token over)."""
        tokens = max(len(request.prompt_token_ids), self._ends.get(request.request_id, 0) + 1)
        return self.groups[self.group].spec.blocks_for_tokens(tokens + 1)

    def build_connector_meta(self, step: ConnectorStep) -> HiSparseStep:
        if self.planner is None:
            self.planner = PagePlanner(
                step.num_blocks[self.group],
                self.options.hot_buffer_blocks,
                self.options.host_pages,
                self.context.tp_size * self.context.pp_size,
                self.options.keep_tail,
            )
        planner = self.planner
        self._num_blocks = step.num_blocks[self.group]
        for request_id in step.preempted:
            planner.release(request_id)
            if request_id not in self._admitted:  # else: preempted, then admitted again while scheduling this step
                self._prefilling.pop(request_id, None)
                self._decoding.discard(request_id)
        self._admitted.clear()
        loads = self._plan_loads(step)  # before plan(): rows loaded now are the most recently used
        host_pages = []
        for lent in step.reclaimed:
            if lent.group != self.group or lent.request_id not in planner.pages:
                continue
            page = planner.pages[lent.request_id][lent.position]
            planner.reused(page.gpu_block)
            host_pages.append(HostPage(lent.request_id, lent.position, page.host_row))
        starting = 0  # decoding requests whose next token starts a page: each takes a block in the next step
        for request in step.requests:
            end = request.num_computed_tokens + request.num_new_tokens
            self._ends[request.request_id] = max(self._ends.get(request.request_id, 0), end)
            prefill = self._prefilling.get(request.request_id)
            if prefill is not None and (
                request.num_new_tokens != 1 or request.num_computed_tokens < prefill.prompt_tokens
            ):
                prefill.held = len(request.block_ids[self.group])
                continue  # prefilling: it reads every entry
            if request.num_new_tokens != 1:
                continue  # recomputing its outputs after a preemption: it reads every entry
            self._prefilling.pop(request.request_id, None)
            self._decoding.add(request.request_id)
            known = len(planner.pages.get(request.request_id, ()))
            full = end // self.page_tokens
            if full > known:
                planner.add_pages(request.request_id, list(request.block_ids[self.group][known:full]))
            starting += end % self.page_tokens == 0
        # Unpin ahead of the admitted prefills' next chunks and of the decoding requests' next pages, so that they
        # never wait on a lend nor preempt for one.
        demand = starting + sum(max(prefill.pages - prefill.held, 0) for prefill in self._prefilling.values())
        demand += sum(pages for request_id, pages in self._fitting.items() if request_id not in self._prefilling)
        self._fitting.clear()
        self._held_back.clear()
        plan = planner.plan(step.free_blocks[self.group], demand)
        for copy in plan.copies:
            self._planned[copy_name(copy)] = copy
        self._lend = tuple(
            LentBlock(request_id, self.group, page) for request_id, page in map(planner.owner, plan.unpinned)
        )
        return HiSparseStep(
            copies=plan.copies, loads=loads, host_pages=tuple(host_pages), dropped=tuple(sorted(step.preempted))
        )

    def _plan_loads(self, step: ConnectorStep) -> tuple[PageLoad, ...]:
        """The host prefix hits of the requests admitted for this step: host rows into their fresh GPU blocks.

        The workers read the rows before this step's forward; a row that :meth:`PagePlanner.plan` takes back for a
        copy in this step is written only after it."""
        loads = []
        for request in step.requests:
            hashes = self._filling.pop(request.request_id, None)
            if hashes is None or not request.num_external_tokens:
                continue
            size = self.prefix_block_tokens
            first = (request.num_computed_tokens - request.num_external_tokens) // size
            blocks = range(first, first + request.num_external_tokens // size)
            missing = [index for index in blocks if hashes[index] not in self.planner.host_prefix]
            if missing:  # the lookup and this step see the same cache: nothing evicts in between
                raise RuntimeError(
                    f"weft-hisparse: prefix blocks {missing} of request {request.request_id!r} left the "
                    f"host prefix cache between its lookup and its step"
                )
            rows = self.planner.take_prefix([hashes[index] for index in blocks])
            gpu_blocks = request.block_ids[self.group][first * self._pages_per_block :]
            pages = [row for block_rows in rows for row in block_rows]
            loads.extend(PageLoad(gpu_block, host_row) for gpu_block, host_row in zip(gpu_blocks, pages, strict=False))
        self._filling.clear()  # admitted, then preempted before any step: its blocks are gone
        return tuple(loads)

    def kv_cache_shares(self) -> tuple[float, ...]:
        """The group's pages are mostly on the host: it gets ``gpu_share`` of what its requests would hold,
        the other groups what theirs hold (the engine's split by need, weighed)."""
        return tuple(self.options.gpu_share if index == self.group else 1.0 for index in range(len(self.groups)))

    def lent_blocks(self) -> tuple[LentBlock, ...]:
        lent, self._lend = self._lend, ()
        return lent

    def update_connector_output(self, output: ConnectorOutput) -> None:
        if self.planner is None:
            return
        for rank, names in output.acknowledged.items():
            copies = tuple(self._planned[name] for name in names if name in self._planned)
            self.planner.acknowledge(rank, copies)
        for name, copy in list(self._planned.items()):
            pages = self.planner.pages.get(copy.request_id)
            if (
                pages is None
                or copy.page >= len(pages)
                or pages[copy.page].host_row != copy.host_row
                or not pages[copy.page].pending
            ):
                del self._planned[name]  # acknowledged by every rank, or its request is gone

    def request_finished(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Its pages leave the planner; the host rows of its contiguous durable prefix stay in the host prefix cache,
        by the engine's chained hash of each prompt block (bookkeeping only: see :mod:`weft_hisparse.pages`)."""
        if self.planner is not None:
            self.planner.release(request.request_id, request.block_hashes, self._pages_per_block)
        self._prefilling.pop(request.request_id, None)
        self._decoding.discard(request.request_id)
        self._ends.pop(request.request_id, None)
        return False, None

    # Worker role.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        group = self.groups[self.group]
        pin = torch.cuda.is_available()
        for layer_name in group.layer_names:
            cache = kv_caches[layer_name]
            block_axis(group, layer_name, cache)  # block first, or a ValueError naming the layout expected
            self.layers[layer_name] = cache
            self.host[layer_name] = torch.zeros(
                (self.options.host_pages, *cache.shape[1:]),
                dtype=cache.dtype,
                pin_memory=pin,
            )

    def bind_connector_metadata(self, metadata: HiSparseStep | None) -> None:
        self._step = metadata
        if metadata is None:
            return
        for request_id in metadata.dropped:
            self._forget(request_id)
        for page in metadata.host_pages:
            self._host_pages.setdefault(page.request_id, {})[page.page] = page.host_row

    def start_load_kv(self) -> None:
        """Copy this step's host prefix hits into their GPU blocks, before the forward reads them (synchronous:
        the step's ``has_sync_kv_loads``)."""
        if self._step is None or not self._step.loads:
            return
        rows = torch.tensor([load.host_row for load in self._step.loads])
        for layer_name, cache in self.layers.items():
            blocks = torch.tensor([load.gpu_block for load in self._step.loads], device=cache.device)
            cache[blocks] = self.host[layer_name][rows].to(cache.device)  # one gather, one copy, one scatter
        self._observe("host_prefix_pages_loaded_total", len(self._step.loads))

    def wait_for_save(self) -> None:
        """The forward wrote this step's entries: copy the planned pages to the host."""
        if self._step is None or not self._step.copies:
            return
        host_rows = [copy.host_row for copy in self._step.copies]
        rows = torch.tensor(host_rows)
        for layer_name, cache in self.layers.items():
            blocks = torch.tensor([copy.gpu_block for copy in self._step.copies], device=cache.device)
            self.host[layer_name][rows] = cache[blocks].to("cpu")  # one gather, one copy, one scatter; synchronous
        if self._graph is not None:
            self._graph.invalidate(host_rows)  # the rows' copies in the graphs' hot buffer are stale now
        self._acknowledged.extend(copy_name(copy) for copy in self._step.copies)
        self._observe("pages_copied_total", len(self._step.copies))

    def get_finished(self, finished_request_ids: set[str]) -> ConnectorOutput:
        for request_id in finished_request_ids:
            self._forget(request_id)
        if self._graph is not None:
            hits, misses = self._graph.reads()
            for name, count in (("hot_entries_read_total", hits), ("host_entries_read_total", misses)):
                if count:
                    self._observe(name, count)
        acknowledged = {self.rank: tuple(self._acknowledged)} if self._acknowledged else {}
        observations, self._observations = self._observations, {}
        self._acknowledged = []
        return ConnectorOutput(acknowledged=acknowledged, observations=observations)

    def clear_connector_metadata(self) -> None:
        self._step = None

    def sparse_entry_reader(self) -> SparseEntryReader:
        return self

    def read(
        self, layer_name: str, request_ids: Sequence[str], selected: torch.Tensor, entries: torch.Tensor
    ) -> torch.Tensor:
        """Replace the selected entries of host pages with their hot-buffer rows, copying in from the host only
        the ones missing (LRU per request). The resolver's bookkeeping is host-side; the bytes move in one
        gather from the host pool, one copy to the device and one scatter per layer and step."""
        if layer_name not in self.layers or not any(request_id in self._host_pages for request_id in request_ids):
            return entries
        per_page = self.layers[layer_name].shape[1]
        selected_rows = selected.tolist()
        copy_from, copy_to, read_row, read_column, read_from = [], [], [], [], []
        hot_hits = 0
        for row, request_id in enumerate(request_ids):
            host_pages = self._host_pages.get(request_id)
            if not host_pages:
                continue
            columns = [
                column
                for column, entry in enumerate(selected_rows[row])
                if entry >= 0 and entry // per_page in host_pages
            ]
            if not columns:
                continue
            buffer, base = self._hot_buffer(request_id, layer_name, per_page)
            wanted = [selected_rows[row][column] for column in columns]
            if len(wanted) > buffer.rows:  # one step's entries must not evict each other
                raise ValueError(
                    f"plugins.hisparse.hot_buffer_blocks = {self.options.hot_buffer_blocks} holds {buffer.rows} "
                    f"entries per request and layer, but {layer_name} selected {len(wanted)} of host pages in one "
                    f"step; raise it to at least {-(-selected.shape[-1] // per_page)} (the model's top-k in blocks of "
                    f"{per_page} entries)"
                )
            # The resolver at entry granularity: each selected entry is a "page" of one host row.
            located = {
                entry: Page(gpu_block=None, host_row=host_pages[entry // per_page] * per_page + entry % per_page)
                for entry in wanted
            }
            for column, location in zip(columns, buffer.resolve(located, wanted), strict=False):
                hot_row = base + (location.hot_row if location.kind == "host" else location.index)
                if location.kind == "host":
                    copy_from.append(location.index)
                    copy_to.append(hot_row)
                else:
                    hot_hits += 1
                read_row.append(row)
                read_column.append(column)
                read_from.append(hot_row)
        hot = self._hot_pool(layer_name, entries)
        if copy_from:
            host = self.host[layer_name].view(-1, entries.shape[-1])
            hot[torch.tensor(copy_to, device=hot.device)] = host[torch.tensor(copy_from)].to(
                hot.device, non_blocking=True
            )
            self._observe("host_entries_read_total", len(copy_from))
        if hot_hits:
            self._observe("hot_entries_read_total", hot_hits)
        if read_row:
            index = torch.tensor([read_row, read_column], device=entries.device)
            entries[index[0], index[1]] = hot[torch.tensor(read_from, device=hot.device)]
        return entries

    # Decode graphs (the core contract's CapturedSparseEntryReader; :mod:`weft_hisparse.graph_reader`).

    def capture_rows(self, rows: int, max_model_len: int) -> None:
        """The static page table of up to ``rows`` rows of ``max_model_len`` tokens and the hot buffer: a slice of
        ``hot_buffer_blocks`` blocks of entries per layer for each of ``graph_hot_requests`` requests (at most
        ``rows``), every page on the GPU and every hot entry empty until :meth:`prepare_rows`; its kernel compiled."""
        pages = self.groups[self.group].spec.blocks_for_tokens(max_model_len)
        per_page = next(iter(self.layers.values())).shape[1]
        slices = min(self.options.graph_hot_requests, rows)
        self._graph = GraphReader(
            self.layers, self.host, self.options.hot_buffer_blocks * per_page, rows, pages, slices
        )
        logger.info(
            "decode graphs' hot buffer (%d requests x %d entries x %d layers) and page table "
            "(%d rows): %.1f MiB on the device, outside the KV-cache budget; final select in %s",
            slices,
            self.options.hot_buffer_blocks * per_page,
            len(self.layers),
            rows,
            self._graph.device_bytes / (1 << 20),
            "Triton" if self._graph.kernel is not None else "torch ops",
        )
        self._observe("graph_buffer_bytes_total", self._graph.device_bytes)

    def prepare_rows(self, request_ids: Sequence[str], rows: int) -> None:
        """Refill the page table for this replay: row ``i`` gets ``request_ids[i]``'s host pages and its slice of the
        hot buffer, every other entry (the rest of its row, the padding rows, what the last step left) -1."""
        assert self._graph is not None, "capture_rows first"
        self._graph.prepare(request_ids, self._host_pages, rows)

    def read_rows(self, layer_name: str, selected: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """The selected entries of host pages, from the row's hot buffer or the host pool where the page table says,
        misses kept in the hot buffer (device operations only: in a graph, each replay reads the table
        :meth:`prepare_rows` filled)."""
        if layer_name not in self.layers:
            return entries
        assert self._graph is not None, "capture_rows first"
        return self._graph.read(layer_name, selected, entries)

    def _hot_buffer(self, request_id: str, layer_name: str, per_page: int) -> tuple[HotBuffer, int]:
        """The request's resolver for the layer and the first row of its slice of the layer's hot pool."""
        key = (request_id, layer_name)
        if key not in self._hot:
            rows = self.options.hot_buffer_blocks * per_page
            slots = self._slots.setdefault(layer_name, [])
            slot = slots.index(None) if None in slots else len(slots)
            if slot == len(slots):
                slots.append(None)
            slots[slot] = request_id
            self._hot[key] = (HotBuffer(rows), slot * rows)
        return self._hot[key]

    def _hot_pool(self, layer_name: str, like: torch.Tensor) -> torch.Tensor:
        """The layer's GPU hot buffers, one slice of ``hot_buffer_blocks`` blocks of entries per request, grown on
        demand."""
        rows = self.options.hot_buffer_blocks * self.layers[layer_name].shape[1]
        needed = len(self._slots.get(layer_name, ())) * rows
        pool = self._hot_pools.get(layer_name)
        if pool is None or pool.shape[0] < needed:
            grown = like.new_zeros((max(needed, 2 * (pool.shape[0] if pool is not None else 0)), like.shape[-1]))
            if pool is not None:
                grown[: pool.shape[0]] = pool
            self._hot_pools[layer_name] = pool = grown
        return pool

    def _forget(self, request_id: str) -> None:
        self._host_pages.pop(request_id, None)
        if self._graph is not None:
            self._graph.forget(request_id)
        for key in [key for key in self._hot if key[0] == request_id]:
            del self._hot[key]
            slots = self._slots[key[1]]
            slots[slots.index(request_id)] = None

    def _observe(self, name: str, value: float) -> None:
        self._observations.setdefault(name, []).append(value)
