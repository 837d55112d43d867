"""Per-step timings of the engine core: where a run's wall time goes (``bench/gpu_step_profile.py`` prints them).

Off unless a :class:`StepProfile` is set as :attr:`EngineCore.step_profile
<weft.engine.core.engine_core.EngineCore.step_profile>`; the core then calls it around each
:meth:`~weft.engine.core.engine_core.EngineCore.step` call, after each schedule, around each launch
(``Executor.execute_model``) and around each wait for a step's tokens (``StepHandle.result``).
While it is set, the step only adds host timestamps and references to what it already built; the
summary is derived once recording stops. It adds no device synchronization: on an accelerator it
records a timing event on the current stream before and after each launch, and reads them only in
:meth:`StepProfile.stop`, which synchronizes once. Unset, each hook point is one attribute test.

One :class:`StepRecord` per step call. With asynchronous scheduling, call ``N`` launches step ``N``
and then waits for the tokens of step ``N - 1``: its ``wait`` belongs to the step before. The
device timeline needs no such care: a step's events bracket its own work on the stream, so the
device span of step ``N`` runs from the moment the device reached its first launch (once step
``N - 1`` was done) to the end of its sampling and token copy, and the device was idle between the
end of one span and the start of the next. On the CPU, whose forward runs inside the launch call,
the launch's host interval stands for the device span.

A step with structured outputs samples after the call that launched it: its span ends at the
forward, and its sampling counts as the idle time after it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from weft.contracts.executor import Executor, ModelRunnerOutput, SchedulerOutput, StepHandle
    from weft.runner.model_runner import ModelRunner


class StepRecord(msgspec.Struct):
    """One :meth:`~weft.engine.core.engine_core.EngineCore.step` call; times in seconds, host ones from the
    profile's start (:func:`time.perf_counter`)."""

    start: float
    """When the call began."""
    end: float = 0.0
    """When it returned."""
    running: int = 0
    """Running requests after the schedule (those in the step and those waiting for a budget)."""
    waiting: int = 0
    """Requests still in the waiting queue after the schedule."""
    requests: int = 0
    """Requests in the step."""
    prefill_tokens: int = 0
    """Tokens of requests computing more than one token, or their prompt (a preempted request's recompute included)."""
    decode_tokens: int = 0
    """Tokens of requests past their prompt computing one token."""
    sampled_tokens: int = 0
    """Tokens the step samples: its decodes and the prefills that reach their last known token."""
    before_launch: float = 0.0
    """Host time from the call's start to its launch (scheduling, and sampling a step that waited for its bitmask)."""
    launch: float = 0.0
    """Host time in ``Executor.execute_model`` (preparing inputs and enqueueing the work; on the CPU, the forward)."""
    wait: float = 0.0
    """Host time blocked in ``StepHandle.result`` for the tokens this call applies (asynchronous: the step before)."""
    launched: bool = False
    """Whether the call launched a step (the last call of an asynchronous run only collects the one in flight)."""
    graph_size: int | None = None
    """The captured batch size the step replayed; None when it ran eagerly or the runner is not in this process."""
    device: float | None = None
    """Device span of the launched step (see the module docstring); None until :meth:`StepProfile.stop`."""
    idle_before: float | None = None
    """Device idle time from the end of the previous launched step (or the profile's start) to this one's span."""
    output: Any = None
    """The step's :class:`~weft.contracts.executor.SchedulerOutput` (classified in :meth:`StepProfile.stop`)."""
    events: Any = None
    """The launch's (begin, end) timing events on an accelerator."""

    @property
    def phase(self) -> str:
        """``decode/graph``, ``decode/eager``, ``mixed`` (prefill and decode), ``prefill``, or ``idle`` (no token)."""
        if not self.prefill_tokens and not self.decode_tokens:
            return "idle"
        if not self.prefill_tokens:
            return "decode/graph" if self.graph_size is not None else "decode/eager"
        return "mixed" if self.decode_tokens else "prefill"


