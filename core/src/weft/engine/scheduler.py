"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Every step the scheduler gives each running request the tokens it still needs
(one for a decode, the rest of a prompt for a prefill, cut to the remaining
budget when chunked prefill is on), then admits waiting requests in arrival
order while budget and sequence slots remain. A request that can't get KV
blocks takes them from the most recently admitted running request, which is
preempted: its blocks are freed and it goes back to the head of the queue, to
be recomputed (prompt and outputs so far) when blocks free up.

With a KV connector (:mod:`weft.engine.kv_connector`), an admitted request also
takes the tokens after its local prefix-cache hit that the connector can load;
a request the connector cannot answer for yet is passed over for this step.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import msgspec

from weft.engine.kv_cache_manager import KVCacheManager
from weft.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from weft.engine.kv_connector import KVConnectorRuntime


class ScheduledRequest(msgspec.Struct):
    request: Request
    num_new_tokens: int
    """Tokens to compute this step, starting at ``request.num_computed_tokens``."""

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's known tokens, so it samples the next."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


class SchedulerOutput(msgspec.Struct):
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    passed_over: int = 0
    """Waiting requests the KV connector could not answer for yet (asked again next step)."""

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        connector: KVConnectorRuntime | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.connector = connector
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            needed = request.num_tokens - request.num_computed_tokens
            count = min(needed, budget) if self.enable_chunked_prefill else needed
            if count > budget:
                index += 1
                continue
            while not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + count):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, count))
                budget -= count
                index += 1

        passed_over: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            tokens = request.all_token_ids
            prefix = self.kv_cache.find_computed_prefix(tokens)
            external = self.connector.lookup(request, prefix.num_tokens) if self.connector is not None else 0
            if external is None:
                passed_over.append(self.waiting.popleft())
                continue
            needed = len(tokens) - prefix.num_tokens - external
            count = min(needed, budget) if self.enable_chunked_prefill else needed
            if count > budget:
                break
            first_time = request.num_preemptions == 0
            if not self.kv_cache.allocate_slots(
                request.request_id, prefix.num_tokens + external + count, prefix,
                prompt_length=len(tokens) if first_time else 0,
            ):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = prefix.num_tokens + external
            if first_time:
                request.num_cached_tokens = prefix.num_tokens + external
            if self.connector is not None:
                self.connector.allocated(request, external)
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, count))
            budget -= count
        self.waiting.extendleft(reversed(passed_over))
        return SchedulerOutput(scheduled=scheduled, preempted=preempted, passed_over=len(passed_over))

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        if self.connector is not None:
            self.connector.preempted(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark ``request`` finished (or aborted) and free its blocks; safe in any state."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.connector is None or not self.connector.request_finished(request):
            self.kv_cache.free(request.request_id)
