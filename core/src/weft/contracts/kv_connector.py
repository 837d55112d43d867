"""The KV-connector slot: move KV-cache blocks between this engine and elsewhere.

A connector (``use.kv_connector = "<name>"``; ``"none"`` for no connector)
is built twice, once per role, with the same validated options:

* the **scheduler** role decides which tokens of a request can be loaded from
  outside and which blocks to save, and hands per-step metadata to workers;
* the **worker** role moves the bytes, layer by layer, around the forward pass.

The class's ``name`` is its entry-point name, the one users write in
``use.kv_connector``: the engine names the connector by it in its messages and
the conformance kit (:class:`weft.testing.KVConnectorContract`) fails a
connector whose ``name`` differs from its entry point.

Hybrid models have several KV-cache groups; a connector that stores blocks
must use only the prefix-cacheable groups and one that sends blocks to a peer
only the transferable ones (:mod:`weft.contracts.kv_cache`).

Scheduler-side call order: ``get_num_new_matched_tokens`` when a request is
admitted (possibly several times, no side effects) → ``update_state_after_alloc``
once the engine allocated its blocks (again after every preemption: start the
request's tracking afresh) → ``build_connector_meta`` once per step → the workers
run → ``update_connector_output`` → ``request_finished`` when a request ends.

Worker-side call order per step (:mod:`weft.engine.core.kv_connector` drives both
roles): ``bind_connector_metadata`` → ``start_load_kv`` → the forward pass, during
which ``wait_for_layer_load`` is called once for every layer before that layer reads
its cache → ``save_kv_layer`` for every layer → ``wait_for_save`` → ``get_finished`` →
``clear_connector_metadata``. Layer by layer since core API 1.9: a layer the model runs
through core's ``Attention`` is waited for inside the forward, just before its
attention (so a connector whose layers land one after another lets the first layers
compute while later ones arrive); the others (model-managed groups), and every layer
of a step that replays a captured CUDA graph, before the forward starts. Each wait
runs on the thread that runs the forward. Since core API 1.11 the waits come only in a step
that loads KV synchronously (``SchedulerOutput.has_sync_kv_loads``: a request of the step
was offered tokens with ``load_async`` False); in any other step no layer is waited for,
since nothing its forward reads is arriving. When it returns, the layer's loaded KV must
be readable by whatever the forward launches next: in memory for a host cache; for a
device cache, copies complete or ordered before the current stream's later work. A step that
schedules no request still binds its metadata, calls ``start_load_kv`` and
``get_finished`` (no forward, no saves). A synchronous load (``load_async=False``)
of a layer is over, in that sense, when its ``wait_for_layer_load`` returns. A request whose load failed
(``ConnectorOutput.failed_loads``) keeps its blocks, its output of that step is
discarded, and the tokens that were to be loaded are recomputed; the worker must
not save that request's blocks of that step (their KV saw an incomplete context).
The engine asks for external hits when every group is prefix-cacheable or
checkpointed (the same rule as its own prefix cache: the model restores a
checkpointed group from the loaded snapshots), and for any request that carries
connector ``params`` (a transfer of that very request); it hands every request to
the connector. A transfer (an asynchronous load of a request with ``params``)
moves the request's state itself but not the snapshot (``CheckpointSpec``)
groups: the engine neither restores that request from snapshots nor publishes
its snapshot blocks (``NewRequest.state_transferred``, core API 1.6).

Asynchronous loads (core API 1.3)
    A lookup may answer ``(n, True)``: the request's KV arrives from outside while
    the engine does other work (a decode instance receiving the KV its prefill
    instance pushes, a store hit loaded in the background). The engine allocates the request's blocks for its first
    ``num_computed_tokens + n`` tokens, calls ``update_state_after_alloc`` with all of
    them, and parks the request outside the running batch (in the
    scheduler's receiving queue); the connector tells its workers what to receive
    through ``build_connector_meta`` (the request is in no step until its KV is
    there). The worker names the request in ``finished_receiving`` once every block
    landed: it is then scheduled with ``num_computed_tokens + n`` tokens computed. In
    ``failed_loads`` instead (a failed or timed-out transfer), it computes the ``n``
    tokens itself, in the same blocks: the worker must not name a request there
    while a write into its blocks may still land. An asynchronous offer moves a
    request's whole state, so every group must be transferable (the engine raises
    otherwise); a synchronous offer for a model with a group that is not
    prefix-cacheable is refused the same way. A request that ends while receiving
    goes to ``request_finished`` with its blocks; returning ``delay_free=True`` keeps
    them until the worker names it in ``finished_receiving`` or ``finished_sending``.

Metrics (core API 1.3)
    A connector declares :class:`ConnectorMetric` s in ``metrics``; its workers
    report observations in ``ConnectorOutput.observations`` (a counter's increments,
    a histogram's samples, since their previous report). ``weft serve`` exposes
    them summed over workers as ``weft_kv_connector_<name>`` on ``/metrics``.

Saves may outlive the step: ``request_finished`` returns ``delay_free=True`` and
the engine keeps the request's blocks until ``get_finished`` reports the request in
``finished_sending``. A preempted request's blocks are freed at once and may be
handed to another request in the same step, so the worker must finish the
request's pending saves (``ConnectorStep.preempted``) before it writes any block.
``close`` ends both roles, after pending saves.

Prefix blocks
    A stored prefix block covers :func:`connector_block_size` tokens (``size``).
    ``ConnectorRequest.block_hashes[i]`` is the chained hash of the prompt's
    tokens ``[0, (i + 1) * size)`` and of the hashes of the images among them
    (core API 1.15): a key made of it (with the model identity,
    ``ConnectorContext.model``, the group and the dtype) names the block's bytes
    exactly. In a group whose ``spec.block_size`` is smaller, one prefix block is
    ``size // spec.block_size`` consecutive blocks of the group.

The cache tensors (``register_kv_caches``)
    One tensor per layer name of every group (prefix-cacheable or not), keyed by
    the names in ``KVCacheGroupSpec.layer_names``, of dtype ``spec.dtype``, on the
    platform's device (host memory on the ``cpu`` platform). Their layout depends
    on who owns the group:

    * groups the attention backend owns (``spec.paged_attention``: a
      ``FullAttentionSpec``, a ``SlidingWindowSpec`` without ``ring``) have the
      backend's ``AttentionBackend.kv_cache_shape(num_blocks, spec)``. Weft's
      backends (``torch``; ``triton`` in weft-triton) use the default
      ``[2, num_blocks, block_size, num_kv_heads, head_dim]``: keys at ``[0]``,
      values at ``[1]``, block ``b`` at ``[:, b]``, and the token at position ``p``
      of a request in slot ``p % block_size`` of its block ``p // block_size``;
    * groups the model manages (a ring ``SlidingWindowSpec``, ``CompressedSpec``,
      ``RecurrentStateSpec``) have the family's
      ``ModelFamily.kv_cache_shape(spec, num_blocks)``. DeepSeek V4 (weft-dsv4)
      puts the block first: a ring ``[num_blocks, block_size, head_dim]`` (keys
      are the values), compressed entries ``[num_blocks, block_size //
      compress_ratio, entry_dim]``, a recurrent state ``[num_blocks, state_elements]``.

    A connector that relies on a layout checks it in ``register_kv_caches``
    (a block of one layer is ``spec.page_size_bytes()`` bytes in the layouts
    above, except DeepSeek V4's rings) and refuses any other with an error naming
    the layer, its shape and the layout it expected; :func:`block_axis` does that
    for the layouts above. The tensors may hold more
    blocks than the engine hands out (a scratch block that padded rows of a
    captured graph write to); only blocks named in ``block_ids`` belong to requests.

What ``block_ids`` covers
    Wherever a connector is given ``block_ids`` it is one tuple per group, for all
    groups in the model's order (index it with the group's position in
    ``groups``), holding every block the request holds at that moment, in token
    order: a group's block ``i`` holds the request's tokens ``[i * spec.block_size,
    (i + 1) * spec.block_size)`` (a ring group holds at most ``spec.ring_blocks``
    blocks, reused in turn; a recurrent group one). That is the local prefix-cache
    hit's blocks (shared with other requests: read them, never write them), the
    blocks external tokens are loaded into, and the blocks of every token
    computed so far and in this step. ``update_state_after_alloc`` sees the blocks
    of the request's first step only (with chunked prefill a prompt's later blocks
    are allocated in later steps), so a connector takes the blocks to load and save
    from each step's ``ConnectorStepRequest.block_ids``. ``request_finished`` gets
    every block the request holds at its end (prompt and generated tokens), or empty
    tuples when it holds none (it finished while waiting, or after a preemption).

The load range
    When it admits a request, the engine asks ``get_num_new_matched_tokens(request,
    num_computed_tokens)`` with ``num_computed_tokens`` the tokens its own prefix
    cache holds for the request (its local hit, a multiple of ``size``). The answer
    ``n`` counts the tokens after those that the connector can load. The admitted
    request gets ``update_state_after_alloc(request, block_ids, n)``, and in the step
    it was admitted for, ``ConnectorStepRequest.num_computed_tokens`` is the local
    hit plus ``n`` and ``ConnectorStepRequest.num_external_tokens`` is ``n``: the
    worker loads the tokens ``[num_computed_tokens - num_external_tokens,
    num_computed_tokens)`` into that step's ``block_ids``, before the forward pass
    computes the rest.

Lent blocks (core API 1.6)
    A connector that keeps a copy of some blocks elsewhere (weft-hisparse: the compressed KV of
    decoding requests, in a host pool) may let the engine hand those blocks out again while
    their request still runs. After each ``build_connector_meta`` the engine asks
    :meth:`KVConnector.lent_blocks`; it releases each named block to its pool at once (the
    pool counts it free) and the block stays in the request's ``block_ids``, readable as before
    until the pool hands it to another request. The next step's ``ConnectorStep.reclaimed``
    names every lent block handed out since: from that step on the request's tokens in it must
    be read from the connector's copy, never from the block. Lent blocks are never released
    twice; a request's blocks that are reclaimed are not its own any more when it ends. A
    connector's workers read those tokens for the model through :meth:`KVConnector.sparse_entry_reader`
    (``ForwardContext.sparse_entries``). ``ConnectorStep.free_blocks`` and ``num_blocks`` give
    each group's pool so that the connector can decide when to lend. Such a connector may hold a
    waiting request back until what it will lend covers the request's prefill:
    :meth:`KVConnector.get_num_new_matched_tokens` answering ``None`` (ask again next step) keeps the
    request waiting instead of admitting it into blocks it would then take from a running one by
    preemption. A connector that does so sets ``gates_admission = True`` (core API 1.8): the engine then
    asks it even when nothing can be loaded (a group that is not prefix-cacheable, a request asking for
    prompt logprobs, which computes every token) and ignores any offer; others are not asked then.

Filling groups of a local hit (core API 1.11)
    A connector that keeps a copy of only some groups' blocks (weft-hisparse: the compressed entries
    of its sparse group, in a host pool) names them in :meth:`KVConnector.fills_groups`. The engine's
    own prefix cache then finds the hit of every group as before (``num_computed_tokens``), and also
    the tokens after it that every other prefix-cacheable group still holds (the filled groups' blocks
    were evicted, the others' not). The connector's offer counts tokens after ``num_computed_tokens``
    as usual; the engine caps it at those tokens, in whole blocks of every group, and a fill is
    synchronous (an asynchronous offer raises). For the tokens it takes, the other groups share their
    cached blocks and the filled groups get fresh ones: the worker loads only the filled groups'
    blocks of the load range. So a fill is exact wherever the engine's own hit is: a model whose ring
    or recurrent groups are checkpointed restores them from the snapshot groups it shares.

Acknowledgements (core API 1.6)
    A worker names the scheduler's planned work it completed in ``ConnectorOutput.acknowledged``
    under its rank (``pp_rank * tp_size + tp_rank``); the engine hands the scheduler role every
    rank's list, so that it can wait for all of them.

The last token
    A connector never offers a request's last token: the engine computes it to
    sample the next one, so ``num_computed_tokens + n`` stays below the request's
    length (for a connector that stores full prompt blocks: at most
    ``(len(prompt_token_ids) - 1) // size`` blocks). The engine enforces it:
    :meth:`SchedulerConnector.lookup <weft.engine.core.kv_connector.SchedulerConnector.lookup>`
    raises RuntimeError naming the connector and the request for an offer that
    reaches the last token, or a negative one.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import lcm
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import msgspec

from weft.contracts.plugin import PluginBase

if TYPE_CHECKING:
    import torch

    from weft.contracts.kv_cache import KVCacheGroupSpec


class ConnectorRequest(msgspec.Struct, frozen=True):
    """What the scheduler tells a connector about a request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    """Chained hashes (:func:`weft.engine.core.kv_cache_manager.hash_block`) of the request's full prompt
    blocks of :func:`connector_block_size` tokens; prefix-cacheable groups share them."""
    params: dict[str, Any] = {}
    """Connector-specific fields carried on the request: the API's ``kv_transfer_params`` (filled since core API
    1.3)."""


