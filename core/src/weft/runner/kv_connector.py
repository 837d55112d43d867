"""The worker's side of the KV-connector contract (:mod:`weft.contracts.kv_connector`).

:class:`WorkerConnector` holds the connector's worker role beside the model
and brackets each forward pass: the step's metadata (built by the scheduler
role, carried in the :class:`~weft.contracts.executor.SchedulerOutput` as
msgpack bytes) is bound and loads run before the forward; saves and the
worker's report follow it. Synchronous loads are waited for layer by layer (core API
1.9): a layer the model runs through :class:`weft.layers.attention.Attention` is waited
for inside the forward, just before that layer's attention reads its cache (the
layer's ``ForwardContext.wait_for_layer``), so a connector that lands its layers one
after another lets the first layers compute while later ones arrive; every other
layer (a model-managed group's), and every layer of a step that replays a captured
graph, is waited for before the forward starts. Only a step whose output says it loads
KV synchronously (``SchedulerOutput.has_sync_kv_loads``, core API 1.11) waits at all: in
any other nothing the forward reads is arriving, so no layer waits. Asynchronous loads
complete in later steps' reports.

With several ranks each has its own worker role (its own slice of every block);
their reports are gathered every step and combined alike on every rank: a load
failed if it failed anywhere, a request finished sending (or receiving) once every
rank said so, the observations of all ranks together.
"""

from __future__ import annotations

import typing
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from weft.contracts.kv_connector import ConnectorContext, ConnectorOutput, KVConnector

if TYPE_CHECKING:
    import torch

    from weft.contracts.kv_cache import KVCacheGroupSpec


class WorkerConnector:
    def __init__(
        self,
        connector_class: type[KVConnector],
        options: msgspec.Struct,
        groups: Sequence[KVCacheGroupSpec],
        context: ConnectorContext,
        kv_caches: dict[str, torch.Tensor],
        gather: Callable[[ConnectorOutput], list[ConnectorOutput]] | None = None,
        attention_layers: frozenset[str] = frozenset(),
    ) -> None:
        """``gather``: every rank's report of a step (several ranks), else None. ``attention_layers``:
        the layers whose :class:`~weft.layers.attention.Attention` waits for its own load in the forward."""
        self.worker_side = connector_class(options, "worker", tuple(groups), context)
        self.gather = gather
        self._reported: dict[str, Counter[str]] = {"finished_sending": Counter(), "finished_receiving": Counter()}
        self.worker_side.register_kv_caches(kv_caches)
        self.kv_caches = kv_caches
        self._in_forward = attention_layers & set(kv_caches)
        self._waited: set[str] = set()
        """Layers whose load this step has waited for."""
        self.sync_loads = False
        """Whether the step running loads KV synchronously (its layers are waited for)."""
        self._decoder = msgspec.msgpack.Decoder(metadata_type(connector_class))
        self._closed = False

    def start_step(self, metadata: bytes | None, sync_loads: bool) -> None:
        """Bind the step's metadata and load external KV, before the forward pass. ``sync_loads``: whether the
        step loads KV synchronously (``SchedulerOutput.has_sync_kv_loads``); without, no layer is waited for."""
        self.worker_side.bind_connector_metadata(self._decoder.decode(metadata) if metadata is not None else None)
        self.worker_side.start_load_kv()
        self._waited = set()
        self.sync_loads = sync_loads
        for layer_name in self.kv_caches:
            if layer_name not in self._in_forward:
                self.wait_for_layer(layer_name)

    @property
    def layer_wait(self) -> Callable[[str], None] | None:
        """What the forward's layers call before reading their cache (``ForwardContext.wait_for_layer``): None
        in a step that loads nothing synchronously."""
        return self.wait_for_layer if self.sync_loads else None

    def wait_for_layer(self, layer_name: str) -> None:
        """``layer_name``'s load of this step is complete (once per layer and step: pipeline micro-batches
        run each layer several times); nothing to wait for in a step without synchronous loads."""
        if self.sync_loads and layer_name not in self._waited:
            self._waited.add(layer_name)
            self.worker_side.wait_for_layer_load(layer_name)

    def wait_for_all_layers(self) -> None:
        """Every layer's load of this step is complete: before a graph replay, whose layers call nothing."""
        for layer_name in self.kv_caches:
            self.wait_for_layer(layer_name)

    def finish_step(self, finished_request_ids: Sequence[str]) -> ConnectorOutput:
        """Save after the forward pass; returns the worker's report."""
        self.wait_for_all_layers()  # a layer the forward did not reach still hears its wait, before any save
        for layer_name, kv_cache in self.kv_caches.items():
            self.worker_side.save_kv_layer(layer_name, kv_cache)
        self.worker_side.wait_for_save()
        output = self.worker_side.get_finished(set(finished_request_ids))
        self.worker_side.clear_connector_metadata()
        return self._combined(output)

    def poll(self, metadata: bytes | None, finished_request_ids: Sequence[str]) -> ConnectorOutput:
        """A step that runs no forward (the engine waits for saves or asynchronous loads): its metadata
        is bound and loads may start; returns the worker's report."""
        self.worker_side.bind_connector_metadata(self._decoder.decode(metadata) if metadata is not None else None)
        self.worker_side.start_load_kv()
        output = self.worker_side.get_finished(set(finished_request_ids))
        self.worker_side.clear_connector_metadata()
        return self._combined(output)

    def _combined(self, output: ConnectorOutput) -> ConnectorOutput:
        if self.gather is None:
            return output
        reports = self.gather(output)
        finished = {}
        for field, counts in self._reported.items():
            for report in reports:
                counts.update(getattr(report, field))
            done = frozenset(request for request, count in counts.items() if count >= len(reports))
            for request in done:
                del counts[request]
            finished[field] = done
        failed = frozenset().union(*(report.failed_loads for report in reports))
        observations: dict[str, list[float]] = {}
        acknowledged: dict[int, tuple[str, ...]] = {}
        for report in reports:
            for name, values in report.observations.items():
                observations.setdefault(name, []).extend(values)
            acknowledged.update(report.acknowledged)
        return ConnectorOutput(failed_loads=failed, observations=observations, acknowledged=acknowledged, **finished)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.worker_side.close()


def metadata_type(connector_class: type[KVConnector]) -> Any:
    """The type the connector's step metadata decodes as: its ``metadata_type``, else the return
    annotation of its ``build_connector_meta``, else plain msgpack data."""
    if connector_class.metadata_type is not Any:
        return connector_class.metadata_type
    for cls in connector_class.__mro__:  # an override without an annotation keeps its base's type
        method = cls.__dict__.get("build_connector_meta")
        if method is None:
            continue
        try:
            annotated = typing.get_type_hints(method).get("return", Any)
        except Exception:  # noqa: BLE001 - an annotation only importable under TYPE_CHECKING
            continue
        if annotated is not Any:
            return annotated
    return Any
