"""The engine's side of the KV-connector contract (:mod:`weft.contracts.kv_connector`).

:class:`KVConnectorRuntime` builds the selected connector in both roles and is
the only place the engine talks to it: the scheduler asks it for external prefix
hits when it admits a request and tells it about allocations, preemptions and
finished requests; :meth:`LLMEngine.step <weft.engine.llm_engine.LLMEngine.step>`
brackets the model runner with :meth:`KVConnectorRuntime.start_step` (metadata to
the worker, loads) and :meth:`KVConnectorRuntime.finish_step` (saves, the
workers' report). It also keeps the blocks of finished requests whose saves are
still in flight, and frees them when the worker reports the saves done.

External hits are used only when every KV-cache group is prefix-cacheable: the
state of a ring or recurrent group after a prefix cannot be loaded, so a hybrid
model with such a group computes its prompts in full (its storable groups are
still saved for others). The same rule governs the local prefix cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from weft.config import WeftConfig, plugin_options
from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.contracts.kv_connector import (
    ConnectorContext,
    ConnectorOutput,
    ConnectorRequest,
    ConnectorStep,
    ConnectorStepRequest,
    KVConnector,
    connector_block_size,
)
from weft.engine.kv_cache_manager import KVCacheManager, block_hashes

if TYPE_CHECKING:
    import torch

    from weft.contracts.loader import ModelSource
    from weft.engine.request import Request
    from weft.engine.scheduler import SchedulerOutput
    from weft.plugins import PluginRegistry

logger = logging.getLogger("weft.engine")


class ConnectorStats(msgspec.Struct):
    """Counters of the connector's external prefix hits, in requests and prompt tokens."""

    lookups: int = 0
    """Requests admitted while loads were possible."""
    hits: int = 0
    """Requests admitted with tokens to load from outside."""
    hit_tokens: int = 0
    """Tokens admitted requests were to load from outside."""
    failed_load_tokens: int = 0
    """Of those, tokens whose load failed and that were recomputed."""
    delayed_frees: int = 0
    """Finished requests whose blocks waited for their saves."""


