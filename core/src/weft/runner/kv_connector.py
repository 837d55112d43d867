"""The worker's side of the KV-connector contract (:mod:`weft.contracts.kv_connector`).

:class:`WorkerConnector` holds the connector's worker role beside the model
and brackets each forward pass: the step's metadata (built by the scheduler
role, carried in the :class:`~weft.contracts.executor.SchedulerOutput` as
msgpack bytes) is bound and loads run before the forward; saves and the
worker's report follow it. Synchronous loads are waited for, every layer, before
the forward starts; asynchronous ones complete in later steps' reports.

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
    ) -> None:
        """``gather``: every rank's report of a step (several ranks), else None."""
        self.worker_side = connector_class(options, "worker", tuple(groups), context)
        self.gather = gather
        self._reported: dict[str, Counter[str]] = {"finished_sending": Counter(), "finished_receiving": Counter()}
        self.worker_side.register_kv_caches(kv_caches)
        self.kv_caches = kv_caches
        self._decoder = msgspec.msgpack.Decoder(metadata_type(connector_class))
        self._closed = False

    def start_step(self, metadata: bytes | None) -> None:
        """Bind the step's metadata and load external KV, before the forward pass."""
        self.worker_side.bind_connector_metadata(self._decoder.decode(metadata) if metadata is not None else None)
        self.worker_side.start_load_kv()
        for layer_name in self.kv_caches:
            self.worker_side.wait_for_layer_load(layer_name)

    def finish_step(self, finished_request_ids: Sequence[str]) -> ConnectorOutput:
        """Save after the forward pass; returns the worker's report."""
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
