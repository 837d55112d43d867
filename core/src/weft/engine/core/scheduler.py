"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Every step the scheduler gives each running request the tokens it still needs
(one for a decode, the rest of a prompt for a prefill, cut to the remaining
budget when chunked prefill is on), then admits waiting requests in arrival
order while budget and sequence slots remain. Long prefills do not starve short
requests: a prefill of more than ``long_prefill_token_threshold`` tokens gets
that many first and the budget the others leave after, and at most
``max_long_partial_prefills`` of them run at once (a long prompt beyond that
waits while shorter ones behind it are admitted). A prefill that scores its prompt
(prompt logprobs: passes over the vocabulary for every token) computes at most
``prompt_logprobs_chunk`` tokens per step. A running request whose grammar mask took
longer than ``engine.structured_output_fill_budget`` ends. A request that can't get KV
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

import time
from typing import TYPE_CHECKING

from weft.contracts.executor import SchedulerOutput
from weft.engine.core.kv_cache_manager import ComputedPrefix, KVCacheManager
from weft.engine.core.request import Request
from weft.engine.core.scheduler_state import SchedulerState
from weft.engine.core.steps_in_flight import ScheduledRow

if TYPE_CHECKING:
    from weft.engine.core.kv_connector import SchedulerConnector
    from weft.engine.core.structured_output import StructuredOutputManager


def scores_prompt(request: Request) -> bool:
    """Whether ``request``'s prefill scores its prompt (prompt logprobs): each token costs passes over the vocabulary
    (its logits, their log-softmax, the token's rank, the top ones), and such a prefill's full-budget steps held every
    other request for seconds; it computes at most ``engine.prompt_logprobs_chunk`` tokens per step."""
    return request.prompt_logprobs is not None and not request.prompt_logprobs_sent


def end_over_fill_budget(scheduler: Scheduler) -> None:
    """End the running requests whose grammar mask took longer than ``engine.structured_output_fill_budget`` in a
    step: refused, a 400 naming it (every step waits for their masks, and their next ones would take longer still)."""
    # Waiting ones too: a request preempted after its mask was timed comes back with its constraint no longer live,
    # and would sample unconstrained.
    over = [
        request
        for request in [*scheduler.running, *scheduler.waiting]
        if request.constraint is not None and request.constraint.exceeded
    ]
    for request in over:
        scheduler._refused[request.request_id] = request.constraint.exceeded  # type: ignore[union-attr,assignment]
        scheduler.fill_budget_failures += 1
        scheduler.finish(request.request_id)


class _StepPlan:
    """What :meth:`Scheduler.schedule` has decided so far for one step."""

    __slots__ = ("budget", "long_cap", "scheduled", "capped", "proposals")

    def __init__(self, budget: int, long_cap: int) -> None:
        self.budget = budget
        """Tokens the step may still take."""
        self.long_cap = long_cap
        """Tokens a long prefill gets before the others had their share (0: no cap)."""
        self.scheduled: dict[str, tuple[Request, int]] = {}
        """Each scheduled request and its token count."""
        self.capped: list[Request] = []
        """Long prefills held to ``long_cap`` tokens until the others had their share."""
        self.proposals: dict[str, list[int]] = {}
        """The proposals each speculating request verifies (its count is one more than theirs)."""


