"""The engine core: the scheduler and the executor, stepping requests given as token ids.

The core only steps: :mod:`weft.engine.core.builder` builds its parts (hooks, executor
and model, KV-cache sizing, manager, connector, scheduler) and hands them over.
A step (:meth:`EngineCore.step`) is schedule → execute →
:meth:`Scheduler.update_from_output <weft.engine.core.scheduler.Scheduler.update_from_output>`;
the core also aborts requests, reports its gauges (:meth:`EngineCore.stats`) and closes.

With asynchronous scheduling the core keeps one step in flight: it schedules
and launches step N+1, then waits for step N's tokens while the device runs
N+1. Greedy output is the same either way.

The core knows no text: requests arrive tokenized (:class:`~weft.engine.messages.EngineCoreRequest`) and
leave as :class:`~weft.engine.messages.EngineCoreOutput` token ids. It runs in
the caller's process (``LLM``) or in its own (:mod:`weft.engine.core.core_process`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from weft.config import WeftConfig
from weft.contracts.executor import Executor, ExecutorFailed, GrammarOutput, SchedulerOutput, StepHandle
from weft.contracts.loader import ModelSource
from weft.engine.core.request import Request
from weft.engine.core.scheduler import Scheduler
from weft.engine.messages import CoreStats, EngineCoreOutput, EngineCoreRequest, StepOutputs

if TYPE_CHECKING:
    from weft.engine.core.step_profile import StepProfile

logger = logging.getLogger("weft.engine")

RETRY_QUIET_CALLS = 8
"""Calls that succeed, even without output, after which a failure counts as a first one again (a long
recomputed prefill, a KV load, fill processes starting again); fewer, and a second failure raises."""


class StepFailed(Exception):
    """A step failed again after its retry, or the workers failed (``fatal``): the core aborted every request it
    held (``request_ids``) and serves new ones unless ``fatal``. The error is the ``__cause__``."""

    def __init__(self, request_ids: list[str], fatal: bool) -> None:
        super().__init__(f"the engine step failed; {len(request_ids)} requests were aborted")
        self.request_ids = request_ids
        self.fatal = fatal


class StepRetries:
    """The retry rule of :meth:`EngineCore.step_with_retry`: how many steps failed since one produced output."""

    def __init__(self) -> None:
        self.failed_steps = 0
        """Steps that raised with no output since."""
        self.quiet_calls = 0
        """Calls that succeeded without output since the last failure."""

    def step(
        self,
        step: Callable[[], list[EngineCoreOutput]],
        recover: Callable[[], None],
        has_work: Callable[[], bool],
    ) -> list[EngineCoreOutput]:
        """``step()``; on a first failure, logged, ``recover()`` and no output; a second one raises (the count starts
        over). ``has_work()``: whether the core still holds work, read after a call that succeeded without output."""
        try:
            produced = step()
        except ExecutorFailed:
            raise  # the workers are gone: nothing to retry on
        except Exception:
            self.failed_steps += 1
            self.quiet_calls = 0
            if self.failed_steps > 1:
                self.failed_steps = 0
                raise
            logger.exception("engine step failed; retrying it once (running requests are recomputed)")
            recover()
            return []
        if self.failed_steps:
            self.quiet_calls += 1
            if produced or not has_work() or self.quiet_calls >= RETRY_QUIET_CALLS:
                self.failed_steps = 0
        return produced


class EngineCore:
    """Steps a scheduler and an executor that :func:`~weft.engine.core.builder.build_engine_core` built."""

    def __init__(
        self,
        config: WeftConfig,
        hooks: Any,
        executor: Executor,
        scheduler: Scheduler,
        source: ModelSource,
        num_blocks: list[int],
        async_scheduling: bool,
        startup: dict[str, Any] | None = None,
    ) -> None:
        """``config`` is the resolved one the parts were built from; ``executor`` has its KV cache allocated;
        ``startup``: what the startup summary says (:func:`weft.engine.core.builder.startup_facts`)."""
        self.config = config
        self.hooks = hooks
        self.executor = executor
        self.scheduler = scheduler
        self.source = source
        """The model source, for the API side (its tokenizer and limits)."""
        self.num_blocks = num_blocks
        self.async_scheduling = async_scheduling
        self.startup = startup or {}
        self.num_steps = 0
        self._retries = StepRetries()
        """Failed steps counted towards the retry rule (:meth:`step_with_retry`)."""
        self._in_flight: tuple[SchedulerOutput, StepHandle | None] | None = None
        """The step launched last, with asynchronous scheduling; its handle is None while its sampling
        waits for the bitmask being filled (:attr:`_bitmask`, which a synchronous step also uses)."""
        self._bitmask: Future[GrammarOutput] | None = None
        self._unreported: list[EngineCoreOutput] = []
        """Outputs of a step applied by a call that then raised (the next launch failed): the next call returns them."""
        self.step_profile: StepProfile | None = None
        """When set, records the timings of every step (:mod:`weft.engine.core.step_profile`); None: nothing is
        recorded."""

    # Requests.

    def add_request(self, request: EngineCoreRequest) -> None:
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if not self.has_work:  # a failure before the core went idle is not this request's
            self._retries.failed_steps = 0
        self.scheduler.add(Request.from_core_request(request), request.grammar_start)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.finish(request_id)
        if self._unreported:  # an id may come back with a new request: none of the old one's output reaches it
            aborted = set(request_ids)
            self._unreported = [result for result in self._unreported if result.request_id not in aborted]
        self._report_finished()

    def _report_finished(self) -> None:
        for request in self.scheduler.take_finished():
            self.hooks.hook.weft_request_finished(
                request_id=request.request_id,
                finish_reason=request.finish_reason,
                num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=len(request.output_token_ids),
            )

    @property
    def has_work(self) -> bool:
        return (
            self.scheduler.has_unfinished
            or self._in_flight is not None
            or bool(self._unreported)
            or self.scheduler.saves_pending
        )

    @property
    def has_unfinished(self) -> bool:
        """Whether requests wait, run or receive their KV (steps in flight and pending saves aside)."""
        return self.scheduler.has_unfinished

    # Stepping.

    def step(self) -> list[EngineCoreOutput]:
        """One step: what finished steps produced (with asynchronous scheduling, the step before the one launched).

        A step with structured outputs samples once the core has filled its bitmask on the
        structured-output thread, while the workers run its forward; the mask needs every earlier
        token, so the step in flight is applied first. With asynchronous scheduling the fill also
        runs across the return to the caller: the step in flight is then one whose sampling waits
        for its mask (its handle is None), sampled by the next call once it has scheduled the step
        after it."""
        self.num_steps += 1
        if self.step_profile is None:
            return self._step()
        with self.step_profile.step():
            return self._step()

    def _step(self) -> list[EngineCoreOutput]:
        if not self.async_scheduling:
            output = self._schedule()
            if output.structured_output_request_ids:
                self._bitmask = self._grammar_output(output)  # filled while the forward runs
            handle = self._execute(output)
            if handle is None:
                handle = self.executor.sample_tokens(self._take_bitmask())
            return self._apply(output, handle)
        results, self._unreported = self._unreported, []
        try:
            self._step_async(results)
        except Exception:
            self._unreported = results  # applied already: their tokens must still reach the caller
            raise
        return results

    def _step_async(self, results: list[EngineCoreOutput]) -> None:
        """One step with asynchronous scheduling, appending what it applies to ``results`` as it goes (a call
        that raises midway has applied them all the same)."""
        launched = None
        if self.scheduler.has_unfinished or self._in_flight is None:
            if self._in_flight is not None and self.scheduler.all_wait_for_proposals():
                # Every request that could run waits for its proposals, which come with the step in flight: apply it
                # first, then schedule them (rather than launch an empty step and schedule them on the next call).
                self._sample_in_flight()
                results += self._apply_in_flight()
            output = self._schedule()
            if (
                output.structured_output_request_ids
                and self.executor.launch_ahead
                and self._in_flight is not None
                and self._in_flight[1] is None
                and self.step_profile is None
            ):  # a profile times each launch
                # The step in flight waits for its mask, and this step's forward reads its tokens: the workers stage
                # this step's inputs while the core waits for that mask, and launch it as soon as they sampled.
                output.launch_after_sampling = True
                launched = (output, self._execute(output))
                self._sample_in_flight()
                results += self._apply_in_flight()
                self._bitmask = self._grammar_output(output)
                self._in_flight = launched
                return
            self._sample_in_flight()  # its tokens are the next forward's inputs
            if not output.structured_output_request_ids:
                launched = (output, self._execute(output))
            else:
                # Tokens already on the host (a CPU worker samples as it returns) are accepted before
                # the forward, which the fill then overlaps; otherwise the forward is launched first: it
                # reads the step in flight's tokens on the device, so the device runs it while the host
                # waits for those tokens and the fill works on them. (Waiting for them first, so that the
                # fill also overlapped the launch, left the device idle for the launch's host time: at
                # SmolLM2-135M's shape on the H200, a 1.90 ms step against 1.49 unconstrained.)
                accept_first = self._in_flight is None or self._in_flight[1].done()  # type: ignore[union-attr]
                if accept_first:
                    results += self._apply_in_flight()
                    self._bitmask = self._grammar_output(output)
                launched = (output, self._execute(output))
                if not accept_first:
                    results += self._apply_in_flight()
                    self._bitmask = self._grammar_output(output)
        else:
            self._sample_in_flight()
        results += self._apply_in_flight()
        self._in_flight = launched

    def _execute(self, output: SchedulerOutput) -> StepHandle | None:
        if self.step_profile is None:
            return self.executor.execute_model(output)
        return self.step_profile.execute(self.executor, output)

    def _sample_in_flight(self) -> None:
        """Sample the step in flight if it waits for its bitmask."""
        if self._in_flight is not None and self._in_flight[1] is None:
            self._in_flight = (self._in_flight[0], self.executor.sample_tokens(self._take_bitmask()))

    def _take_bitmask(self) -> GrammarOutput:
        bitmask, self._bitmask = self._bitmask, None
        assert bitmask is not None
        return bitmask.result()

    def _apply_in_flight(self) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            return []
        (output, handle), self._in_flight = self._in_flight, None
        assert handle is not None
        return self._apply(output, handle)

    def _grammar_output(self, output: SchedulerOutput) -> Future[GrammarOutput]:
        return self.scheduler.grammar_output(output.structured_output_request_ids, output.spec_token_ids)

    def take_refused(self) -> dict[str, str]:
        """Requests the scheduler ended because they cannot run, with the reason, since the last call."""
        return self.scheduler.take_refused()

    def step_outputs(self, refused: dict[str, str]) -> StepOutputs:
        """One step as the API side receives it, under the failure rules every client shares: :meth:`step_with_retry`
        (a failed step is retried once); ``refused`` (requests :meth:`add_request` refused since the last step) joins
        those the scheduler refused. A step that fails again, or is interrupted, aborts every request the core holds
        (:meth:`reset_after_failure`), so the core serves the next ones: :class:`StepFailed` names them (``fatal``
        when the workers are gone), raised from the error; an interrupt propagates as itself."""
        try:
            produced = self.step_with_retry()
        except BaseException as error:
            held = self.reset_after_failure()
            refused.update(self.take_refused())
            if not isinstance(error, Exception):
                raise
            raise StepFailed(held, isinstance(error, ExecutorFailed)) from error
        refused.update(self.take_refused())  # constraints that failed to compile
        return StepOutputs(produced, self.stats(), refused)

    def step_with_retry(self) -> list[EngineCoreOutput]:
        """:meth:`step`; one that raises is retried once: the first failure is logged and its running
        requests are recomputed by the next calls; a second failure before any of them produced output
        raises (the caller fails the requests, :meth:`reset_after_failure`), unless :data:`RETRY_QUIET_CALLS`
        calls succeeded in between. A call that succeeds without output (the recomputed prefill launched, a fill
        answer only taken by the next call) does not make the next failure a first one on its own: a fault that
        fails every other call would retry forever."""
        return self._retries.step(self.step, self.recover_from_failure, lambda: self.has_work)

    def _schedule(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        if self.step_profile is not None:
            self.step_profile.scheduled(output, *self.scheduler.queue_lengths)
        if output.is_empty and self._in_flight is None and (reason := self.scheduler.cannot_run()) is not None:
            raise RuntimeError(reason)
        return output

    def _apply(self, output: SchedulerOutput, handle: StepHandle) -> list[EngineCoreOutput]:
        sampled = handle.result() if self.step_profile is None else self.step_profile.result(handle)
        results = self.scheduler.update_from_output(output, sampled, sampled.connector_output)
        self._report_finished()
        if output.is_empty and not results:
            time.sleep(0.002)  # waiting on the connector (saves, lookups): don't spin
        return results

    def wait_for_saves(self, timeout: float) -> bool:
        """Step (nothing scheduled but the workers' reports) until no finished request waits for its
        KV connector saves, or ``timeout`` seconds; True when none waits."""
        deadline = time.monotonic() + timeout
        while self.scheduler.saves_pending and time.monotonic() < deadline:
            self.step()
        return not self.scheduler.saves_pending

    def recover_from_failure(self) -> None:
        """A step raised: drop the step in flight and preempt every running request, so the next step
        recomputes them from their tokens (what they generated so far is kept)."""
        self._forget_in_flight()
        self.scheduler.preempt_all()
        self.scheduler.restart_structured_outputs()

    def reset_after_failure(self) -> list[str]:
        """A step raised: drop the step in flight and abort every request, so the core can serve new ones (the
        outputs of requests that finished in a step applied before the failure come with the next step). Returns
        the requests it aborted."""
        self._forget_in_flight()
        held = self.scheduler.unfinished_ids
        self.abort(held)
        self.scheduler.restart_structured_outputs()
        return held

    def _forget_in_flight(self) -> None:
        self._in_flight = None
        if self._bitmask is not None:
            self._bitmask.exception()  # the fill lets go of the matchers (its answer read) before any accepts a token
            self._bitmask = None
        self.scheduler.forget_steps_in_flight()

    def stats(self) -> CoreStats:
        return self.scheduler.stats(self.num_steps)

    def close(self, timeout: float = 60.0) -> None:
        """Finish the step in flight and the KV connector's pending saves, then stop the workers. Idempotent."""
        if self.executor is None:
            return
        deadline = time.monotonic() + timeout
        self.abort(self.scheduler.unfinished_ids)
        try:
            while self._in_flight is not None:
                self.step()
            self.wait_for_saves(max(0.0, deadline - time.monotonic()))
        except ExecutorFailed:
            self._forget_in_flight()  # the workers are gone: nothing to finish
        self.scheduler.close(timeout)
        self.executor.shutdown()
        # Dropped now, not when this object is collected: an in-process worker holds the model and the KV cache.
        self.executor = None  # type: ignore[assignment]

    def describe(self) -> dict[str, Any]:
        engine = self.config.engine
        return {
            "max_num_seqs": engine.max_num_seqs,
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "async_scheduling": self.async_scheduling,
            "num_kv_blocks": self.num_blocks,
            **self.startup,
        }
