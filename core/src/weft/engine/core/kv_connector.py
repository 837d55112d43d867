"""The engine core's side of the KV-connector contract (:mod:`weft.contracts.kv_connector`).

:class:`SchedulerConnector` holds the connector's scheduler role and is the
only place the scheduler talks to it: it asks for external prefix hits when it
admits a request, tells it about allocations, preemptions and finished
requests, and builds the step's connector metadata, which travels to the
workers inside the :class:`~weft.contracts.executor.SchedulerOutput`. The
worker role runs beside the model (:mod:`weft.runner.kv_connector`) and reports
back in the step's :class:`~weft.contracts.executor.ModelRunnerOutput`. This
side keeps the blocks of finished requests whose saves are still in flight,
and hands them back to the scheduler once the workers report the saves done.

External hits are used only when every KV-cache group is prefix-cacheable or
checkpointed: the state of a ring or recurrent group after a prefix cannot be
loaded, so a hybrid model with such a group computes its prompts in full (its
storable groups are still saved for others) unless its model restores the group
from snapshot groups loaded with the rest. The same rule governs the local prefix
cache. The one exception is a request that carries connector ``params`` and is
offered an asynchronous load: its whole state (every group, each transferable, but
the snapshots) arrives from an instance that computed the same request.

A connector that fills only some groups (``KVConnector.fills_groups``) loads those groups'
blocks of tokens the engine's prefix cache holds in every other group: its offer is capped
at the tokens the other groups hold after the local hit (``ComputedPrefix.fillable_tokens``,
whole blocks of every group), and the engine shares their cached blocks for them.

A step in which a request loads external tokens synchronously says so to the workers
(``SchedulerOutput.has_sync_kv_loads``): only then do they wait for the layers' loads.

The workers' metric observations (``ConnectorOutput.observations``) are summed
here into :class:`ConnectorMetricTotal` s, which the core sends with its gauges.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from weft.config.schema import EngineConfig
from weft.contracts.kv_cache import CheckpointSpec, KVCacheGroupSpec
from weft.contracts.kv_connector import (
    ConnectorContext,
    ConnectorOutput,
    ConnectorRequest,
    ConnectorStep,
    ConnectorStepRequest,
    KVConnector,
    connector_block_size,
)
from weft.engine.core.kv_cache_manager import KVCacheManager, block_hashes
from weft.engine.messages import ConnectorMetricTotal

if TYPE_CHECKING:
    from weft.engine.core.request import Request

logger = logging.getLogger("weft.engine")


class ConnectorStats(msgspec.Struct):
    """Counters of the connector's external prefix hits, in requests and prompt tokens."""

    lookups: int = 0
    """Requests admitted while loads were possible."""
    query_tokens: int = 0
    """Prompt tokens of those requests."""
    hits: int = 0
    """Requests admitted with tokens to load from outside."""
    hit_tokens: int = 0
    """Tokens admitted requests were to load from outside."""
    failed_load_tokens: int = 0
    """Of those, tokens whose load failed and that were recomputed."""
    delayed_frees: int = 0
    """Finished requests whose blocks waited for their saves."""
    transfers_sent: int = 0
    """Requests the workers reported in ``finished_sending``."""
    transfers_arrived: int = 0
    """Parked requests whose asynchronous load arrived."""
    transfers_failed: int = 0
    """Parked requests whose asynchronous load failed or timed out (computed instead)."""
    load_timeouts: int = 0
    """Of those, loads that outlived ``engine.kv_load_timeout``."""