class ConnectorContext(msgspec.Struct, frozen=True):
    """Where this engine sits: what stored KV must be keyed by so that only a compatible engine reuses it."""

    model: str
    """The model's identity: its name and a digest of its configuration."""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1


class ConnectorStepRequest(msgspec.Struct, frozen=True):
    """One request scheduled in a step."""

    request_id: str
    num_computed_tokens: int
    """Tokens in the KV cache before this step's forward, counting the ones loaded from outside in this step."""
    num_new_tokens: int
    """Tokens the forward computes for it in this step."""
    block_ids: tuple[tuple[int, ...], ...]
    """Every block the request holds, per group (all groups, in the model's order; see the module docstring)."""
    num_external_tokens: int = 0
    """The last tokens of ``num_computed_tokens`` that the worker loads from outside in this step (0: none).

    Non-zero in the step a request was admitted for when its lookup offered them. Added in
    core API 1.1: a connector that reads it declares ``weft-core>=1.1``.
    """


class LentBlock(msgspec.Struct, frozen=True, array_like=True):
    """Block ``position`` (in token order) of group ``group`` of a request (see "Lent blocks")."""

    request_id: str
    group: int
    position: int


class ConnectorStep(msgspec.Struct, frozen=True):
    """What the engine scheduled in one step, for :meth:`KVConnector.build_connector_meta`."""

    requests: tuple[ConnectorStepRequest, ...]
    preempted: frozenset[str] = frozenset()
    """Requests preempted while scheduling this step: their blocks are already free."""
    free_blocks: tuple[int, ...] = ()
    """Each group's free blocks once this step's blocks are allocated (core API 1.6)."""
    num_blocks: tuple[int, ...] = ()
    """Each group's blocks in all (core API 1.6)."""
    reclaimed: tuple[LentBlock, ...] = ()
    """Lent blocks the pools handed to other requests since the previous step (core API 1.6)."""


