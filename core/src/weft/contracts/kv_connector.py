"""The KV-connector slot: move KV-cache blocks between this engine and elsewhere.

A connector (``use.kv_connector = "<name>"``; ``"none"`` for no connector)
is built twice, once per role, with the same validated options:

* the **scheduler** role decides which tokens of a request can be loaded from
  outside and which blocks to save, and hands per-step metadata to workers;
* the **worker** role moves the bytes, layer by layer, around the forward pass.

Hybrid models have several KV-cache groups; a connector that stores blocks
must use only the prefix-cacheable groups and one that sends blocks to a peer
only the transferable ones (:mod:`weft.contracts.kv_cache`).

Scheduler-side call order per step: ``get_num_new_matched_tokens`` (possibly
several times, no side effects) → ``update_state_after_alloc`` once the engine
allocated blocks → ``build_connector_meta`` once per step → the workers run →
``update_connector_output`` → ``request_finished`` when a request ends.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """Chained hashes of the request's full prompt blocks (prefix-cacheable groups share them)."""
    params: dict[str, Any] = {}
    """Connector-specific fields carried on the request (``kv_transfer_params``)."""


class ConnectorOutput(msgspec.Struct, frozen=True):
    """What the workers report after a step."""

    finished_sending: frozenset[str] = frozenset()
    finished_receiving: frozenset[str] = frozenset()
    failed_loads: frozenset[str] = frozenset()
    """Requests whose external KV could not be loaded; the scheduler recomputes them."""


class KVConnector(PluginBase):
    """Scheduler and worker sides of KV transfer. Built as ``Connector(options, role, groups)``."""

    name: ClassVar[str]

    def __init__(
        self,
        options: msgspec.Struct | None,
        role: Literal["scheduler", "worker"],
        groups: Sequence[KVCacheGroupSpec],
    ) -> None:
        self.options = options if options is not None else self.Options()
        self.role = role
        self.groups = tuple(groups)

    # Scheduler side.

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that can be loaded from outside.

        Returns ``(n, load_async)``; ``n is None`` means "not known yet, ask next
        step". Must have no side effects; ``load_async`` is False when n == 0.
        """
        return 0, False

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...], num_external_tokens: int) -> None:
        """Blocks (per group) were allocated for ``request``; decide on ``num_external_tokens``."""

    def build_connector_meta(self) -> Any:
        """Metadata for this step's workers; resets per-step state."""
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
        """Block until this step's saves are durable enough to reuse the blocks."""

    def get_finished(self, finished_request_ids: set[str]) -> ConnectorOutput:
        """Requests whose asynchronous sends or receives completed."""
        return ConnectorOutput()
