"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Every step the scheduler gives each running request the tokens it still needs
(one for a decode, the rest of a prompt for a prefill, cut to the remaining
budget when chunked prefill is on), then admits waiting requests in arrival
order while budget and sequence slots remain. Long prefills do not starve short
requests: a prefill of more than ``long_prefill_token_threshold`` tokens gets
that many first and the budget the others leave after, and at most
``max_long_partial_prefills`` of them run at once (a long prompt beyond that
waits while shorter ones behind it are admitted). A request that can't get KV
blocks takes them from the most recently admitted running request, which is
preempted: its blocks are freed and it goes back to the head of the queue, to
be recomputed (prompt and outputs so far) when blocks free up.

:meth:`Scheduler.schedule` decides the step and returns a self-contained
:class:`~weft.contracts.executor.SchedulerOutput` (workers never read the
KV-cache manager). What it decides lives in the scheduler's own bookkeeping:
its queues (which requests wait, run or receive their KV), and per request the
tokens planned (computed, or being computed by steps in flight: where its next
step starts) and the output placeholders (tokens sampled by steps in flight).
:meth:`Scheduler.update_from_output` is the one writer of request progress
(computed tokens, output tokens, cached tokens) and of how a request ends from
what the step produced: sampled tokens, stop rules, freed blocks, the KV
connector's report. :meth:`Scheduler.finish` ends a request the API asks to end
(an abort, a stop string): the one other writer of a request's status.

With asynchronous scheduling the next step is scheduled before the previous
one's tokens are known: a request that samples in a step in flight counts one
output placeholder, is scheduled for its next decode already, and its real
token replaces the placeholder when the step's output arrives.