class Deadlines:
    """When each of some requests stops waiting (``time.monotonic()``), all after the same ``timeout``: kept in the
    order they began, so the earliest deadline comes first."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._deadlines: dict[str, float] = {}

    def start(self, request_id: str) -> None:
        self._deadlines[request_id] = time.monotonic() + self.timeout

    def pop(self, request_id: str, default: None = None) -> float | None:
        return self._deadlines.pop(request_id, default)

    def expired(self) -> list[str]:
        """The requests past their deadline, forgotten."""
        now = time.monotonic()
        expired = []
        for request_id, deadline in self._deadlines.items():
            if deadline > now:
                break  # the rest are later
            expired.append(request_id)
        for request_id in expired:
            del self._deadlines[request_id]
        return expired


class SchedulerConnector:
    """The scheduler role of one connector, and the engine state the contract needs."""

    def __init__(
        self,
        connector_class: type[KVConnector],
        options: msgspec.Struct,
        groups: Sequence[KVCacheGroupSpec],
        context: ConnectorContext,
        load_timeout: float | None = None,
    ) -> None:
        """``load_timeout``: ``engine.kv_load_timeout`` (default: that option's default)."""
        self.name = connector_class.name
        self.load_timeout = EngineConfig().kv_load_timeout if load_timeout is None else load_timeout
        self.groups = tuple(groups)
        self.block_size = connector_block_size(self.groups)
        self.loads_possible = all(group.prefix_cacheable or group.checkpointed for group in self.groups)
        if not self.loads_possible:
            skipped = [group.name for group in self.groups if not group.prefix_cacheable]
            logger.info(
                "KV connector %r: groups %s are not prefix-cacheable, so prompts are computed in full; "
                "the other groups are still handed to the connector",
                self.name,
                skipped,
            )
        # A transfer moves the request's state itself; snapshots of its prefix stay behind (never published).
        self.all_transferable = all(
            group.transferable or isinstance(group.spec, CheckpointSpec) for group in self.groups
        )
        self.scheduler_side = connector_class(options, "scheduler", self.groups, context)
        self.filled_groups = tuple(self.scheduler_side.fills_groups())
        """The groups whose blocks of a local prefix hit the connector loads (empty: its loads fill every group)."""
        if self.filled_groups and not self.loads_possible:
            logger.info(
                "KV connector %r fills groups %s of the engine's prefix hits; the engine's prefix cache is off "
                "for this model, so there are none to fill",
                self.name,
                [self.groups[index].name for index in self.filled_groups],
            )
        self.stats = ConnectorStats()
        self.metric_specs = {metric.name: metric for metric in connector_class.metrics}
        self.metric_totals: dict[str, ConnectorMetricTotal] = {}
        self._requests: dict[str, ConnectorRequest] = {}
        self._loading: dict[str, int] = {}
        """External tokens each request admitted in a step in flight is to load."""
        self._receiving: dict[str, int] = {}
        """External tokens each request parked for an asynchronous load is to receive."""
        self._receive_deadlines = Deadlines(self.load_timeout)
        """When each parked request stops waiting for its load."""
        self._admitted: set[str] = set()
        """Requests holding blocks."""
        self._preempted: set[str] = set()
        self._delayed: set[str] = set()
        """Finished requests whose blocks wait for their saves."""
        self._closed = False

    # The scheduler's calls.

    def lookup(
        self, request: Request, num_computed_tokens: int, may_load: bool = True, fillable: tuple[int, int] = (0, 1)
    ) -> tuple[int, bool] | None:
        """``(tokens, load_async)``: the tokens after ``num_computed_tokens`` that the connector can load for
        ``request``, and whether they arrive asynchronously (None: ask again later). ``may_load`` False: the
        request computes every token (it asked for prompt logprobs), so only a connector that gates admission
        is asked, and its offer is ignored. ``fillable``: for a connector that fills groups, the tokens after
        ``num_computed_tokens`` every other group holds and the unit they come in (its offer is capped to
        whole units of them).

        Enforces the contract's rules: the last known token is always computed, and an offer moves only
        what is safe to move (see the module docstring).
        """
        connector_request = self._connector_request(request)
        loads = may_load and (self.loads_possible or bool(connector_request.params))
        if not loads and not type(self.scheduler_side).gates_admission:
            return 0, False  # nothing can be loaded: not even asked (a store's lookup costs a round trip)
        count, load_async = self.scheduler_side.get_num_new_matched_tokens(connector_request, num_computed_tokens)
        if count is None:
            return None  # asked to wait: loads not known yet, or (a lending connector) its blocks not free yet
        if not loads:
            return 0, False  # a connector that gates admission let it in: any offer is ignored
        if self.filled_groups and count:
            if load_async:
                raise RuntimeError(
                    f"KV connector {self.name!r} fills groups {list(self.filled_groups)} of prefix "
                    f"hits, but offered an asynchronous load of request {request.request_id!r}: "
                    f"a fill is synchronous"
                )
            tokens, unit = fillable
            count = min(count, tokens) // unit * unit  # only what every other group holds, in whole blocks of each
        if count and load_async and not self.all_transferable:
            refused = [group.name for group in self.groups if not group.transferable]
            raise RuntimeError(
                f"KV connector {self.name!r} offered an asynchronous load of request "
                f"{request.request_id!r}, but KV-cache groups {refused} are not transferable"
            )
        if count and not load_async and not self.loads_possible:
            refused = [group.name for group in self.groups if not group.prefix_cacheable]
            raise RuntimeError(
                f"KV connector {self.name!r} offered a synchronous load of request "
                f"{request.request_id!r}, but KV-cache groups {refused} are not prefix-cacheable"
            )
        if count < 0 or num_computed_tokens + count >= request.num_tokens:
            raise RuntimeError(
                f"KV connector {self.name!r} offered {count} tokens of request {request.request_id!r} after "
                f"{num_computed_tokens} computed ones, but the request has {request.num_tokens} and its last must be "
                "computed"
            )
        return count, load_async and count > 0

    def allocated(
        self,
        request: Request,
        num_external_tokens: int,
        block_ids: tuple[tuple[int, ...], ...],
        load_async: bool = False,
    ) -> None:
        """The scheduler admitted ``request`` with ``block_ids``, ``num_external_tokens`` of them to load
        (``load_async``: parked until they arrive)."""
        connector_request = self._connector_request(request)
        self.scheduler_side.update_state_after_alloc(connector_request, block_ids, num_external_tokens)
        self._admitted.add(request.request_id)
        if (self.loads_possible or connector_request.params) and request.num_preemptions == 0:
            self.stats.lookups += 1
            self.stats.query_tokens += request.num_prompt_tokens
        if num_external_tokens:
            (self._receiving if load_async else self._loading)[request.request_id] = num_external_tokens
            if load_async:
                self._receive_deadlines.start(request.request_id)
            self.stats.hits += 1
            self.stats.hit_tokens += num_external_tokens

    def preempted(self, request: Request) -> None:
        self._preempted.add(request.request_id)
        self._admitted.discard(request.request_id)
        self._loading.pop(request.request_id, None)

    def request_finished(self, request: Request, block_ids: tuple[tuple[int, ...], ...] | None) -> bool:
        """``request`` ended holding ``block_ids`` (None: none); True when they must stay allocated until its saves are
        done."""
        request_id = request.request_id
        connector_request = self._requests.pop(request_id, None)
        self._loading.pop(request_id, None)
        self._receiving.pop(request_id, None)
        self._receive_deadlines.pop(request_id, None)
        if connector_request is None:  # the connector never saw it
            return False
        holds_blocks = request_id in self._admitted and block_ids is not None
        self._admitted.discard(request_id)
        delay_free, _ = self.scheduler_side.request_finished(
            connector_request, block_ids if holds_blocks else tuple(() for _ in self.groups)
        )
        if delay_free and holds_blocks:
            self._delayed.add(request_id)
            self.stats.delayed_frees += 1
            return True
        return False

    def has_sync_loads(self, request_ids: Sequence[str]) -> bool:
        """Whether a request of this step (``request_ids``) loads external tokens synchronously in it."""
        return any(request_id in self._loading for request_id in request_ids)

    def build_metadata(
        self,
        scheduled: list[tuple[Request, int, int, tuple[tuple[int, ...], ...]]],
        kv_cache: KVCacheManager,
    ) -> bytes:
        """The connector's metadata for a step scheduling ``(request, tokens computed before the step, new
        tokens, block ids)``, as msgpack;
        it names the requests preempted since the previous step. Lends ``kv_cache`` the blocks the
        connector chose (the contract's "Lent blocks")."""
        step = ConnectorStep(
            free_blocks=kv_cache.num_free_blocks(),
            num_blocks=tuple(pool.num_blocks for pool in kv_cache.pools),
            reclaimed=kv_cache.reclaimed(),
            requests=tuple(
                ConnectorStepRequest(
                    request_id=request.request_id,
                    num_computed_tokens=computed,
                    num_new_tokens=count,
                    block_ids=block_ids,
                    num_external_tokens=self._loading.get(request.request_id, 0),
                )
                for request, computed, count, block_ids in scheduled
            ),
            preempted=frozenset(self._preempted),
        )
        self._preempted.clear()
        metadata = msgspec.msgpack.encode(self.scheduler_side.build_connector_meta(step))
        for lent in self.scheduler_side.lent_blocks():
            kv_cache.lend(lent)
        return metadata

    # The workers' report.

    def failed_loads(self, report: ConnectorOutput) -> dict[str, int]:
        """The requests whose synchronous load failed in the reported step, with the external tokens they were to
        load."""
        failed = {
            request_id: self._loading.get(request_id, 0)
            for request_id in report.failed_loads
            if request_id not in self._receiving
        }
        for request_id, count in failed.items():
            self.stats.failed_load_tokens += count
            logger.warning(
                "KV connector %r could not load %d tokens of request %s; recomputing them", self.name, count, request_id
            )
        self._loading.clear()
        return failed

    def received(self, report: ConnectorOutput) -> dict[str, int]:
        """The parked requests whose asynchronous load the report resolves, with the tokens that arrived
        (0 when it failed: they are computed instead)."""
        resolved: dict[str, int] = {}
        for request_id in report.finished_receiving & self._receiving.keys():
            resolved[request_id] = self._receiving.pop(request_id)
            self._receive_deadlines.pop(request_id, None)
            self.stats.transfers_arrived += 1
        for request_id in report.failed_loads & self._receiving.keys():
            count = self._receiving.pop(request_id)
            self._receive_deadlines.pop(request_id, None)
            resolved[request_id] = 0
            self.stats.failed_load_tokens += count
            self.stats.transfers_failed += 1
            logger.warning(
                "KV connector %r could not receive %d tokens of request %s; computing them",
                self.name,
                count,
                request_id,
            )
        return resolved

    def expired_receives(self) -> list[str]:
        """The parked requests whose load outlived ``load_timeout``: they compute their prompt themselves, in the
        blocks they hold (a write the connector still makes there carries the same prompt's KV; a late report of
        the load is ignored)."""
        timed_out = []
        for request_id in self._receive_deadlines.expired():
            count = self._receiving.pop(request_id, None)
            if count is None:
                continue
            timed_out.append(request_id)
            self.stats.failed_load_tokens += count
            self.stats.transfers_failed += 1
            self.stats.load_timeouts += 1
            logger.warning(
                "KV connector %r: the %d tokens of request %s did not arrive within engine.kv_load_timeout "
                "(%g s); computing them",
                self.name,
                count,
                request_id,
                self.load_timeout,
            )
        return timed_out

    def update(self, report: ConnectorOutput) -> list[str]:
        """Hand the report to the scheduler role; returns finished requests no transfer reaches any more
        (free their blocks)."""
        self.scheduler_side.update_connector_output(report)
        self._add_observations(report.observations)
        self.stats.transfers_sent += len(report.finished_sending)
        done = sorted((report.finished_sending | report.finished_receiving) & self._delayed)
        self._delayed.difference_update(done)
        return done

    def _add_observations(self, observations: dict[str, list[float]]) -> None:
        for name, values in observations.items():
            spec = self.metric_specs.get(name)
            if spec is None:
                continue  # not declared in the connector's metrics: nothing would expose it
            total = self.metric_totals.setdefault(name, ConnectorMetricTotal(buckets=[0] * len(spec.buckets)))
            total.total += sum(values)
            total.count += len(values)
            for value in values:
                for index, bound in enumerate(spec.buckets):
                    if value <= bound:
                        total.buckets[index] += 1

    @property
    def has_delayed_frees(self) -> bool:
        return bool(self._delayed)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.scheduler_side.close()

    def _connector_request(self, request: Request) -> ConnectorRequest:
        known = self._requests.get(request.request_id)
        if known is None:
            prompt = tuple(request.prompt_token_ids)
            hashes = block_hashes(prompt, self.block_size, items=request.block_items) if self.block_size else []
            known = ConnectorRequest(
                request_id=request.request_id,
                prompt_token_ids=prompt,
                block_hashes=tuple(hashes),
                params=request.kv_transfer_params or {},
            )
            self._requests[request.request_id] = known
        return known