class Scheduler(SchedulerState):
    """Decides each step (:meth:`schedule`) over the requests and queues of :class:`SchedulerState`, which applies
    the steps' results."""

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
        num_speculative_tokens: int = 0,
        speculator_owns_model: bool = False,
        prompt_logprobs_chunk: int = 0,
    ) -> None:
        super().__init__(kv_cache, max_model_len, connector, structured_outputs, num_speculative_tokens)
        self.draft_lookahead = num_speculative_tokens if speculator_owns_model else 0
        """Slots allocated past a decoding request's step for its draft model's proposals (0: no draft model);
        taken only where the cache has room: a draft proposes within the blocks its request holds."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        """A prefill needing more tokens than this is long: while others wait or run, it gets this many
        per step (then whatever budget they leave), and at most ``max_long_partial_prefills`` long
        prefills run at once. 0: no cap."""
        self.max_long_partial_prefills = max_long_partial_prefills
        self.prompt_logprobs_chunk = prompt_logprobs_chunk if enable_chunked_prefill else 0  # see scores_prompt

    # Scheduling.

    def schedule(self) -> SchedulerOutput:
        end_over_fill_budget(self)
        plan = _StepPlan(
            self.max_num_batched_tokens, self.long_prefill_token_threshold if self.enable_chunked_prefill else 0
        )
        # A step that preempted admits nothing: the blocks it freed are the running requests' next ones, and the
        # victim, first in line, would come straight back (its blocks of the step in flight not counted yet) only to
        # be preempted again, recomputing its prefill step after step.
        if not self._schedule_running(plan):
            self._admit_waiting(plan)
        else:
            self.passed_over = 0
        # What the others left of the budget goes back to the long prefills (not to one that scores its prompt).
        for request in [capped for capped in plan.capped if not (self.prompt_logprobs_chunk and scores_prompt(capped))]:
            if plan.budget <= 0:
                break
            _, count = plan.scheduled[request.request_id]
            planned = self._planned[request.request_id]
            extra = min(request.num_tokens - planned - count, plan.budget)
            if extra > 0 and self.kv_cache.allocate_slots(request.request_id, planned + count + extra):
                plan.scheduled[request.request_id] = (request, count + extra)
                plan.budget -= extra
        encoder_inputs = self.encoder_cache.plan_step(plan.scheduled, self._planned)
        output = self._build_output(list(plan.scheduled.values()), plan.proposals)
        output.encoder_inputs, output.freed_encoder_hashes = encoder_inputs, self.encoder_cache.take_freed()
        return output

    def _schedule_running(self, plan: _StepPlan) -> bool:
        """Give each running request the tokens it still needs, preempting the most recently admitted ones for
        blocks; True when a request was preempted."""
        index = 0
        preempted = False
        while index < len(self.running) and plan.budget > 0:
            request = self.running[index]
            planned, placeholders = self._planned[request.request_id], self._placeholders.get(request.request_id, 0)
            if placeholders and self.speculates(request):
                index += 1  # its proposals come with the output of its step in flight
                continue
            needed = request.num_tokens + placeholders - planned
            if len(request.output_token_ids) + placeholders >= request.max_tokens:
                needed = 0  # its last token is in flight: nothing more to compute
            proposals = self._proposals(request, needed, plan.budget)
            needed += len(proposals)
            count = min(needed, plan.budget) if self.enable_chunked_prefill else needed
            if plan.long_cap and count > plan.long_cap:
                count = plan.long_cap
                plan.capped.append(request)
            if self.prompt_logprobs_chunk and scores_prompt(request):
                count = min(count, self.prompt_logprobs_chunk)
            if count <= 0 or count > plan.budget:
                index += 1
                continue
            ahead = self.draft_lookahead if needed == count and self.speculates(request) else 0
            allocated = ahead > 0 and self.kv_cache.allocate_slots(request.request_id, planned + count + ahead)
            while not allocated and not self.kv_cache.allocate_slots(request.request_id, planned + count):
                victim = self.running.pop()
                self._steps.publish_before_preempt(
                    victim, self._planned.get(victim.request_id, 0), self.kv_cache, self.connector is not None
                )
                self._preempt(victim)
                preempted = True
                if victim in plan.capped:
                    plan.capped.remove(victim)
                if victim is request:
                    break
            else:
                plan.scheduled[request.request_id] = (request, count)
                if proposals:
                    plan.proposals[request.request_id] = proposals
                plan.budget -= count
                index += 1
        return preempted

    def _proposals(self, request: Request, needed: int, budget: int) -> list[int]:
        """The proposals ``request`` verifies this step (taken from it): those its speculator made, cut to what the
        step's token budget, its ``max_tokens`` and the context length leave after its own token, and to what its
        constraint allows (:meth:`StructuredOutputManager.verifiable`); none unless it decodes one token this step."""
        proposals, request.spec_token_ids = request.spec_token_ids, []
        if not proposals or needed != 1:
            return []
        if request.constraint is not None:
            proposals = self.structured_outputs.verifiable(request, proposals)  # type: ignore[union-attr]
        room = min(
            budget - 1,
            request.max_tokens - len(request.output_token_ids) - 1,  # the step adds up to len(proposals) + 1 tokens
            self.max_model_len - request.num_tokens - 1,
        )
        return proposals[: max(room, 0)]

    def _admit_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in order while budget, blocks and sequence slots remain (see the module docstring
        for the long prefills and the requests passed over)."""
        passed_over = 0
        set_aside: list[Request] = []
        long_prefills = len(plan.capped)
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.constraint is not None and not self._constraint_ready(request):
                if not request.finished:
                    passed_over += 1
                    set_aside.append(self.waiting.popleft())
                continue
            tokens = request.all_token_ids
            first_time = request.num_preemptions == 0
            resumed = self.kv_cache.holds(request.request_id)  # back from an asynchronous load, with its blocks
            found = (None, self._planned[request.request_id], 0, False) if resumed else self._find_computed(request)
            if found is None:
                passed_over += 1
                set_aside.append(self.waiting.popleft())
                continue
            prefix, local, external, load_async = found
            computed = local + external
            needed = 0 if load_async else len(tokens) - computed
            count = min(needed, plan.budget) if self.enable_chunked_prefill else needed
            long = bool(plan.long_cap) and count > plan.long_cap
            if long and long_prefills >= self.max_long_partial_prefills:
                set_aside.append(
                    self.waiting.popleft()
                )  # its turn comes when a long prefill ends; shorter ones go first
                continue
            if long:
                count = plan.long_cap
            if self.prompt_logprobs_chunk and scores_prompt(request):
                count = min(count, self.prompt_logprobs_chunk)
            if count > plan.budget:
                break
            # A request that samples in this step needs a slot for that token in the next: taken now where others
            # run, or it could be admitted only to preempt itself for that slot (and, with asynchronous scheduling,
            # to lose the token in flight), over and over while they hold the rest. Not with a KV connector, whose
            # saves and transfers take a request's blocks as its computed tokens' own.
            lookahead = 1 if self.connector is None and self.running and computed + count == len(tokens) else 0
            if computed + count == len(tokens) and self.speculates(request):
                lookahead = max(lookahead, self.draft_lookahead)
            if not self.kv_cache.allocate_slots(
                request.request_id,
                computed + count + lookahead,
                prefix,
                prompt_length=len(tokens) if first_time else 0,
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
            plan.scheduled[request.request_id] = (request, count)
            plan.budget -= count
            if long:
                long_prefills += 1
                plan.capped.append(request)
        self.waiting.extendleft(reversed(set_aside))
        self.passed_over = passed_over

    def _find_computed(self, request: Request) -> tuple[ComputedPrefix, int, int, bool] | None:
        """For a request not holding blocks: its prefix found in the cache, the tokens computed locally, those the
        KV connector loads, and whether it loads them asynchronously; None when the connector cannot answer for it
        yet (it is passed over for this step)."""
        tokens = request.all_token_ids
        # Prompt logprobs need every prompt token computed here: no cached or loaded prefix.
        computes_all = request.prompt_logprobs is not None and not request.prompt_logprobs_sent
        filled = self.connector.filled_groups if self.connector is not None else ()
        prefix = self.kv_cache.find_computed_prefix(tokens[:1] if computes_all else tokens, filled, request.block_items)
        offer = (
            self.connector.lookup(
                request,
                prefix.num_tokens,
                may_load=not computes_all,
                fillable=(prefix.fillable_tokens, self.kv_cache.fillable_unit),
            )
            if self.connector is not None
            else (0, False)
        )
        if offer is None:
            return None
        local, (external, load_async) = prefix.num_tokens, offer
        if filled:  # the connector loads its groups' blocks of these tokens; the others share cached ones
            prefix = self.kv_cache.filled(prefix, external)
        return prefix, local, external, load_async

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

    def _build_output(
        self, scheduled: list[tuple[Request, int]], proposals: dict[str, list[int]] | None = None
    ) -> SchedulerOutput:
        counts: dict[str, int] = {}
        rows: dict[str, ScheduledRow] = {}
        constrained: list[str] = []
        new_requests, cached_requests = self._steps.requests_for_workers(scheduled, self._planned, self.kv_cache)
        for request, count in scheduled:
            counts[request.request_id] = count
        metadata = None
        if self.connector is not None:
            metadata = self.connector.build_metadata(
                [
                    (request, self._planned[request.request_id], count, self.kv_cache.block_ids(request.request_id))
                    for request, count in scheduled
                ],
                self.kv_cache,
            )
        first_ids = {new.request_id for new in new_requests}
        for request, count in scheduled:
            request_id = request.request_id
            start = self._planned[request_id]
            placeholders = self._placeholders.get(request_id, 0)
            self._planned[request_id] = start + count
            proposed = len(proposals.get(request_id, ())) if proposals else 0
            samples = start + count - proposed == request.num_tokens + placeholders
            if samples:  # this step samples the request's next token
                self._placeholders[request_id] = placeholders + 1
            rows[request_id] = ScheduledRow(request.num_preemptions, start, samples, request_id in first_ids)
            if samples and request.constraint is not None and request.constraint.live:
                constrained.append(request.request_id)
        finished = self._steps.launched(rows)
        return SchedulerOutput(
            new_requests=new_requests,
            cached_requests=cached_requests,
            num_scheduled_tokens=counts,
            finished_request_ids=finished,
            kv_connector_metadata=metadata,
            structured_output_request_ids=constrained,
            has_sync_kv_loads=self.connector is not None and self.connector.has_sync_loads(list(counts)),
            spec_token_ids=proposals or {},
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        self.encoder_cache.release(request.request_id)
        if self.connector is not None:
            self.connector.preempted(request)
        self._steps.drop_on_workers(request.request_id)
        self._planned.pop(request.request_id)
        self._placeholders.pop(request.request_id, None)
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.state_transferred = False
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def preempt_all(self) -> None:
        """Preempt every running request (after a failed step: their KV may be incomplete)."""
        while self.running:
            self._preempt(self.running.pop())

    def forget_steps_in_flight(self) -> None:
        """Steps scheduled but never applied (one raised): their results will not come, nor the contents of the blocks
        published for them."""
        self._steps.forget(self.kv_cache)
        self._placeholders.clear()
        self.encoder_cache.reset()  # the workers may not hold what those steps were to encode
