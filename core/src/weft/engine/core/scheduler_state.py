"""The scheduler's requests and queues, and the one writer of their progress.

:class:`SchedulerState` holds what :class:`~weft.engine.core.scheduler.Scheduler` decides over: the
requests, their queues (waiting, running, receiving their KV), per request the tokens planned and the
output placeholders of steps in flight, and what the workers hold (:mod:`weft.engine.core.steps_in_flight`).
It applies a step's results (:meth:`SchedulerState.update_from_output`: sampled tokens, stop rules, freed
blocks, the KV connector's report; a row's tokens go through the stop rules in
:mod:`weft.engine.core.request_output`) and ends the requests the API asks to end (:meth:`SchedulerState.finish`),
and answers the engine core's questions (finished and refused requests, whether nothing can run, gauges and
the counters of :mod:`weft.engine.core.counters`).
It owns the structured-output manager's lifetime: constraints start compiling when a request is added,
their fill restarts after a failure, and it is closed with the scheduler.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from weft.contracts.executor import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from weft.engine.core.counters import SpecDecodeCounts, compile_counters, connector_counters
from weft.engine.core.encoder_cache import EncoderCache
from weft.engine.core.kv_cache_manager import KVCacheManager
from weft.engine.core.request import Request, RequestStatus
from weft.engine.core.request_output import add_prompt_logprobs, take_tokens
from weft.engine.core.steps_in_flight import StepsInFlight
from weft.engine.messages import CoreStats, EngineCoreOutput

if TYPE_CHECKING:
    from weft.contracts.kv_connector import ConnectorOutput
    from weft.engine.core.kv_connector import SchedulerConnector
    from weft.engine.core.structured_output import StructuredOutputManager
    from weft.engine.messages import GrammarStart

logger = logging.getLogger("weft.engine")


class SchedulerState:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_model_len: int,
        connector: SchedulerConnector | None = None,
        structured_outputs: StructuredOutputManager | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.kv_cache = kv_cache
        self.num_speculative_tokens = num_speculative_tokens
        """``k`` of speculative decoding; 0: off."""
        self.spec = SpecDecodeCounts(num_speculative_tokens)
        """Proposals verified and accepted since start (vLLM's ``spec_decode_*`` counters)."""
        self.connector = connector
        self.structured_outputs = structured_outputs
        self.max_model_len = max_model_len
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
        self._steps = StepsInFlight()
        """What the workers hold, and what each step in flight planned."""
        self.passed_over = 0
        """Waiting requests passed over in the last step: the KV connector could not answer for them
        yet, or their structured-output constraint is still compiling."""
        self._refused: dict[str, str] = {}
        """Requests ended because they cannot run (a constraint that failed to compile), with the reason,
        since :meth:`take_refused`."""
        self.num_preemptions = 0
        """Preemptions since start."""
        self.fill_budget_failures = 0
        """Requests ended because their grammar mask took longer than ``engine.structured_output_fill_budget``."""
        self._newly_finished: list[Request] = []
        """Requests that ended since :meth:`take_finished` (for the request-finished hook)."""
        self.encoder_cache = EncoderCache(max_model_len)
        """What the workers hold of the images' encoder outputs (:mod:`weft.engine.core.encoder_cache`); the
        engine's builder sizes it from ``engine.encoder_cache_size``."""

    def speculates(self, request: Request) -> bool:
        """Whether ``request`` verifies proposals: speculation is on (a constrained request too: each position is
        masked, :mod:`weft.engine.core.grammar_proposals`). Such a request's next step waits for its step in flight,
        whose output brings its proposals."""
        return self.num_speculative_tokens > 0

    def all_wait_for_proposals(self) -> bool:
        """Whether the next step would schedule nothing because every running request speculates and waits for its
        step in flight, and none waits to be admitted."""
        return (
            self.num_speculative_tokens > 0
            and bool(self.running)
            and not self.waiting
            and all(self.speculates(request) and self._placeholders.get(request.request_id) for request in self.running)
        )

    def add(self, request: Request, grammar_start: GrammarStart | None = None) -> None:
        """Queue ``request``; one with a structured-output constraint starts compiling it (``grammar_start``:
        where the constraint starts when the model may reason first)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.multimodal is not None and (refusal := self.encoder_cache.refusal(request.multimodal)):
            raise ValueError(refusal)
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

    def grammar_output(
        self, request_ids: list[str], proposals: dict[str, list[int]] | None = None
    ) -> Future[GrammarOutput]:
        """The bitmask of a step's constrained requests (``request_ids``; a row per position for those verifying
        ``proposals``), filled on the structured-output thread."""
        assert self.structured_outputs is not None
        return self.structured_outputs.grammar_output(request_ids, self.requests, proposals)

    def stats(self, num_steps: int) -> CoreStats:
        """The gauges of the queues, the KV cache and the KV connector (``num_steps``: the core's step count)."""
        manager, connector = self.kv_cache, self.connector
        return CoreStats(
            waiting=len(self.waiting) + len(self.receiving),
            running=len(self.running),
            waiting_for_remote_kv=len(self.receiving),
            kv_cache_usage=manager.usage(),
            prefix_cache_query_tokens=manager.stats.query_tokens,
            prefix_cache_hit_tokens=manager.stats.hit_tokens,
            encoder_cache_queries=self.encoder_cache.stats.queries,
            encoder_cache_hits=self.encoder_cache.stats.hits,
            **(connector_counters(connector.stats) if connector is not None else {}),
            connector_metrics=connector.metric_totals if connector is not None else {},
            num_preemptions=self.num_preemptions,
            num_steps=num_steps,
            **self.spec.counters(),
            **compile_counters(self.structured_outputs, self.fill_budget_failures),
        )

    @property
    def queue_lengths(self) -> tuple[int, int]:
        """Running and waiting requests."""
        return len(self.running), len(self.waiting)

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: ModelRunnerOutput,
        connector_report: ConnectorOutput | None,
    ) -> list[EngineCoreOutput]:
        """Apply one step's results: ``sampled`` (the workers' tokens), stop rules and the KV connector's
        report of the step (``connector_report``: its loads, receipts and saves). Returns each request's
        progress.

        The one writer of request progress (computed, cached and output tokens) and of the ends
        outputs decide (a stop, the length, an error). Steps must be applied in the order they were
        scheduled.
        """
        rows = self._steps.applied()
        connector, report = self.connector, connector_report
        failed = connector.failed_loads(report) if connector is not None and report is not None else {}
        if connector is not None:
            resolved = connector.received(report) if report is not None else {}
            resolved.update(dict.fromkeys(connector.expired_receives(), 0))  # past engine.kv_load_timeout
            for request_id, arrived in resolved.items():
                request = self.receiving.pop(request_id)
                self._planned[request_id] += arrived
                request.num_computed_tokens = self._planned[request_id]
                if arrived and request.kv_transfer_params:
                    request.state_transferred = True  # the ring and state, not the snapshots: none to publish
                    self.kv_cache.forgo_snapshots(request_id)
                self.waiting.appendleft(request)
        outputs: list[EngineCoreOutput] = []
        for request_id, token in zip(sampled.request_ids, sampled.sampled_token_ids, strict=False):
            request = self.requests.get(request_id)
            row = rows.get(request_id)
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
            proposed = len(output.spec_token_ids.get(request_id, ())) if output.spec_token_ids else 0
            more = sampled.more_token_ids.get(request_id, ()) if sampled.more_token_ids else ()
            if proposed:
                # The KV of the rejected proposals is discarded: the next step starts after the last accepted one (its
                # blocks past that are overwritten), and no block is cached over them.
                self.spec.verified(proposed, len(more) if token is not None else 0)
                self._planned[request_id] -= proposed - (len(more) if token is not None else 0)
            request.num_computed_tokens = row.start + output.num_scheduled_tokens[request_id] - proposed + len(more)
            taken = self._take_row(request, token, more, sampled)
            if taken is not None:
                outputs.append(taken)
        if connector is not None and report is not None:
            for request_id in connector.update(report):
                self.kv_cache.free(request_id)
        return outputs

    def _take_row(
        self, request: Request, token: int | None, more: Sequence[int], sampled: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        """Take a row's tokens (``token``, then the proposals it accepted: ``more``) into ``request`` through the stop
        rules, or end it where its sampling failed; what the caller gets (None: a prefill chunk's row, nothing)."""
        request_id = request.request_id
        if request_id in sampled.failed:
            failed = EngineCoreOutput(
                request_id, [], finish_reason=RequestStatus.FINISHED_ERROR.value, error=sampled.failed[request_id]
            )
            self.finish(request_id, RequestStatus.FINISHED_ERROR)
            return failed
        if request_id in sampled.prompt_logprobs:
            add_prompt_logprobs(request, *sampled.prompt_logprobs[request_id])
        if token is None:
            known = min(request.num_computed_tokens, request.num_tokens)
            self.kv_cache.cache_blocks(request_id, request.all_token_ids, known, request.block_items)
            return None
        first_logprobs, all_logprobs = sampled.logprobs.get(request_id), None
        if first_logprobs is not None:
            more_logprobs = sampled.more_logprobs.get(request_id, ()) if sampled.more_logprobs else ()
            all_logprobs = [first_logprobs, *more_logprobs]
        taken = take_tokens(request, [token, *more], all_logprobs, self.structured_outputs, self.max_model_len)
        # Blocks are cached over the tokens kept only (a stop inside an accepted run drops the rest).
        known = min(request.num_computed_tokens, request.num_tokens)
        self.kv_cache.cache_blocks(request_id, request.all_token_ids, known, request.block_items)
        if request.finished:
            self._free(request)
        elif sampled.spec_token_ids and self.speculates(request):
            request.spec_token_ids = sampled.spec_token_ids.get(request_id, [])
        return taken

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
                logger.warning(
                    "KV connector %r: finished requests still had saves in flight after %.0f s",
                    self.connector.name,
                    saves_timeout,
                )
            self.connector.close()
        if self.structured_outputs is not None:
            self.structured_outputs.close()

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
        self.encoder_cache.release(request.request_id)
        self.requests.pop(request.request_id, None)
        self._planned.pop(request.request_id, None)
        self._placeholders.pop(request.request_id, None)
        self._newly_finished.append(request)
        if request.constraint is not None:
            self.structured_outputs.release(request)  # type: ignore[union-attr]
        self._steps.drop_on_workers(request.request_id)
        if self.connector is None or not self.connector.request_finished(
            request, self.kv_cache.block_ids(request.request_id) if self.kv_cache.holds(request.request_id) else None
        ):
            self.kv_cache.free(request.request_id)