class StepProfile:
    """Records a :class:`StepRecord` for every step of the core it is set on, between :meth:`start` and :meth:`stop`.

    ``runner``: the in-process model runner (``uniproc``), which tells graph replays from eager
    forwards and whose device is timed; without it only host times are recorded and no step
    counts as a graph replay."""

    def __init__(self, runner: ModelRunner | None = None) -> None:
        self.runner = runner
        device = runner.device if runner is not None else None
        self.device = device if device is not None and device.type != "cpu" else None
        """The accelerator timed with events; None: the launch's host interval is the device span."""
        self.records: list[StepRecord] = []
        self.wall = 0.0
        """Host seconds from :meth:`start` to :meth:`stop`."""
        self.device_tail: float | None = None
        """Device time from the end of the last launched step to :meth:`stop`."""
        self._started = 0.0
        self._current: StepRecord | None = None
        self._run_events: Any = None

    def _event(self) -> Any:
        import torch

        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def _synchronize(self) -> None:
        import torch

        torch.get_device_module(self.device.type).synchronize(self.device)

    def start(self) -> None:
        """Begin recording (the device's earlier work is waited for first)."""
        self.records = []
        if self.device is not None:
            self._synchronize()
            self._run_events = [self._event()]
        self._started = time.perf_counter()

    def stop(self) -> None:
        """End recording: wait for the device once, then fill each record's device times and counts."""
        if self.device is not None:
            self._run_events.append(self._event())
            self._synchronize()
        self.wall = time.perf_counter() - self._started
        self._classify()
        if self.device is not None:
            self._device_times()
        else:
            self._host_times()

    # What the engine core calls.

    @contextmanager
    def step(self) -> Iterator[None]:
        record = StepRecord(start=time.perf_counter() - self._started)
        self.records.append(record)
        self._current = record
        try:
            yield
        finally:
            record.end = time.perf_counter() - self._started
            self._current = None

    def scheduled(self, output: SchedulerOutput, running: int, waiting: int) -> None:
        record = self._current
        if record is not None:
            record.output, record.running, record.waiting = output, running, waiting

    def execute(self, executor: Executor, output: SchedulerOutput) -> StepHandle | None:
        record = self._current
        started = time.perf_counter()
        timed = self.device is not None and not output.is_empty
        begin = self._event() if timed else None
        handle = executor.execute_model(output)
        end = self._event() if timed else None
        if record is not None:
            record.before_launch = started - self._started - record.start
            record.launch = time.perf_counter() - started
            record.launched = True
            record.output = output
            record.graph_size = self.runner.last_graph_size if self.runner is not None and not output.is_empty else None
            record.events = (begin, end) if timed else None
        return handle

    def result(self, handle: StepHandle) -> ModelRunnerOutput:
        started = time.perf_counter()
        output = handle.result()
        if self._current is not None:
            self._current.wait += time.perf_counter() - started
        return output

    # Derived once recording stopped.

    def _classify(self) -> None:
        """Prefill, decode and sampled tokens of each step, from its scheduler output alone (each request's
        prompt and known length come from the step that sent it to the workers)."""
        prompt: dict[str, int] = {}
        known: dict[str, int] = {}
        for record in self.records:
            output = record.output
            if output is None or not record.launched:
                continue
            starts = {}
            for new in output.new_requests:
                prompt[new.request_id], known[new.request_id] = new.num_prompt_tokens, len(new.token_ids)
                starts[new.request_id] = new.num_computed_tokens
            for cached in output.cached_requests:
                starts[cached.request_id] = cached.num_computed_tokens
            record.requests = len(output.num_scheduled_tokens)
            for request_id, count in output.num_scheduled_tokens.items():
                start = starts[request_id]
                if count == 1 and start >= prompt[request_id]:
                    record.decode_tokens += 1
                    record.sampled_tokens += 1
                else:
                    record.prefill_tokens += count
                    record.sampled_tokens += start + count >= known[request_id]
            record.output = None  # the token lists are no longer needed

    def _host_times(self) -> None:
        """The CPU's timeline: each launch call's host interval is the step's forward."""
        previous_end = 0.0
        for record in self.records:
            if not record.launched:
                continue
            if not record.requests:  # nothing scheduled: no forward, as on a device
                record.device, record.idle_before = 0.0, 0.0
                continue
            launch_start = record.start + record.before_launch
            record.device, record.idle_before = record.launch, launch_start - previous_end
            previous_end = launch_start + record.launch
        self.device_tail = self.wall - previous_end

    def _device_times(self) -> None:
        run_begin, run_end = self._run_events
        previous_end = run_begin
        for record in self.records:
            if record.events is None:
                if record.launched:
                    record.device, record.idle_before = 0.0, 0.0
                continue
            begin, end = record.events
            record.device = begin.elapsed_time(end) / 1e3
            record.idle_before = previous_end.elapsed_time(begin) / 1e3
            previous_end = end
            record.events = None
        self.device_tail = previous_end.elapsed_time(run_end) / 1e3
