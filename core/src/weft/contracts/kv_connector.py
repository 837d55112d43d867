"""The KV-connector slot: move KV-cache blocks between this engine and elsewhere.

A connector (``use.kv_connector = "<name>"``; ``"none"`` for no connector)
is built twice, once per role, with the same validated options:

* the **scheduler** role decides which tokens of a request can be loaded from
  outside and which blocks to save, and hands per-step metadata to workers;
* the **worker** role moves the bytes, layer by layer, around the forward pass.

Hybrid models have several KV-cache groups; a connector that stores blocks
must use only the prefix-cacheable groups and one that sends blocks to a peer
only the transferable ones (:mod:`weft.contracts.kv_cache`).

Scheduler-side call order: ``get_num_new_matched_tokens`` when a request is
admitted (possibly several times, no side effects) → ``update_state_after_alloc``
once the engine allocated its blocks (again after every preemption: start the
request's tracking afresh) → ``build_connector_meta`` once per step → the workers
run → ``update_connector_output`` → ``request_finished`` when a request ends.

Worker-side call order per step (:mod:`weft.engine.kv_connector` drives both
roles): ``bind_connector_metadata`` → ``start_load_kv`` → ``wait_for_layer_load``
for every layer → the forward pass → ``save_kv_layer`` for every layer →
``wait_for_save`` → ``get_finished`` → ``clear_connector_metadata``. Loads are
synchronous: a load must be complete when ``wait_for_layer_load`` returns, and the
engine refuses ``load_async=True``. A request whose load failed
(``ConnectorOutput.failed_loads``) keeps its blocks, its output of that step is
discarded, and the tokens that were to be loaded are recomputed; the worker must
not save that request's blocks of that step (their KV saw an incomplete context).
The engine asks for external hits only when every group is prefix-cacheable (the
same rule as its own prefix cache); it still hands every request to the connector.

Saves may outlive the step: ``request_finished`` returns ``delay_free=True`` and
the engine keeps the request's blocks until ``get_finished`` reports the request in
``finished_sending``. A preempted request's blocks are freed at once and may be
handed to another request in the same step, so the worker must finish the
request's pending saves (``ConnectorStep.preempted``) before it writes any block.
``close`` ends both roles, after pending saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import lcm
from typing import TYPE_CHECKING, Any, ClassVar, Literal

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
    """Chained hashes (:func:`weft.engine.kv_cache_manager.hash_block`) of the request's full prompt
    blocks of :func:`connector_block_size` tokens; prefix-cacheable groups share them."""
    params: dict[str, Any] = {}
    """Connector-specific fields carried on the request (``kv_transfer_params``)."""


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
    """The request's blocks in every group (all groups, in the model's order)."""


class ConnectorStep(msgspec.Struct, frozen=True):
    """What the engine scheduled in one step, for :meth:`KVConnector.build_connector_meta`."""

    requests: tuple[ConnectorStepRequest, ...]
    preempted: frozenset[str] = frozenset()
    """Requests preempted while scheduling this step: their blocks are already free."""


class ConnectorOutput(msgspec.Struct, frozen=True):
    """What the workers report after a step."""

    finished_sending: frozenset[str] = frozenset()
    finished_receiving: frozenset[str] = frozenset()
    failed_loads: frozenset[str] = frozenset()
    """Requests whose external KV could not be loaded; the scheduler recomputes them."""


class KVConnector(PluginBase):
    """Scheduler and worker sides of KV transfer. Built as ``Connector(options, role, groups, context)``."""

    name: ClassVar[str]
    metadata_type: ClassVar[Any] = Any
    """The type :meth:`build_connector_meta` returns. The metadata reaches workers as msgpack
    bytes (they may live in other processes) and is decoded as this type."""

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

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that can be loaded from outside.

        Returns ``(n, load_async)``; ``n is None`` means "not known yet, ask next
        step". Must have no side effects; ``load_async`` is False when n == 0.
        """
        return 0, False

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...], num_external_tokens: int) -> None:
        """Blocks (per group) were allocated for ``request``; decide on ``num_external_tokens``."""

    def build_connector_meta(self, step: ConnectorStep) -> Any:
        """Metadata for this step's workers; resets per-step state.

        Return msgspec-encodable data: workers may live in other processes.
        """
        return None

    def update_connector_output(self, output: ConnectorOutput) -> None:
        """Workers' report after a step."""

    def request_finished(self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...]) -> tuple[bool, dict[str, Any] | None]:
        """The request ended. Returns ``(delay_free, params)``: delay freeing its blocks until sent."""
        return False, None

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The worker's KV-cache tensors by layer name, once at start-up."""

    def bind_connector_metadata(self, metadata: Any) -> None:
        """Metadata from :meth:`build_connector_meta` for the step about to run."""

    def clear_connector_metadata(self) -> None:
        """The step finished."""

    def start_load_kv(self) -> None:
        """Begin loading external KV for this step before the forward pass."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV has arrived."""

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

    # Both sides.

    def close(self) -> None:
        """The engine is shutting down: finish pending saves, release connections. Idempotent."""


def connector_block_size(groups: Sequence[KVCacheGroupSpec]) -> int | None:
    """Tokens one stored prefix block covers: the least common multiple of the prefix-cacheable groups' block sizes.

    Groups that are not prefix-cacheable (rings, recurrent state) never take part,
    so their block sizes cannot change the layout of a prefix store. None when no
    group is prefix-cacheable.
    """
    sizes = [group.spec.block_size for group in groups if group.prefix_cacheable]
    return lcm(*sizes) if sizes else None