class KVConnectorRuntime:
    """Both roles of one connector, and the engine state the contract needs."""

    def __init__(
        self,
        connector_class: type[KVConnector],
        options: msgspec.Struct,
        groups: Sequence[KVCacheGroupSpec],
        context: ConnectorContext,
        kv_caches: dict[str, torch.Tensor],
        kv_cache_manager: KVCacheManager,
    ) -> None:
        self.name = connector_class.name
        self.groups = tuple(groups)
        self.kv_caches = kv_caches
        self.kv_cache_manager = kv_cache_manager
        self.block_size = connector_block_size(self.groups)
        self.loads_possible = all(group.prefix_cacheable for group in self.groups)
        if not self.loads_possible:
            skipped = [group.name for group in self.groups if not group.prefix_cacheable]
            logger.info(
                "KV connector %r: groups %s are not prefix-cacheable, so prompts are computed in full; "
                "the other groups are still handed to the connector", self.name, skipped,
            )
        self.scheduler_side = connector_class(options, "scheduler", self.groups, context)
        self.worker_side = connector_class(options, "worker", self.groups, context)
        self.worker_side.register_kv_caches(kv_caches)
        self.stats = ConnectorStats()
        self._requests: dict[str, ConnectorRequest] = {}
        self._loading: dict[str, int] = {}
        """External tokens each request admitted since the last step is to load."""
        self._admitted: set[str] = set()
        """Requests holding blocks."""
        self._preempted: set[str] = set()
        self._finished: set[str] = set()
        """Requests finished since the worker was last asked for its report."""
        self._delayed: set[str] = set()
        """Finished requests whose blocks wait for their saves."""
        self._closed = False

    # The scheduler's calls.

    def lookup(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens after ``num_computed_tokens`` that the connector can load for ``request`` (None: ask again later)."""
        connector_request = self._connector_request(request)
        if not self.loads_possible:
            return 0
        count, load_async = self.scheduler_side.get_num_new_matched_tokens(connector_request, num_computed_tokens)
        if count is None:
            return None
        if load_async:
            raise RuntimeError(
                f"KV connector {self.name!r} asked to load request {request.request_id!r} asynchronously; "
                f"Weft's engine loads synchronously before the forward pass, so a connector must return load_async=False"
            )
        if count < 0 or num_computed_tokens + count >= request.num_tokens:
            raise RuntimeError(
                f"KV connector {self.name!r} offered {count} tokens of request {request.request_id!r} after "
                f"{num_computed_tokens} computed ones, but the request has {request.num_tokens} and its last must be computed"
            )
        return count

    def allocated(self, request: Request, num_external_tokens: int) -> None:
        """The scheduler admitted ``request`` with blocks for ``num_external_tokens`` tokens to load."""
        connector_request = self._connector_request(request)
        block_ids = self.kv_cache_manager.block_ids(request.request_id)
        self.scheduler_side.update_state_after_alloc(connector_request, block_ids, num_external_tokens)
        self._admitted.add(request.request_id)
        if self.loads_possible and request.num_preemptions == 0:
            self.stats.lookups += 1
        if num_external_tokens:
            self._loading[request.request_id] = num_external_tokens
            self.stats.hits += 1
            self.stats.hit_tokens += num_external_tokens

    def preempted(self, request: Request) -> None:
        self._preempted.add(request.request_id)
        self._admitted.discard(request.request_id)
        self._loading.pop(request.request_id, None)

    def request_finished(self, request: Request) -> bool:
        """``request`` ended; True when its blocks must stay allocated until its saves are done."""
        request_id = request.request_id
        connector_request = self._requests.pop(request_id, None)
        self._loading.pop(request_id, None)
        if connector_request is None:  # the connector never saw it
            return False
        holds_blocks = request_id in self._admitted
        self._admitted.discard(request_id)
        block_ids = self.kv_cache_manager.block_ids(request_id) if holds_blocks else tuple(() for _ in self.groups)
        delay_free, _ = self.scheduler_side.request_finished(connector_request, block_ids)
        self._finished.add(request_id)
        if delay_free and holds_blocks:
            self._delayed.add(request_id)
            self.stats.delayed_frees += 1
            return True
        return False

    # The engine step's calls.

    def start_step(self, plan: SchedulerOutput) -> None:
        """Hand this step's metadata to the worker and load external KV, before the forward pass."""
        step = ConnectorStep(
            requests=tuple(
                ConnectorStepRequest(
                    request_id=item.request.request_id,
                    num_computed_tokens=item.request.num_computed_tokens,
                    num_new_tokens=item.num_new_tokens,
                    block_ids=self.kv_cache_manager.block_ids(item.request.request_id),
                    num_external_tokens=self._loading.get(item.request.request_id, 0),
                )
                for item in plan.scheduled
            ),
            preempted=frozenset(self._preempted),
        )
        self._preempted.clear()
        self.worker_side.bind_connector_metadata(self.scheduler_side.build_connector_meta(step))
        self.worker_side.start_load_kv()
        for layer_name in self.kv_caches:
            self.worker_side.wait_for_layer_load(layer_name)

    def finish_step(self) -> dict[str, int]:
        """Save after the forward pass and take the worker's report.

        Returns the requests whose load failed, with the external tokens they were
        to load: the caller discards their output of this step and recomputes those tokens.
        """
        for layer_name, kv_cache in self.kv_caches.items():
            self.worker_side.save_kv_layer(layer_name, kv_cache)
        self.worker_side.wait_for_save()
        output = self._report()
        self.worker_side.clear_connector_metadata()
        failed = {request_id: self._loading.get(request_id, 0) for request_id in output.failed_loads}
        for request_id, count in failed.items():
            self.stats.failed_load_tokens += count
            logger.warning(
                "KV connector %r could not load %d tokens of request %s; recomputing them", self.name, count, request_id
            )
        self._loading.clear()
        return failed

    def reclaim(self, wait: float = 0.05) -> bool:
        """Free the blocks of finished requests whose saves completed; False when no blocks wait for saves.

        Called when a step scheduled nothing: waits up to ``wait`` seconds for one of them to be freed.
        """
        if not self._delayed:
            return False
        deadline = time.monotonic() + wait
        before = len(self._delayed)
        self._report()
        while len(self._delayed) == before and time.monotonic() < deadline:
            time.sleep(0.002)
            self._report()
        return True

    @property
    def has_delayed_frees(self) -> bool:
        return bool(self._delayed)

    def close(self, timeout: float = 60.0) -> None:
        """Wait (up to ``timeout`` seconds) for pending saves, then close both roles. Idempotent."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout
        while self._delayed and time.monotonic() < deadline:
            self.reclaim(wait=0.05)
        if self._delayed:
            logger.warning(
                "KV connector %r: %d finished requests still had saves in flight after %.0f s",
                self.name, len(self._delayed), timeout,
            )
        self._closed = True
        self.worker_side.close()
        self.scheduler_side.close()

    # Internals.

    def _report(self) -> ConnectorOutput:
        output = self.worker_side.get_finished(set(self._finished))
        self._finished.clear()
        self.scheduler_side.update_connector_output(output)
        for request_id in output.finished_sending & self._delayed:
            self._delayed.discard(request_id)
            self.kv_cache_manager.free(request_id)
        return output

    def _connector_request(self, request: Request) -> ConnectorRequest:
        known = self._requests.get(request.request_id)
        if known is None:
            prompt = tuple(request.prompt_token_ids)
            hashes = block_hashes(prompt, self.block_size) if self.block_size else []
            known = ConnectorRequest(request_id=request.request_id, prompt_token_ids=prompt, block_hashes=tuple(hashes))
            self._requests[request.request_id] = known
        return known


def build_kv_connector(
    registry: PluginRegistry,
    config: WeftConfig,
    source: ModelSource,
    groups: Sequence[KVCacheGroupSpec],
    kv_caches: dict[str, torch.Tensor],
    kv_cache_manager: KVCacheManager,
) -> KVConnectorRuntime | None:
    """The connector ``use.kv_connector`` names, built in both roles; None for ``"none"``."""
    name = config.use.kv_connector
    if name == "none":
        return None
    connector_class = registry.load("kv_connector", name)
    options = plugin_options(config, connector_class.Options, "kv_connector", name)
    context = ConnectorContext(model=model_identity(source), tp_size=config.engine.tensor_parallel_size)
    return KVConnectorRuntime(connector_class, options, groups, context, kv_caches, kv_cache_manager)


def model_identity(source: ModelSource) -> str:
    """The model's name and a digest of its configuration: engines agree on it only for the same model."""
    digest = hashlib.sha256(json.dumps(source.hf_config, sort_keys=True, default=str).encode()).hexdigest()
    return f"{source.name}@{digest[:12]}"