class ConnectorOutput(msgspec.Struct, frozen=True):
    """What the workers report after a step."""

    finished_sending: frozenset[str] = frozenset()
    finished_receiving: frozenset[str] = frozenset()
    """Requests whose asynchronous load completed (core API 1.3), or that ended while receiving
    and whose blocks no write can reach any more."""
    failed_loads: frozenset[str] = frozenset()
    """Requests whose external KV could not be loaded; the scheduler recomputes them."""
    observations: dict[str, list[float]] = {}
    """Per :class:`ConnectorMetric` name: a counter's increments or a histogram's samples since the
    previous report (core API 1.3)."""
    acknowledged: dict[int, tuple[str, ...]] = {}
    """Per rank: the connector's own names of planned work that rank completed in the step (core API 1.6)."""


class ConnectorMetric(msgspec.Struct, frozen=True):
    """A metric a connector's workers report; ``weft serve`` exposes it as ``weft_kv_connector_<name>``."""

    name: str
    """Lower case, digits and underscores; a counter's name ends in ``_total`` by Prometheus' custom."""
    help: str
    kind: Literal["counter", "histogram"] = "counter"
    buckets: tuple[float, ...] = ()
    """A histogram's upper bounds, ascending (``+Inf`` is implied)."""


class KVConnector(PluginBase):
    """Scheduler and worker sides of KV transfer. Built as ``Connector(options, role, groups, context)``."""

    name: ClassVar[str]
    metrics: ClassVar[tuple[ConnectorMetric, ...]] = ()
    """What the workers report in ``ConnectorOutput.observations`` (core API 1.3)."""
    metadata_type: ClassVar[Any] = Any
    gates_admission: ClassVar[bool] = False
    """Whether :meth:`get_num_new_matched_tokens` may hold a request back (answer None) where nothing can be
    loaded (see "Lent blocks"): the engine asks such a connector for every waiting request (core API 1.8)."""
    """The type :meth:`build_connector_meta` returns. The metadata reaches workers as msgpack
    bytes inside the step (they may live in other processes) and is decoded as this type;
    left as ``Any``, the return annotation of ``build_connector_meta`` is used when it resolves."""

    def __init__(
        self,
        options: msgspec.Struct | None,
        role: Literal["scheduler", "worker"],
        groups: Sequence[KVCacheGroupSpec],
        context: ConnectorContext,
    ) -> None:
        self.options = options if options is not None else self.Options()
        self.role = role
        self.groups = tuple(groups)
        self.context = context

    # Scheduler side.

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` (the engine's local prefix-cache hit) that can be loaded from outside.

        Returns ``(n, load_async)``; ``n is None`` means "not known yet, ask next
        step". Must have no side effects. ``load_async`` True parks the request until
        its KV arrives (see "Asynchronous loads"); it is False when ``n`` is 0.
        ``num_computed_tokens + n`` must stay below the request's length: the last
        token is always computed (the engine raises).
        """
        return 0, False

    def fills_groups(self) -> tuple[int, ...]:
        """Scheduler role: the groups (positions in ``groups``) whose blocks of the engine's local prefix hits
        this connector loads while the other groups' cached blocks are shared (see "Filling groups of a local
        hit"; core API 1.11). Empty (the default): an offer loads every group."""
        return ()

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...], num_external_tokens: int
    ) -> None:
        """The engine admitted ``request`` to load ``num_external_tokens`` tokens (the lookup's answer, or 0).

        ``block_ids`` are the blocks of its first step only; the load range and every
        later block come with the steps (:class:`ConnectorStepRequest`). Decide on
        ``num_external_tokens``, not on whether ``block_ids`` is empty. Called again
        after every preemption: start the request's tracking afresh.
        """

    def build_connector_meta(self, step: ConnectorStep) -> Any:
        """Metadata for this step's workers; resets per-step state.

        Return msgspec-encodable data: workers may live in other processes.
        """
        return None

    def update_connector_output(self, output: ConnectorOutput) -> None:
        """Workers' report after a step."""

    def kv_cache_shares(self) -> tuple[float, ...] | None:
        """Scheduler role, once at start-up: a weight per group, in the groups' order (core API 1.6; weights
        since 1.8), on the engine's split of the KV-cache bytes when it sizes the cache from memory (not under
        ``engine.num_kv_blocks``). The engine splits by need: each group in proportion to what one request
        of ``max_model_len`` holds of it. A weight of 1.0 keeps a group's need, 0.1 gives it a tenth of it:
        a connector that keeps a group's blocks elsewhere needs fewer of them. None (the default): 1.0 each."""
        return None

    def lent_blocks(self) -> tuple[LentBlock, ...]:
        """Blocks chosen by the last :meth:`build_connector_meta` that the pool may hand out again while
        their requests keep reading them (see "Lent blocks"; core API 1.6). None by default."""
        return ()

    def request_finished(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request ended. Returns ``(delay_free, params)``: delay freeing its blocks until sent.

        ``block_ids``: every block it holds now, per group (empty tuples when it holds none).
        """
        return False, None

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The worker's KV-cache tensors by layer name (every layer of every group), once at start-up.

        Check the layout you rely on here (the module docstring lists each group
        kind's) and raise ValueError naming the layer, its shape and the layout expected.
        """

    def bind_connector_metadata(self, metadata: Any) -> None:
        """Metadata from :meth:`build_connector_meta` for the step about to run."""

    def clear_connector_metadata(self) -> None:
        """The step finished."""

    def start_load_kv(self) -> None:
        """Begin loading external KV for this step before the forward pass."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV has arrived (called in the forward, just before the layer: see the
        module docstring)."""

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        """``layer_name`` finished its forward; start saving what the metadata asks."""

    def wait_for_save(self) -> None:
        """The forward and every ``save_kv_layer`` of the step are done.

        A connector that saves synchronously blocks here until the blocks may be
        reused; one that saves in the background returns and protects the blocks
        through ``request_finished``'s ``delay_free`` (see the module docstring).
        """

    def get_finished(self, finished_request_ids: set[str]) -> ConnectorOutput:
        """Requests whose asynchronous sends or receives completed."""
        return ConnectorOutput()

    def sparse_entry_reader(self) -> SparseEntryReader | None:
        """What the model reads selected entries of reclaimed blocks through (``ForwardContext.sparse_entries``;
        core API 1.6). None: the model reads its caches only."""
        return None

    # Both sides.

    def close(self) -> None:
        """The engine is shutting down: finish pending saves, release connections. Idempotent."""


class SparseEntryReader(Protocol):
    """Reads a sparse layer's selected cache entries that live outside the cache (core API 1.6).

    A model that attends only selected entries of a model-managed group (DeepSeek V4's CSA layers:
    the indexer's top-k of ``csa_kv``) gathers them from its cache and then passes them here; the
    reader overwrites the rows whose block was lent and reclaimed with their own copy.
    """

    def read(
        self, layer_name: str, request_ids: Sequence[str], selected: torch.Tensor, entries: torch.Tensor
    ) -> torch.Tensor:
        """``selected`` ``[rows, k]`` entry indices in each request's token order (``-1``: none), ``entries``
        ``[rows, k, dim]`` as gathered from the cache, one row per request of ``request_ids``. Returns
        the entries, with those of reclaimed blocks replaced."""
        ...


@runtime_checkable
class CapturedSparseEntryReader(SparseEntryReader, Protocol):
    """A reader whose reads a captured decode graph can replay (core API 1.11); the runner captures the decode
    of a model that reads sparse entries only through such a reader.

    Its per-step state lives in static buffers: refilled by :meth:`prepare_rows` on the host before every
    replay, read by :meth:`read_rows` with device operations only (no host synchronisation, no decision taken
    on the host from the step's data), so the graph's captured reads see each step's state and no other.
    """

    def capture_rows(self, rows: int, max_model_len: int) -> None:
        """Before the first capture: allocate the static buffers for up to ``rows`` rows of requests of up to
        ``max_model_len`` tokens (every row reads nothing from outside until :meth:`prepare_rows`)."""
        ...

    def prepare_rows(self, request_ids: Sequence[str], rows: int) -> None:
        """Before a replay of the graph of ``rows`` rows: row ``i`` holds ``request_ids[i]``, the rows after
        them are padding. Refill the static buffers for them; whatever a previous step left in any row is
        overwritten (the padding rows read nothing from outside)."""
        ...

    def read_rows(self, layer_name: str, selected: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """:meth:`SparseEntryReader.read` inside the graph: row ``i`` of ``selected`` and ``entries`` is row ``i``
        of the last :meth:`prepare_rows`."""
        ...


def connector_block_size(groups: Sequence[KVCacheGroupSpec]) -> int | None:
    """Tokens one stored prefix block covers: the least common multiple of the prefix-cacheable groups' block sizes.

    Groups that are not prefix-cacheable (rings, recurrent state) never take part,
    so their block sizes cannot change the layout of a prefix store. None when no
    group is prefix-cacheable.
    """
    sizes = [group.spec.block_size for group in groups if group.prefix_cacheable]
    return lcm(*sizes) if sizes else None


def block_axis(group: KVCacheGroupSpec, layer_name: str, kv_cache: torch.Tensor) -> int:
    """The axis of ``kv_cache`` (``layer_name``'s tensor, in ``group``) that indexes blocks.

    1 in the attention backends' default layout ``[2, num_blocks, block_size, ...]``,
    0 in the block-first layouts of model-managed groups (see the module docstring);
    either way one block of the layer is ``spec.page_size_bytes()`` bytes. Raises
    ValueError naming the layer, its shape and the layout expected for any other.
    Added in core API 1.1.
    """
    spec = group.spec
    page = spec.page_size_bytes()
    if spec.paged_attention:
        if kv_cache.dim() >= 3 and kv_cache.shape[0] == 2 and kv_cache.shape[2] == spec.block_size:
            if kv_cache[:, 0].numel() * kv_cache.element_size() == page:
                return 1
        expected = f"the default [2, num_blocks, {spec.block_size}, num_kv_heads, head_dim] of {page} bytes per block"
    else:
        if kv_cache.dim() >= 2 and kv_cache[0].numel() * kv_cache.element_size() == page:
            return 0
        expected = f"block first, [num_blocks, ...] of {page} bytes per block"
    raise ValueError(
        f"KV cache of {layer_name} (group {group.name!r}, {type(spec).__name__}) has shape {tuple(kv_cache.shape)} "
        f"and dtype {kv_cache.dtype}; expected {expected} (AttentionBackend.kv_cache_shape, "
        f"ModelFamily.kv_cache_shape). A connector needs its own code for another layout"
    )
