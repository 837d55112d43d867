"""A KV connector under test, watched by the conformance kit, and made to fail its loads, without its cooperation.

:func:`probed` subclasses the connector. Its scheduler role records what the
engine's steps carry (the load ranges, the preemptions) and the asynchronous loads
it admits (a lookup that answered ``load_async``), and hands the workers the
connector's own metadata together with those load ranges. With ``fail_loads``, its
worker role poisons (NaN) every block the connector has just loaded and reports
the request in ``ConnectorOutput.failed_loads``, as a store that returned bad bytes
would: the engine must recompute those tokens, or its output changes. A
synchronous load fails in its step, and the connector sees no save calls in that
step, as the contract asks of it (KV computed on a failed load must not be saved);
an asynchronous one fails when the connector reports it in ``finished_receiving``.

:class:`ProbeRegistry` hands the engine the subclass under the connector's own
name, so a test builds its engine through the public API:
``LLM(config=load_config(None, overrides, registry=registry), registry=registry)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from weft.contracts.kv_connector import ConnectorOutput, ConnectorStep, KVConnector, block_axis
from weft.plugins import PluginRegistry

if TYPE_CHECKING:
    import torch


class LoadRange(msgspec.Struct, frozen=True, array_like=True):
    """Tokens ``[first, end)`` of a request that the connector loads in this step, and the request's blocks."""

    request_id: str
    first: int
    end: int
    block_ids: tuple[tuple[int, ...], ...]


class Probe:
    """What the probed connector's roles saw, for the test to assert on."""

    def __init__(self) -> None:
        self.loads: list[LoadRange] = []
        self.preempted: set[str] = set()
        self.failed: list[str] = []
        """Requests whose loads the probe poisoned and reported failed."""
        self.asynchronous: set[str] = set()
        """Requests among ``loads`` whose load was asynchronous."""


class _Probed(KVConnector):
    """The probe's overrides, mixed in before the connector's class by :func:`probed` (``super()`` is the
    connector); the class attributes are set per probed class."""

    kit_probe: Probe
    metadata_type: type[msgspec.Struct]
    fail_loads: bool = False
    _probe_loads: tuple[LoadRange, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._probe_offers: dict[str, int] = {}
        """Scheduler role: the local hit of each request offered an asynchronous load (its latest lookup)."""
        self._probe_receives: list[LoadRange] = []
        self._probe_receiving: dict[str, LoadRange] = {}
        """Worker role: asynchronous loads not reported yet."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if count and load_async:
            self._probe_offers[request.request_id] = num_computed_tokens
        return count, load_async

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        local = self._probe_offers.pop(request.request_id, None)
        if num_external_tokens and local is not None:
            self._probe_receives.append(LoadRange(request.request_id, local, local + num_external_tokens, block_ids))

    def build_connector_meta(self, step: ConnectorStep) -> Any:
        loads = tuple(
            LoadRange(
                item.request_id,
                item.num_computed_tokens - item.num_external_tokens,
                item.num_computed_tokens,
                item.block_ids,
            )
            for item in step.requests
            if item.num_external_tokens
        )
        receives, self._probe_receives = tuple(self._probe_receives), []
        self.kit_probe.loads += loads + receives
        self.kit_probe.asynchronous |= {load.request_id for load in receives}
        self.kit_probe.preempted |= step.preempted
        return self.metadata_type(super().build_connector_meta(step), loads, receives)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._probe_caches = kv_caches

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._probe_loads = metadata.loads
        self._probe_receiving.update((load.request_id, load) for load in metadata.receives)
        super().bind_connector_metadata(metadata.connector)

    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)
        if self.fail_loads:
            self._poison(layer_name, self._probe_loads)

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        if not (self.fail_loads and self._probe_loads):
            super().save_kv_layer(layer_name, kv_cache)

    def wait_for_save(self) -> None:
        if not (self.fail_loads and self._probe_loads):
            super().wait_for_save()

    def get_finished(self, finished_request_ids: set[str]) -> ConnectorOutput:
        output = super().get_finished(finished_request_ids)
        for request_id in output.failed_loads:
            self._probe_receiving.pop(request_id, None)
        arrived = [
            self._probe_receiving.pop(request_id)
            for request_id in sorted(output.finished_receiving)
            if request_id in self._probe_receiving
        ]
        if not self.fail_loads:
            return output
        for layer_name in self._probe_caches:
            self._poison(layer_name, arrived)
        failed = {load.request_id for load in (*self._probe_loads, *arrived)}
        self._probe_loads = ()
        if not failed:
            return output
        self.kit_probe.failed += sorted(failed)
        return msgspec.structs.replace(
            output, failed_loads=output.failed_loads | failed, finished_receiving=output.finished_receiving - failed
        )

    def _poison(self, layer_name: str, loads: Sequence[LoadRange]) -> None:
        import torch

        index, group = next((i, g) for i, g in enumerate(self.groups) if layer_name in g.layer_names)
        size = group.spec.block_size
        cache = self._probe_caches[layer_name]
        for load in loads:
            blocks = load.block_ids[index][load.first // size : -(-load.end // size)]
            if blocks:
                rows = torch.tensor(blocks, device=cache.device)
                cache.index_fill_(block_axis(group, layer_name, cache), rows, float("nan"))


def probed(connector_class: type[KVConnector], fail_loads: bool = False) -> type[KVConnector]:
    """A subclass of ``connector_class`` that records into its ``kit_probe`` and, with ``fail_loads``, fails every
    load."""

    from weft.runner.kv_connector import metadata_type

    # The probe's metadata carries the connector's own, typed so that it decodes as the connector's type.
    step_metadata = msgspec.defstruct(
        "ProbeMetadata",
        [
            ("connector", metadata_type(connector_class)),
            ("loads", tuple[LoadRange, ...]),
            ("receives", tuple[LoadRange, ...]),
        ],
        frozen=True,
    )
    name = f"Probed{connector_class.__name__}"
    attributes = {"kit_probe": Probe(), "metadata_type": step_metadata, "fail_loads": fail_loads, "__qualname__": name}
    return type(name, (_Probed, connector_class), attributes)


class ProbeRegistry(PluginRegistry):
    """The installed plugins, except that the KV connector ``name`` loads as ``replacement``."""

    def __init__(self, name: str, replacement: type[KVConnector]) -> None:
        super().__init__()
        self.connector_name = name
        self.replacement = replacement

    def load(self, slot: str, name: str) -> Any:
        if slot == "kv_connector" and name == self.connector_name:
            self.find(slot, name)  # the installed entry must be usable, as for any load
            return self.replacement
        return super().load(slot, name)