With a KV connector (:mod:`weft.engine.core.kv_connector`), an admitted request also
takes the tokens after its local prefix-cache hit that the connector can load;
a request the connector cannot answer for yet is passed over for this step. A
request whose KV arrives asynchronously (a decode instance receiving its prefill, a store hit loading)
gets its blocks and waits in :attr:`Scheduler.receiving`, outside the running
batch, until the connector reports the KV there (or failed: it is then computed);
it then goes back to the head of the queue, keeping its blocks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from weft.contracts.executor import (
    CachedRequest,
    GrammarOutput,
    ModelRunnerOutput,
    NewRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from weft.engine.core.kv_cache_manager import KVCacheManager
from weft.engine.core.request import Request, RequestStatus
from weft.engine.messages import CoreStats, EngineCoreOutput

if TYPE_CHECKING:
    from weft.contracts.kv_connector import ConnectorOutput
    from weft.engine.core.kv_connector import SchedulerConnector
    from weft.engine.core.structured_output import StructuredOutputManager
    from weft.engine.messages import GrammarStart

logger = logging.getLogger("weft.engine")


class ScheduledRow(NamedTuple):
    """What the scheduler planned for one request in a step in flight."""

    num_preemptions: int
    """The request's preemptions when scheduled: a step from before a preemption is stale."""
    start: int
    """Tokens computed before the step."""
    samples: bool
    """Whether the step samples the request's next token."""
    first: bool
    """Whether the step sent it to the workers as a :class:`~weft.contracts.executor.NewRequest`."""


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        connector: SchedulerConnector | None = None,
        long_prefill_token_threshold: int = 0,
        max_long_partial_prefills: int = 1,
        structured_outputs: StructuredOutputManager | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.connector = connector
        self.structured_outputs = structured_outputs
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        """A prefill needing more tokens than this is long: while others wait or run, it gets this many
        per step (then whatever budget they leave), and at most ``max_long_partial_prefills`` long
        prefills run at once. 0: no cap."""
        self.max_long_partial_prefills = max_long_partial_prefills
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.receiving: dict[str, Request] = {}
        """Requests holding blocks that a KV connector is filling asynchronously; in no step until it is done."""
        self.requests: dict[str, Request] = {}
        self._planned: dict[str, int] = {}
        """Tokens of each request holding blocks whose KV is computed or being computed by a step in
        flight: where its next step starts."""
        self._placeholders: dict[str, int] = {}
        """Tokens of each running request sampled by steps in flight, whose ids have not arrived yet."""
        self._sent_blocks: dict[str, list[int]] = {}
        """Blocks per group each request's workers already hold."""
        self._finished_ids: list[str] = []
        """Requests ended or preempted since the last step: workers drop them."""
        self._epochs: deque[dict[str, ScheduledRow]] = deque()
        """Per step in flight, what it planned for each scheduled request."""
        self._published_in_flight: list[tuple[int, list[tuple[int, int, bytes]]]] = []
        """Blocks published for preempted requests before the steps in flight that write them were applied:
        ``(steps in flight at the time, blocks)``; unpublished if one of those steps fails."""
        self.passed_over = 0
        """Waiting requests passed over in the last step: the KV connector could not answer for them
        yet, or their structured-output constraint is still compiling."""
        self._refused: dict[str, str] = {}
        """Requests ended because they cannot run (a constraint that failed to compile), with the reason,
        since :meth:`take_refused`."""
        self.num_preemptions = 0
        """Preemptions since start."""
        self._newly_finished: list[Request] = []
        """Requests that ended since :meth:`take_finished` (for the request-finished hook)."""

    def add(self, request: Request, grammar_start: GrammarStart | None = None) -> None:
        """Queue ``request``; one with a structured-output constraint starts compiling it (``grammar_start``:
        where the constraint starts when the model may reason first)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.params.structured_outputs is not None:
            assert self.structured_outputs is not None
            self.structured_outputs.add(request, grammar_start)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.receiving)

    @property
    def saves_pending(self) -> bool:
        """Whether finished requests still wait for their KV connector saves (their blocks held)."""
        return self.connector is not None and self.connector.has_delayed_frees

    @property
    def unfinished_ids(self) -> list[str]:
        return [request.request_id for request in [*self.running, *self.waiting, *self.receiving.values()]]

    def take_finished(self) -> list[Request]:
        """Requests that ended since the last call."""
        finished, self._newly_finished = self._newly_finished, []
        return finished

    def take_refused(self) -> dict[str, str]:
        """Requests ended because they cannot run (a constraint that failed to compile), with the reason, since the
        last call."""
        refused, self._refused = self._refused, {}
        return refused

    def cannot_run(self) -> str | None:
        """Why nothing can ever run, when a step scheduled nothing with no step in flight: the first waiting request
        needs more KV-cache blocks than the cache has, while nothing runs to free any. None when something may still
        change (requests passed over for a KV connector that cannot answer yet or a constraint still compiling, KV
        arriving, saves that will free blocks)."""
        if not self.waiting or self.running or self.passed_over or self.receiving or self.saves_pending:
            return None
        return f"request {self.waiting[0].request_id!r} cannot be scheduled: not enough KV-cache blocks"

    def grammar_output(self, request_ids: list[str]) -> Future[GrammarOutput]:
        """The bitmask of a step's constrained requests (``request_ids``), filled on the structured-output thread."""
        assert self.structured_outputs is not None
        return self.structured_outputs.grammar_output(request_ids, self.requests)

    def stats(self, num_steps: int) -> CoreStats:
        """The gauges of the queues, the KV cache and the KV connector (``num_steps``: the core's step count)."""
        manager, connector = self.kv_cache, self.connector
        return CoreStats(
            waiting=len(self.waiting) + len(self.receiving), running=len(self.running),
            waiting_for_remote_kv=len(self.receiving),
            kv_cache_usage=manager.usage(), prefix_cache_query_tokens=manager.stats.query_tokens,
            prefix_cache_hit_tokens=manager.stats.hit_tokens,
            connector_hit_tokens=connector.stats.hit_tokens if connector is not None else None,
            connector_failed_load_tokens=connector.stats.failed_load_tokens if connector is not None else None,
            connector_metrics=connector.metric_totals if connector is not None else {},
            num_preemptions=self.num_preemptions, num_steps=num_steps,
        )

    @property
    def queue_lengths(self) -> tuple[int, int]:
        """Running and waiting requests."""
        return len(self.running), len(self.waiting)

    # Scheduling.

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int]] = {}
        long_cap = self.long_prefill_token_threshold if self.enable_chunked_prefill else 0
        capped: list[Request] = []
        """Long prefills held to ``long_cap`` tokens until the others had their share."""

        index = 0
        preempted = False
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            planned, placeholders = self._planned[request.request_id], self._placeholders.get(request.request_id, 0)
            needed = request.num_tokens + placeholders - planned
            if len(request.output_token_ids) + placeholders >= request.max_tokens:
                needed = 0  # its last token is in flight: nothing more to compute
            count = min(needed, budget) if self.enable_chunked_prefill else needed
            if long_cap and count > long_cap:
                count = long_cap
                capped.append(request)
            if count <= 0 or count > budget:
                index += 1
                continue
            while not self.kv_cache.allocate_slots(request.request_id, planned + count):
                victim = self.running.pop()
                self._publish_in_flight(victim)
                self._preempt(victim)
                preempted = True
                if victim in capped:
                    capped.remove(victim)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = (request, count)
                budget -= count
                index += 1

        passed_over: list[Request] = []
        set_aside: list[Request] = []
        long_prefills = len(capped)
        # A step that preempted admits nothing: the blocks it freed are the running requests' next ones, and the
        # victim, first in line, would come straight back (its blocks of the step in flight not counted yet) only to
        # be preempted again, recomputing its prefill step after step.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.constraint is not None and not self._constraint_ready(request):
                if not request.finished:
                    passed_over.append(self.waiting.popleft())
                    set_aside.append(passed_over[-1])
                continue
            tokens = request.all_token_ids
            first_time = request.num_preemptions == 0
            resumed = self.kv_cache.holds(request.request_id)  # back from an asynchronous load, with its blocks
            prefix, external, load_async = None, 0, False
            local = self._planned[request.request_id] if resumed else 0
            if not resumed:
                # Prompt logprobs need every prompt token computed here: no cached or loaded prefix.
                computes_all = request.prompt_logprobs is not None and not request.prompt_logprobs_sent
                filled = self.connector.filled_groups if self.connector is not None else ()
                prefix = self.kv_cache.find_computed_prefix(tokens[:1] if computes_all else tokens, filled)
                offer = (self.connector.lookup(request, prefix.num_tokens, may_load=not computes_all,
                                               fillable=(prefix.fillable_tokens, self.kv_cache.fillable_unit))
                         if self.connector is not None else (0, False))
                if offer is None:
                    passed_over.append(self.waiting.popleft())
                    set_aside.append(passed_over[-1])
                    continue
                local, (external, load_async) = prefix.num_tokens, offer
                if filled:  # the connector loads its groups' blocks of these tokens; the others share cached ones
                    prefix = self.kv_cache.filled(prefix, external)
            computed = local + external
            needed = 0 if load_async else len(tokens) - computed
            count = min(needed, budget) if self.enable_chunked_prefill else needed
            long = bool(long_cap) and count > long_cap
            if long and long_prefills >= self.max_long_partial_prefills:
                set_aside.append(self.waiting.popleft())  # its turn comes when a long prefill ends; shorter ones go first
                continue
            if long:
                count = long_cap
            if count > budget:
                break
            # A request that samples in this step needs a slot for that token in the next: taken now where others
            # run, or it could be admitted only to preempt itself for that slot (and, with asynchronous scheduling,
            # to lose the token in flight), over and over while they hold the rest. Not with a KV connector, whose
            # saves and transfers take a request's blocks as its computed tokens' own.
            lookahead = 1 if self.connector is None and self.running and computed + count == len(tokens) else 0
            if not self.kv_cache.allocate_slots(
                request.request_id, computed + count + lookahead, prefix, prompt_length=len(tokens) if first_time else 0,
            ):
                break
            self.waiting.popleft()
            if self.connector is not None and not resumed:
                self.connector.allocated(request, external, self.kv_cache.block_ids(request.request_id), load_async)
            if load_async:
                self._planned[request.request_id] = local
                self.receiving[request.request_id] = request
                continue
            self._planned[request.request_id] = computed
            if first_time:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            scheduled[request.request_id] = (request, count)
            budget -= count
            if long:
                long_prefills += 1
                capped.append(request)
        self.waiting.extendleft(reversed(set_aside))
        self.passed_over = len(passed_over)
        # What the others left of the budget goes back to the long prefills.
        for request in capped:
            if budget <= 0:
                break
            _, count = scheduled[request.request_id]
            planned = self._planned[request.request_id]
            extra = min(request.num_tokens - planned - count, budget)
            if extra > 0 and self.kv_cache.allocate_slots(request.request_id, planned + count + extra):
                scheduled[request.request_id] = (request, count + extra)
                budget -= extra
        return self._build_output(list(scheduled.values()))

    def _constraint_ready(self, request: Request) -> bool:
        """Whether the request's constraint is compiled; one that failed to compile ends the request."""
        assert self.structured_outputs is not None
        try:
            return self.structured_outputs.ready(request)
        except ValueError as error:
            self.waiting.remove(request)
            self._refused[request.request_id] = str(error)
            self.finish(request.request_id)
            return False

    def _build_output(self, scheduled: list[tuple[Request, int]]) -> SchedulerOutput:
        new_requests: list[NewRequest] = []
        cached_requests: list[CachedRequest] = []
        counts: dict[str, int] = {}
        epochs: dict[str, ScheduledRow] = {}
        constrained: list[str] = []
        for request, _ in scheduled:
            request_id = request.request_id
            blocks = self.kv_cache.block_ids(request_id)
            sent = self._sent_blocks.get(request_id)
            start = self._planned[request_id]
            if sent is None:
                new_requests.append(NewRequest(
                    request_id, list(request.all_token_ids), request.num_prompt_tokens, request.params,
                    tuple(request.eos_token_ids), blocks, start, request.state_transferred,
                ))
            else:
                grown = any(len(group) > held for group, held in zip(blocks, sent))
                cached_requests.append(CachedRequest(
                    request_id, start, tuple(group[held:] for group, held in zip(blocks, sent)) if grown else None,
                ))
            self._sent_blocks[request_id] = [len(group) for group in blocks]
        for request, count in scheduled:
            counts[request.request_id] = count
        metadata = None
        if self.connector is not None:
            metadata = self.connector.build_metadata(
                [(request, self._planned[request.request_id], count, self.kv_cache.block_ids(request.request_id))
                 for request, count in scheduled],
                self.kv_cache,
            )
        first_ids = {new.request_id for new in new_requests}
        for request, count in scheduled:
            request_id = request.request_id
            start = self._planned[request_id]
            placeholders = self._placeholders.get(request_id, 0)
            self._planned[request_id] = start + count
            samples = start + count == request.num_tokens + placeholders
            if samples:  # this step samples the request's next token
                self._placeholders[request_id] = placeholders + 1
            epochs[request_id] = ScheduledRow(request.num_preemptions, start, samples, request_id in first_ids)
            if samples and request.constraint is not None and self.structured_outputs.constrains(request):  # type: ignore[union-attr]
                constrained.append(request.request_id)
        self._epochs.append(epochs)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            new_requests=new_requests, cached_requests=cached_requests, num_scheduled_tokens=counts,
            finished_request_ids=finished, kv_connector_metadata=metadata, structured_output_request_ids=constrained,
            has_sync_kv_loads=self.connector is not None and self.connector.has_sync_loads(list(counts)),
        )

    def _publish_in_flight(self, request: Request) -> None:
        """Before preempting a request with steps in flight: publish the blocks those steps fill (of tokens whose ids
        are known) in the prefix cache, so that it finds them when it comes back rather than computing them again;
        with asynchronous scheduling a preempted request otherwise lost its chunk in flight every time, and a
        request under KV pressure could recompute the same chunk step after step. Sound because steps run in
        order: the step in flight writes the blocks before any later step reads them (a block handed out again is
        unpublished by the pool first). Not where a KV connector loads in one of those steps (a load can fail after
        the fact); a failed step unpublishes them (:meth:`forget_steps_in_flight`)."""
        if not self._epochs:
            return
        known = min(self._planned.get(request.request_id, 0), request.num_tokens)
        if known <= request.num_computed_tokens:
            return
        if self.connector is not None and any(
                (row := epoch.get(request.request_id)) is not None and row.first for epoch in self._epochs):
            return
        published = self.kv_cache.cache_blocks(request.request_id, request.all_token_ids, known)
        if published:
            self._published_in_flight.append((len(self._epochs), published))

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        if self.connector is not None:
            self.connector.preempted(request)
        self._forget_on_workers(request.request_id)
        self._planned.pop(request.request_id)
        self._placeholders.pop(request.request_id, None)
        request.num_preemptions += 1
        request.state_transferred = False
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _forget_on_workers(self, request_id: str) -> None:
        if self._sent_blocks.pop(request_id, None) is not None:
            self._finished_ids.append(request_id)

    # Results.

    def update_from_output(
        self, output: SchedulerOutput, sampled: ModelRunnerOutput, connector_report: ConnectorOutput | None,
    ) -> list[EngineCoreOutput]:
        """Apply one step's results: ``sampled`` (the workers' tokens), stop rules and the KV connector's
        report of the step (``connector_report``: its loads, receipts and saves). Returns each request's
        progress.

        The one writer of request progress (computed, cached and output tokens) and of the ends
        outputs decide (a stop, the length, an error). Steps must be applied in the order they were
        scheduled.
        """
        epochs = self._epochs.popleft()
        self._published_in_flight = [(steps - 1, blocks) for steps, blocks in self._published_in_flight if steps > 1]
        connector, report = self.connector, connector_report
        failed = connector.failed_loads(report) if connector is not None and report is not None else {}
        if connector is not None and report is not None:
            for request_id, arrived in connector.received(report).items():
                request = self.receiving.pop(request_id)
                self._planned[request_id] += arrived
                request.num_computed_tokens = self._planned[request_id]
                if arrived and request.kv_transfer_params:
                    request.state_transferred = True  # the ring and state, not the snapshots: none to publish
                    self.kv_cache.forgo_snapshots(request_id)
                self.waiting.appendleft(request)
        outputs: list[EngineCoreOutput] = []
        for request_id, token in zip(sampled.request_ids, sampled.sampled_token_ids):
            request = self.requests.get(request_id)
            row = epochs.get(request_id)
            if request is None or request.finished or row is None or request.num_preemptions != row.num_preemptions:
                continue  # finished (a stop, an abort) or preempted while this step was in flight
            if row.samples:
                self._placeholders[request_id] -= 1
            if row.first and request.num_preemptions == 0:
                request.num_cached_tokens = row.start
            if request_id in failed:
                # Its KV is incomplete: recompute what was to be loaded and this step's tokens (workers
                # discarded what they sampled for it).
                self._planned[request_id] -= failed[request_id] + output.num_scheduled_tokens[request_id]
                request.num_computed_tokens = row.start - failed[request_id]
                if request.num_preemptions == 0:
                    request.num_cached_tokens -= failed[request_id]
                continue
            request.num_computed_tokens = row.start + output.num_scheduled_tokens[request_id]
            if request_id in sampled.failed:
                outputs.append(EngineCoreOutput(
                    request_id, [], finish_reason=RequestStatus.FINISHED_ERROR.value, error=sampled.failed[request_id],
                ))
                self.finish(request_id, RequestStatus.FINISHED_ERROR)
                continue
            known = min(request.num_computed_tokens, request.num_tokens)
            self.kv_cache.cache_blocks(request_id, request.all_token_ids, known)
            if request_id in sampled.prompt_logprobs:
                self._add_prompt_logprobs(request, *sampled.prompt_logprobs[request_id])
            if token is None:
                continue
            request.append_token(token)
            if request.constraint is not None:
                self.structured_outputs.accept(request, token)  # type: ignore[union-attr]
            request.status, request.stop_reason = self._stop(request, token)
            logprobs = sampled.logprobs.get(request_id)
            first = len(request.output_token_ids) == 1
            prompt_logprobs = None
            if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
            outputs.append(EngineCoreOutput(
                request_id, [token], [logprobs] if logprobs is not None else None,
                request.finish_reason, request.stop_reason, request.num_cached_tokens,
                queued_seconds=request.first_scheduled_time - request.arrival_time if first else None,
                prompt_logprobs=prompt_logprobs,
            ))
            if request.finished:
                self._free(request)
        if connector is not None and report is not None:
            for request_id in connector.update(report):
                self.kv_cache.free(request_id)
        return outputs

    @staticmethod
    def _add_prompt_logprobs(request: Request, position: int, entries: list[TokenLogprobs]) -> None:
        """Keep the logprobs of prompt tokens not seen yet (a recomputation after a preemption repeats some)."""
        have = request.prompt_logprobs
        if have is None or request.prompt_logprobs_sent:
            return
        skip = len(have) + 1 - position  # the first entry scores prompt token ``position``; token 0 has none
        if skip >= 0:
            have.extend(entries[skip:])
    def preempt_all(self) -> None:
        """Preempt every running request (after a failed step: their KV may be incomplete)."""
        while self.running:
            self._preempt(self.running.pop())

    def restart_structured_outputs(self) -> None:
        """After a failed step: fill processes of which one died are started again (the matchers of the requests
        still held made again as they resume)."""
        if self.structured_outputs is not None:
            self.structured_outputs.recover(self.requests.values())

    def close(self, saves_timeout: float) -> None:
        """Close the KV connector's scheduler role and the structured-output manager (whose lifetime the scheduler
        owns); ``saves_timeout``: how long the core waited for pending saves, for the warning when some remain."""
        if self.connector is not None:
            if self.connector.has_delayed_frees:
                logger.warning("KV connector %r: finished requests still had saves in flight after %.0f s",
                               self.connector.name, saves_timeout)
            self.connector.close()
        if self.structured_outputs is not None:
            self.structured_outputs.close()

    def forget_steps_in_flight(self) -> None:
        """Steps scheduled but never applied (one raised): their results will not come, nor the contents of the blocks
        published for them."""
        for _, blocks in self._published_in_flight:
            self.kv_cache.uncache(blocks)
        self._published_in_flight = []
        self._epochs.clear()
        self._placeholders.clear()

    def _stop(self, request: Request, token_id: int) -> tuple[RequestStatus | None, int | None]:
        """How ``request`` ends with ``token_id``, just appended, and the stop token id that ended it
        (``(None, None)``: it goes on)."""
        params = request.params
        generated = len(request.output_token_ids)
        if generated >= params.min_tokens:
            if token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token_id
        if generated >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def finish(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """End a request (an abort, a stop string the API found) and free its blocks; safe in any state.

        The one writer of a request's status besides :meth:`update_from_output`: an end the API asks
        for arrives between steps, with no step output to carry it (and :meth:`update_from_output` ends
        a request whose step failed for it through here too)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.receiving.pop(request_id, None)
        if not request.finished:
            request.status = status
        self._free(request)
        return request

    def _free(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.requests.pop(request.request_id, None)
        self._planned.pop(request.request_id, None)
        self._placeholders.pop(request.request_id, None)
        self._newly_finished.append(request)
        if request.constraint is not None:
            self.structured_outputs.release(request)  # type: ignore[union-attr]
        self._forget_on_workers(request.request_id)
        if self.connector is None or not self.connector.request_finished(
            request, self.kv_cache.block_ids(request.request_id) if self.kv_cache.holds(request.request_id) else None
        ):
            self.kv_cache.free(request.request_id)
