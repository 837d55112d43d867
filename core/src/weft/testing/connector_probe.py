"""A KV connector under test, watched by the conformance kit, and made to fail its loads, without its cooperation.

:func:`probed` subclasses the connector. Its scheduler role records what the
engine's steps carry (the load ranges, the preemptions) and hands the workers the
connector's own metadata together with the load ranges. With ``fail_loads``, its
worker role poisons (NaN) every block the connector has just loaded and reports
the request in ``ConnectorOutput.failed_loads``, as a store that returned bad bytes
would: the engine must recompute those tokens, or its output changes. The
connector sees no save calls in such a step, as the contract asks of it (KV
computed on a failed load must not be saved).

:class:`ProbeRegistry` hands the engine the subclass under the connector's own
name, so a test builds its engine through the public API:
``LLM(config=load_config(None, overrides, registry=registry), registry=registry)``.
"""

from __future__ import annotations

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


def probed(connector_class: type[KVConnector], fail_loads: bool = False) -> type[KVConnector]:
    """A subclass of ``connector_class`` that records into its ``kit_probe`` and, with ``fail_loads``, fails every load."""

    from weft.runner.kv_connector import metadata_type

    # The probe's metadata carries the connector's own, typed so that it decodes as the connector's type.
    step_metadata = msgspec.defstruct(
        "ProbeMetadata", [("connector", metadata_type(connector_class)), ("loads", tuple[LoadRange, ...])], frozen=True
    )

    class Probed(connector_class):  # type: ignore[valid-type, misc]
        kit_probe = Probe()
        metadata_type = step_metadata
        _probe_loads: tuple[LoadRange, ...] = ()

        def build_connector_meta(self, step: ConnectorStep) -> Any:
            loads = tuple(
                LoadRange(item.request_id, item.num_computed_tokens - item.num_external_tokens, item.num_computed_tokens,
                          item.block_ids)
                for item in step.requests if item.num_external_tokens
            )
            self.kit_probe.loads += loads
            self.kit_probe.preempted |= step.preempted
            return step_metadata(super().build_connector_meta(step), loads)

        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            super().register_kv_caches(kv_caches)
            self._probe_caches = kv_caches

        def bind_connector_metadata(self, metadata: Any) -> None:
            self._probe_loads = metadata.loads
            super().bind_connector_metadata(metadata.connector)

        def wait_for_layer_load(self, layer_name: str) -> None:
            super().wait_for_layer_load(layer_name)
            if fail_loads:
                self._poison(layer_name)

        def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor) -> None:
            if not (fail_loads and self._probe_loads):
                super().save_kv_layer(layer_name, kv_cache)

        def wait_for_save(self) -> None:
            if not (fail_loads and self._probe_loads):
                super().wait_for_save()

        def get_finished(self, finished_request_ids: set[str]) -> ConnectorOutput:
            output = super().get_finished(finished_request_ids)
            if not (fail_loads and self._probe_loads):
                return output
            failed = {load.request_id for load in self._probe_loads}
            self._probe_loads = ()
            self.kit_probe.failed += sorted(failed)
            return msgspec.structs.replace(output, failed_loads=output.failed_loads | failed)

        def _poison(self, layer_name: str) -> None:
            import torch

            index, group = next((i, g) for i, g in enumerate(self.groups) if layer_name in g.layer_names)
            size = group.spec.block_size
            cache = self._probe_caches[layer_name]
            for load in self._probe_loads:
                blocks = load.block_ids[index][load.first // size : -(-load.end // size)]
                if blocks:
                    rows = torch.tensor(blocks, device=cache.device)
                    cache.index_fill_(block_axis(group, layer_name, cache), rows, float("nan"))

    Probed.__name__ = Probed.__qualname__ = f"Probed{connector_class.__name__}"
    return Probed


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
