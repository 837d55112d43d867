"""The API process's engine: a process client of the engine core plus one output stream per request, on asyncio.

:class:`AsyncEngine` starts the core in its own process (:class:`~weft.engine.client.ProcessClient`: spawn,
handshake, sockets) and sends it tokenized requests and aborts from the event loop. Work on a request's text
(templating, tokenizing, checking it against the model) runs on a bounded pool of tokenizer threads
(:meth:`AsyncEngine.off_loop`), never on the event loop. A reader thread
receives what the core streams back and turns token ids into text with the
output processor (detokenization, stop strings and their holdback stay off the event loop);
each request's progress goes to the submitting coroutine's ``asyncio.Queue`` as
:class:`~weft.engine.api.streams.Delta` items (:mod:`weft.engine.api.streams`), handed over with
``call_soon_threadsafe``. A lock guards the request tables the loop and the reader share. The scheduler and the model
run in the core's process, so neither waits on the other's GIL.

A request ends with an error delta (``error`` and an HTTP status) when the core
refuses it (400) or fails it (500: non-finite logits, a step that failed twice),
when it outlives ``request_timeout`` counted from its arrival (408: it is aborted, its KV blocks
freed), when a drain gives up on it (503), or when the core process dies (503: new
requests are refused and ``on_core_death`` is called; ``weft serve`` exits non-zero). Which requests are
admitted through a drain: :mod:`weft.engine.api.admission`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from weft.config import WeftConfig
from weft.contracts.mm_processor import MultimodalInputs
from weft.engine.api.admission import Admission
from weft.engine.api.core_health import CoreHealth
from weft.engine.api.frontend import Frontend
from weft.engine.api.output_processor import OutputProcessor, RequestOutputState, StepResult
from weft.engine.api.streams import Delta, DeltaQueue, OutputStream
from weft.engine.client import ProcessClient
from weft.engine.messages import CoreStats, GrammarStart, StepOutputs
from weft.plugins import PluginRegistry
from weft.plugins.lock import verify_plugin_lock
from weft.sampling_params import SamplingParams

logger = logging.getLogger("weft.engine")


class QueueFullError(Exception):
    """Too many requests are waiting; retry later."""


class ShuttingDownError(Exception):
    """The engine is draining (or its core is gone) and takes no new requests."""


Delivery = tuple[asyncio.Queue, Delta]


class AsyncEngine:
    """Starts the engine core process; call :meth:`start` on the event loop before submitting."""

    def __init__(
        self,
        config: WeftConfig,
        registry: PluginRegistry | None = None,
        max_queued_requests: int = 1024,
        startup_timeout: float = 3600.0,
        request_timeout: float | None = None,
        tokenizer_threads: int = 4,
        connect: Callable[[], ProcessClient] | None = None,
    ) -> None:
        """``connect``: makes the client of the engine core (default: start the core, as the only API process;
        ``weft serve --api-server-count`` passes its own, :mod:`weft.entrypoints.api_servers`)."""
        verify_plugin_lock(config)  # before the frontend resolves the model (the core process checks again)
        self.config = config
        self.registry = registry or PluginRegistry()
        self.frontend = Frontend(config, self.registry)
        self.tokenizer = self.frontend.tokenizer
        self.model_name = self.frontend.model_name
        self.max_model_len = self.frontend.max_model_len
        self.max_queued_requests = max_queued_requests
        self.request_timeout = request_timeout
        """Seconds a request may take from submission to its last token (None: no limit)."""
        self.observer: Any = None
        """Optional object with ``first_token(seconds)``, ``inter_token(seconds)``, ``finished(state)``,
        ``failed(reason)`` (called from the reader thread and the loop)."""
        self.on_core_death: Callable[[], None] | None = None
        self.outputs = OutputProcessor(self.tokenizer)
        self.stats = CoreStats()
        self._streams: dict[str, OutputStream] = {}
        self._lock = threading.Lock()
        """Guards ``outputs`` and ``_streams``, shared by the event loop and the reader thread."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._tokenizer_threads = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="weft-tokenizer")
        self.admission = Admission()
        """Which requests are admitted, through a drain and its end."""
        self._preparing = 0
        """Requests :meth:`submit` is checking on a tokenizer thread: they count as waiting."""
        self.dead = False
        self.health = CoreHealth(config.server.health_stall_timeout)
        self._stopping = False
        self._reader_done = False
        self._tasks: list[asyncio.Task] = []
        self.client = connect() if connect is not None else ProcessClient(config, startup_timeout)
        self.engine_settings = self.client.engine_settings

    @property
    def death_reason(self) -> str:
        """Why the core stopped, when it said (its workers failed)."""
        return self.client.death_reason

    # The core process.

    async def start(self) -> None:
        """Start the reader thread and the watcher of the core process and deadlines (on the serving loop)."""
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read_outputs, name="weft-engine-outputs", daemon=True)
        self._reader.start()
        self._tasks = [asyncio.create_task(self._watch())]

    async def _watch(self) -> None:
        while self.client.alive or self._stopping:
            if self._stopping:
                return
            self._expire_overdue()
            await asyncio.sleep(0.2)
        self._core_died()

    def _core_died(self) -> None:
        self.dead = True
        self.admission.close()
        reason = f": {self.death_reason}" if self.death_reason else ""
        message = (
            f"the engine core process died (exit code {self.client.exitcode}){reason}; the server is shutting down"
        )
        logger.error(message)
        self._fail_all(message, 503, "engine_dead")
        if self.on_core_death is not None:
            self.on_core_death()

    # Called from the event loop.

    async def off_loop(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` on a tokenizer thread (``server.tokenizer_threads`` of them, shared by every
        request). A caller that is cancelled stops waiting, and its call is dropped if it has not started. They
        are not the event loop's default executor, which a shutdown waits for."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_threads, functools.partial(function, *args)
        )

    def refusal(self, arrival: float) -> str | None:
        """Why a request that arrived at ``arrival`` (``time.monotonic()``) may not be submitted now, or None:
        the core died, the engine stopped, or a drain began before the request arrived."""
        return self.admission.refusal(arrival, self.dead)

    async def submit(
        self,
        requests: list[tuple[str, list[int], SamplingParams, int]],
        output: asyncio.Queue,
        kv_transfer_params: dict[str, Any] | None = None,
        grammar_start: GrammarStart | None = None,
        arrival: float | None = None,
        multimodal: MultimodalInputs | None = None,
    ) -> None:
        """Queue ``(request_id, prompt_token_ids, params, index)`` requests, all or none, deltas to ``output``
        (``kv_transfer_params``: for the KV connector, one request only; ``grammar_start``: see
        :meth:`weft.engine.api.frontend.Frontend.core_request`). The requests are the sequences of one API request
        (their params differ in their seed at most), checked on a tokenizer thread. ``arrival``: when the API
        request arrived (``time.monotonic()``; default now): ``request_timeout`` counts from it, and a drain admits
        a request that arrived before it began. ``multimodal``: the images of the (one) prompt, as
        :meth:`weft.engine.api.frontend.Frontend.process_images` made them.

        Raises ValueError (a bad request), QueueFullError or ShuttingDownError.
        """
        arrival = time.monotonic() if arrival is None else arrival
        if (refusal := self.refusal(arrival)) is not None:
            raise ShuttingDownError(refusal)
        if self.stats.waiting + self._preparing + len(requests) > self.max_queued_requests:
            raise QueueFullError(f"{self.stats.waiting + self._preparing} requests are already waiting")
        self._preparing += len(requests)
        try:
            core_requests = await self.off_loop(
                self.frontend.core_requests,
                [(request_id, prompt, params) for request_id, prompt, params, _ in requests],
                kv_transfer_params,
                grammar_start,
                multimodal,
            )
        finally:
            self._preparing -= len(requests)
        if (refusal := self.refusal(arrival)) is not None:  # the drain ended (or the core died) meanwhile
            raise ShuttingDownError(refusal)
        now = time.monotonic()
        deadline = None if self.request_timeout is None else arrival + self.request_timeout
        with self._lock:
            self.health.submitted(now, idle=not self.outputs.requests)
            for (request_id, _, params, index), core_request in zip(requests, core_requests, strict=False):
                self.outputs.add(request_id, core_request.prompt_token_ids, params)
                self._streams[request_id] = OutputStream(output, index, last_token_time=now, deadline=deadline)
        self.stats.waiting += len(requests)
        if not self.client.add_requests(core_requests):
            with self._lock:
                for request_id, *_ in requests:
                    self._streams.pop(request_id, None)
                    self.outputs.abort(request_id)
            raise ShuttingDownError("the engine core process died")

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (safe to call for finished or unknown ids)."""
        with self._lock:
            self._streams.pop(request_id, None)
            state = self.outputs.abort(request_id)
        if state is None:
            return
        if self.observer is not None:
            self.observer.finished(state)
        if not self.dead:
            self.client.abort([request_id])

    @property
    def accepting(self) -> bool:
        """Whether a request arriving now is admitted (False while draining, after, and once the core died)."""
        return self.refusal(time.monotonic()) is None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.outputs.requests)

    def unhealthy(self) -> str | None:
        """Why ``/health`` answers 503 for the core (None: it is well; :class:`CoreHealth`)."""
        return self.health.problem(self.dead, len(self.outputs.requests))

    def _expire_overdue(self) -> None:
        """Abort requests past ``server.request_timeout`` or whose client left their output unread for
        ``server.write_timeout``; each gets a 408 error delta."""
        with self._lock:
            expired = _expired(self._streams, time.monotonic(), self.request_timeout, self.config.server.write_timeout)
        for request_ids, message, reason in expired:
            self._end_with_error(request_ids, message, 408, reason)
            self.client.abort(request_ids)

    def _end_with_error(self, request_ids: list[str], message: str, status: int, reason: str) -> None:
        """Forget ``request_ids`` here (not in the core) and send each stream an error delta."""
        deliveries: list[Delivery] = []
        with self._lock:
            for request_id in request_ids:
                stream = self._streams.pop(request_id, None)
                state = self.outputs.abort(request_id, reason)
                text = f"{message} (request {request_id})"
                deliveries += _ended_with_error(stream, state, self.observer, text, status, reason)
        for queue, delta in deliveries:
            queue.put_nowait(delta)

    async def drain(self, timeout: float, busy: Callable[[], bool] = lambda: False) -> None:
        """Refuse requests that arrive from now on, wait up to ``timeout`` seconds (less if :meth:`hurry` is
        called) for the running ones and while ``busy()`` (the server's requests not yet submitted), end the
        rest with a 503 error delta; then refuse every request."""
        self.admission.begin_drain(timeout)
        while (self.outputs.requests or busy()) and self.admission.draining() and not self.dead:
            await asyncio.sleep(0.05)
        self.admission.close()
        remaining = list(self.outputs.requests)
        if remaining:
            assert self.admission.drain_began is not None
            waited = time.monotonic() - self.admission.drain_began  # a second Ctrl-C ends the wait early: the true time
            logger.warning("shutdown: %d requests still running after %.1f s; ending them", len(remaining), waited)
            self._end_with_error(remaining, "the server is shutting down", 503, "shutdown")
            if not self.dead:
                self.client.abort(remaining)

    def hurry(self) -> None:
        """End a drain in progress now (a second Ctrl-C)."""
        self.admission.hurry()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the core process: it finishes its step (and its KV connector's saves) within ``timeout``
        seconds, else it is killed; default: 1 s, 60 s with a KV connector. Idempotent."""
        if self._stopping:
            return
        no_connector = self.config.use.kv_connector == "none"
        if timeout is None:
            timeout = 1.0 if no_connector else 60.0
        self._stopping = True
        self.admission.close()
        self._tokenizer_threads.shutdown(wait=False, cancel_futures=True)
        for task in self._tasks:
            task.cancel()
        # The reader keeps draining the core's last messages until it exits (a core can't close its
        # socket while messages it sent wait to be read). Without a KV connector a kill loses nothing:
        # the core was finishing a step or exiting.
        self.client.shut_down(timeout, quiet=no_connector)
        self._reader_done = True
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.client.close()
        self.frontend.close()

    # Outputs, on the reader thread.

    def _read_outputs(self) -> None:
        assert self._loop is not None
        loop = self._loop
        while not self._reader_done:
            messages = self.client.get_outputs(0.1)
            if not messages:
                continue
            self.health.heard()
            try:
                deliveries, stopped = self._handle(messages)
            except Exception:
                logger.exception("could not process the engine core's outputs")
                continue
            if deliveries or stopped:
                try:
                    loop.call_soon_threadsafe(self._deliver, deliveries, stopped)
                except RuntimeError:  # the loop is closed: the server is gone
                    return

    def _deliver(self, deliveries: list[Delivery], stopped: list[str]) -> None:
        if stopped and not self.dead:
            self.client.abort(stopped)
        for queue, delta in deliveries:
            queue.put_nowait(delta)

    def _handle(self, messages: list[StepOutputs]) -> tuple[list[Delivery], list[str]]:
        """Apply the core's messages; returns the deltas to hand out and the requests that hit a stop string (one
        delta per request: its tokens of several steps go out as one chunk)."""
        deliveries: list[Delivery] = []
        all_stopped: list[str] = []
        with self._lock:
            advanced: dict[str, RequestOutputState] = {}
            for message in (message for message in messages if not message.heartbeat):  # a long step's: heard
                self.stats = message.stats
                self.health.stuck = message.stuck
                step = self.outputs.apply(message)
                deliveries += _step_errors(step, self._streams, self.observer, message.stuck is not None)
                all_stopped += step.stopped
                for state in step.advanced:
                    advanced[state.request_id] = state
            for state in advanced.values():
                try:
                    delivery = _publish(state, self._streams, self.observer)
                except Exception:
                    logger.exception("could not publish progress of request %s", state.request_id)
                    continue
                if delivery is not None:
                    deliveries.append(delivery)
        return deliveries, all_stopped

    def _fail_all(self, message: str, status: int, reason: str) -> None:
        with self._lock:
            ids = list(self._streams)
        self._end_with_error(ids, message, status, reason)


def _publish(state: RequestOutputState, streams: dict[str, OutputStream], observer: Any) -> Delivery | None:
    """The delta of ``state``'s progress for its stream (None: it has none, or nothing to send); a finished request
    leaves ``streams``."""
    stream = streams.get(state.request_id)
    if stream is None:
        return None
    delta = stream.publish(state, observer)
    if state.finished:
        streams.pop(state.request_id, None)
    return None if delta is None else (stream.queue, delta)


def _expired(
    streams: dict[str, OutputStream], now: float, request_timeout: float | None, write_timeout: float
) -> list[tuple[list[str], str, str]]:
    """The requests to stop, in groups with their message and failure reason: past their ``server.request_timeout``
    deadline, or whose client left their output unread for ``write_timeout`` (it stopped reading: what the server
    buffers for it stays bounded)."""
    overdue = [id_ for id_, stream in streams.items() if stream.deadline is not None and now > stream.deadline]
    unread = [
        id_
        for id_, stream in streams.items()
        if isinstance(stream.queue, DeltaQueue) and stream.queue.unread_for(now) > write_timeout and id_ not in overdue
    ]
    expired = []
    if overdue:
        message = f"the request took longer than server.request_timeout ({request_timeout:g} s) and was stopped"
        expired.append((overdue, f"{message}; ask for fewer tokens or raise the limit", "timeout"))
    if unread:
        message = f"its client left the output unread for server.write_timeout ({write_timeout:g} s)"
        expired.append((unread, f"{message}; the request was stopped", "write_timeout"))
    return expired


def _step_errors(step: StepResult, streams: dict[str, OutputStream], observer: Any, stuck: bool) -> list[Delivery]:
    """The error deltas of the requests the core refused (400) or failed (500) in ``step``, which leave
    ``streams`` (``stuck``: the core's watchdog failed them, a step outlived ``engine.step_timeout``)."""
    deliveries: list[Delivery] = []
    failed_reason = "step_timeout" if stuck else "engine_error"
    for errors, status, reason in ((step.refused, 400, "rejected"), (step.failed, 500, failed_reason)):
        for request_id, error in errors.items():
            stream = streams.pop(request_id, None)
            text = error if status == 400 else f"internal error in request {request_id}: {error}"
            deliveries += _ended_with_error(stream, step.ended.get(request_id), observer, text, status, reason)
    return deliveries


def _ended_with_error(
    stream: OutputStream | None,
    state: RequestOutputState | None,
    observer: Any,
    text: str,
    status: int,
    reason: str,
) -> list[Delivery]:
    """A request ended with an error: the error delta (``text``, HTTP ``status``) for its stream (none: it has
    none), and the observer told that it finished (``state``; None: nothing to tell) and failed for ``reason``."""
    deliveries = [] if stream is None else [(stream.queue, stream.error_delta(text, status))]
    if state is not None and observer is not None:
        observer.finished(state)
        observer.failed(reason)
    return deliveries
