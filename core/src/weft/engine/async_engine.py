"""The API process's engine: the engine core in its own process, fed and drained from asyncio.

:class:`AsyncEngine` starts the core (:mod:`weft.engine.core_process`) and sends
it tokenized requests and aborts over ZMQ from the event loop. Work on a request's text (templating,
tokenizing, checking it against the model) runs on a bounded pool of tokenizer threads
(:meth:`AsyncEngine.off_loop`), never on the event loop. A reader thread
receives what the core streams back and turns token ids into text with the
output processor (detokenization and stop strings stay off the event loop);
each request's progress goes to the submitting coroutine's ``asyncio.Queue`` as
:class:`Delta` items, handed over with ``call_soon_threadsafe``. A lock guards
the request tables the loop and the reader share. The scheduler and the model
run in the core's process, so neither waits on the other's GIL.

A request ends with an error delta (``error`` and an HTTP status) when the core
refuses it (400) or fails it (500: non-finite logits, a step that failed twice),
when it outlives ``request_timeout`` counted from its arrival (408: it is aborted, its KV blocks
freed), when a drain gives up on it (503), or when the core process dies (503: new
requests are refused and ``on_core_death`` is called; ``weft serve`` exits non-zero).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from weft.config import WeftConfig
from weft.engine.core_process import (
    Abort,
    AddRequests,
    Failed,
    FromCore,
    Ready,
    Shutdown,
    StepOutputs,
    run_engine_core,
)
from weft.engine.engine_core import CoreStats, GrammarStart
from weft.engine.frontend import Frontend
from weft.engine.output_processor import OutputProcessor, RequestOutputState
from weft.outputs import NO_TOKEN_ALLOWED, Logprob
from weft.plugins import PluginRegistry
from weft.plugins.lock import verify_plugin_lock
from weft.sampling_params import SamplingParams

logger = logging.getLogger("weft.engine")


class QueueFullError(Exception):
    """Too many requests are waiting; retry later."""


class ShuttingDownError(Exception):
    """The engine is draining (or its core is gone) and takes no new requests."""


class CoreStartError(RuntimeError):
    """The engine core process could not build the engine."""


class Delta(msgspec.Struct):
    """What one request produced since the last delta."""

    index: int
    """The choice this request serves (``n > 1`` runs one engine request per choice)."""
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    error_status: int = 500
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """In the first delta of a request that asked for prompt logprobs."""


class _Subscriber(msgspec.Struct):
    queue: asyncio.Queue
    index: int
    published_tokens: int = 0
    published_chars: int = 0
    observed_tokens: int = 0
    """Tokens the observer (metrics) has seen."""
    sent_prompt_logprobs: bool = False
    last_token_time: float = 0.0
    deadline: float | None = None
    """``time.monotonic()`` after which the request is aborted (``request_timeout``)."""


Delivery = tuple[asyncio.Queue, Delta]


class AsyncEngine:
    """Starts the engine core process; call :meth:`start` on the event loop before submitting."""

    def __init__(self, config: WeftConfig, registry: PluginRegistry | None = None, max_queued_requests: int = 1024,
                 startup_timeout: float = 3600.0, request_timeout: float | None = None, tokenizer_threads: int = 4) -> None:
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
        self._subscribers: dict[str, _Subscriber] = {}
        self._lock = threading.Lock()
        """Guards ``outputs`` and ``_subscribers``, shared by the event loop and the reader thread."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._tokenizer_threads = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="weft-tokenizer")
        self._accepting = True
        """False once a drain is over, or the engine stops or its core died: nothing is admitted."""
        self._drain_began: float | None = None
        """``time.monotonic()`` when a drain began: requests that arrive later are refused."""
        self._preparing = 0
        """Requests :meth:`submit` is checking on a tokenizer thread: they count as waiting."""
        self.dead = False
        self.death_reason = ""
        """Why the core stopped, when it said (its workers failed)."""
        self._stopping = False
        self._reader_done = False
        self._drain_deadline: float | None = None
        self._tasks: list[asyncio.Task] = []
        self._start_core(startup_timeout)

    # The core process.

    def _start_core(self, timeout: float) -> None:
        import zmq

        self._folder = tempfile.mkdtemp(prefix="weft-core-")
        input_address = f"ipc://{self._folder}/input"
        output_address = f"ipc://{self._folder}/output"
        self._zmq = zmq.Context()
        self._input = self._zmq.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(input_address)
        self._output = self._zmq.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=run_engine_core, args=(self.config, input_address, output_address, os.getpid()),
            name="weft-engine-core", daemon=True,
        )
        self.process.start()
        deadline = time.monotonic() + timeout
        while not self._output.poll(200):
            if not self.process.is_alive():
                self._close_sockets()
                raise CoreStartError(f"the engine core process exited with code {self.process.exitcode} while starting")
            if time.monotonic() > deadline:
                self.process.kill()
                self._close_sockets()
                raise CoreStartError(f"the engine core did not start within {timeout:.0f} s")
        message = self._decoder.decode(self._output.recv())
        if isinstance(message, Failed):
            self.process.join(timeout=10)
            self._close_sockets()
            logger.debug("the engine core's traceback:\n%s", message.traceback)
            raise CoreStartError(f"the engine core could not start: {message.message}")
        assert isinstance(message, Ready)
        self.engine_settings = message.engine
        logger.info("engine core process %d ready: %s", self.process.pid, message.engine)

    async def start(self) -> None:
        """Start the reader thread and the watcher of the core process and deadlines (on the serving loop)."""
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read_outputs, name="weft-engine-outputs", daemon=True)
        self._reader.start()
        self._tasks = [asyncio.create_task(self._watch())]

    async def _watch(self) -> None:
        while self.process.is_alive() or self._stopping:
            if self._stopping:
                return
            self._expire_overdue()
            await asyncio.sleep(0.2)
        self._core_died()

    def _core_died(self) -> None:
        self.dead = True
        self._accepting = False
        reason = f": {self.death_reason}" if self.death_reason else ""
        message = f"the engine core process died (exit code {self.process.exitcode}){reason}; the server is shutting down"
        logger.error(message)
        self._fail_all(message, 503, "engine_dead")
        if self.on_core_death is not None:
            self.on_core_death()

    # Called from the event loop.

    async def off_loop(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` on a tokenizer thread (``server.tokenizer_threads`` of them, shared by every
        request). A caller that is cancelled stops waiting, and its call is dropped if it has not started. They
        are not the event loop's default executor, which a shutdown waits for."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_threads, functools.partial(function, *args))

    def refusal(self, arrival: float) -> str | None:
        """Why a request that arrived at ``arrival`` (``time.monotonic()``) may not be submitted now, or None:
        the core died, the engine stopped, or a drain began before the request arrived."""
        if self.dead:
            return "the engine core process died"
        if not self._accepting or (self._drain_began is not None and arrival >= self._drain_began):
            return "the server is shutting down"
        return None

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams, int]], output: asyncio.Queue,
                     kv_transfer_params: dict[str, Any] | None = None, grammar_start: GrammarStart | None = None,
                     arrival: float | None = None) -> None:
        """Queue ``(request_id, prompt_token_ids, params, index)`` requests, all or none, deltas to ``output``
        (``kv_transfer_params``: for the KV connector, one request only; ``grammar_start``: see
        :meth:`weft.engine.frontend.Frontend.core_request`). The requests are the sequences of one API request
        (their params differ in their seed at most), checked on a tokenizer thread. ``arrival``: when the API
        request arrived (``time.monotonic()``; default now): ``request_timeout`` counts from it, and a drain admits
        a request that arrived before it began.

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
                self.frontend.core_requests, [(request_id, prompt, params) for request_id, prompt, params, _ in requests],
                kv_transfer_params, grammar_start,
            )
        finally:
            self._preparing -= len(requests)
        if (refusal := self.refusal(arrival)) is not None:  # the drain ended (or the core died) meanwhile
            raise ShuttingDownError(refusal)
        now = time.monotonic()
        deadline = None if self.request_timeout is None else arrival + self.request_timeout
        with self._lock:
            for (request_id, _, params, index), core_request in zip(requests, core_requests):
                self.outputs.add(request_id, core_request.prompt_token_ids, params)
                self._subscribers[request_id] = _Subscriber(output, index, last_token_time=now, deadline=deadline)
        self.stats.waiting += len(requests)
        if not self._send(AddRequests(core_requests)):
            with self._lock:
                for request_id, *_ in requests:
                    self._subscribers.pop(request_id, None)
                    self.outputs.abort(request_id)
            raise ShuttingDownError("the engine core process died")

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (safe to call for finished or unknown ids)."""
        with self._lock:
            self._subscribers.pop(request_id, None)
            state = self.outputs.abort(request_id)
        if state is None:
            return
        if self.observer is not None:
            self.observer.finished(state)
        if not self.dead:
            self._send(Abort([request_id]))

    def _send(self, message: Any) -> bool:
        """Send to the core without ever blocking the event loop; False when no core is connected (it died)."""
        import zmq

        try:
            self._input.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:  # a PUSH socket without a peer: the core is gone (the watcher reports it)
            return False
        return True

    @property
    def accepting(self) -> bool:
        """Whether a request arriving now is admitted (False while draining, after, and once the core died)."""
        return self.refusal(time.monotonic()) is None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.outputs.requests)

    def _expire_overdue(self) -> None:
        """Abort requests past their deadline; each gets a 408 error delta."""
        now = time.monotonic()
        with self._lock:
            overdue = [request_id for request_id, subscriber in self._subscribers.items()
                       if subscriber.deadline is not None and now > subscriber.deadline]
        if not overdue:
            return
        message = (f"the request took longer than server.request_timeout ({self.request_timeout:g} s) and was stopped; "
                   f"ask for fewer tokens or raise the limit")
        self._end_with_error(overdue, message, 408, "timeout")
        self._send(Abort(overdue))

    def _end_with_error(self, request_ids: list[str], message: str, status: int, reason: str) -> None:
        """Forget ``request_ids`` here (not in the core) and send each subscriber an error delta."""
        deliveries: list[Delivery] = []
        with self._lock:
            for request_id in request_ids:
                subscriber = self._subscribers.pop(request_id, None)
                state = self.outputs.abort(request_id, reason)
                if subscriber is not None:
                    deliveries.append((subscriber.queue, self._error_delta(subscriber, f"{message} (request {request_id})", status)))
                if state is not None and self.observer is not None:
                    self.observer.finished(state)
                    self.observer.failed(reason)
        for queue, delta in deliveries:
            queue.put_nowait(delta)

    async def drain(self, timeout: float, busy: Callable[[], bool] = lambda: False) -> None:
        """Refuse requests that arrive from now on, wait up to ``timeout`` seconds (less if :meth:`hurry` is
        called) for the running ones and while ``busy()`` (the server's requests not yet submitted), end the
        rest with a 503 error delta; then refuse every request."""
        if self._drain_began is None:
            self._drain_began = time.monotonic()
        self._drain_deadline = time.monotonic() + timeout
        while (self.outputs.requests or busy()) and time.monotonic() < self._drain_deadline and not self.dead:
            await asyncio.sleep(0.05)
        self._accepting = False
        remaining = list(self.outputs.requests)
        if remaining:
            waited = time.monotonic() - self._drain_began  # a second Ctrl-C ends the wait early: the true time
            logger.warning("shutdown: %d requests still running after %.1f s; ending them", len(remaining), waited)
            self._end_with_error(remaining, "the server is shutting down", 503, "shutdown")
            if not self.dead:
                self._send(Abort(remaining))

    def hurry(self) -> None:
        """End a drain in progress now (a second Ctrl-C)."""
        self._drain_deadline = time.monotonic()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the core process: it finishes its step (and its KV connector's saves) within ``timeout``
        seconds, else it is killed; default: 1 s, 60 s with a KV connector. Idempotent."""
        if self._stopping:
            return
        if timeout is None:
            timeout = 1.0 if self.config.use.kv_connector == "none" else 60.0
        self._stopping = True
        self._accepting = False
        self._tokenizer_threads.shutdown(wait=False, cancel_futures=True)
        for task in self._tasks:
            task.cancel()
        # The reader keeps draining the core's last messages until it exits (a core can't close its
        # socket while messages it sent wait to be read).
        if self.process.is_alive():
            self._send(Shutdown())
            self.process.join(timeout=timeout)
            if self.process.is_alive():
                # Without a KV connector nothing is lost: it was finishing a step or exiting.
                log = logger.info if self.config.use.kv_connector == "none" else logger.warning
                log("the engine core did not stop within %g s; killing it", timeout)
                self.process.kill()
                self.process.join(timeout=5)
        self._reader_done = True
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._folder, ignore_errors=True)

    # Outputs, on the reader thread.

    def _read_outputs(self) -> None:
        assert self._loop is not None
        loop = self._loop
        while not self._reader_done:
            if not self._output.poll(100):
                continue
            # Everything that arrived, then one delta per request: when this process falls behind
            # the core, a request's tokens of several steps go out as one chunk.
            messages = []
            while self._output.poll(0):
                messages.append(self._decoder.decode(self._output.recv()))
            for message in messages:
                if isinstance(message, Failed):  # the core's last word: it stops because its workers are gone
                    self.death_reason = message.message
            try:
                deliveries, stopped = self._handle([message for message in messages if isinstance(message, StepOutputs)])
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
            self._send(Abort(stopped))
        for queue, delta in deliveries:
            queue.put_nowait(delta)

    def _handle(self, messages: list[StepOutputs]) -> tuple[list[Delivery], list[str]]:
        """Apply the core's messages; returns the deltas to hand out and the requests that hit a stop string."""
        deliveries: list[Delivery] = []
        all_stopped: list[str] = []
        with self._lock:
            advanced: dict[str, RequestOutputState] = {}
            for message in messages:
                self.stats = message.stats
                for errors, status, reason in ((message.refused, 400, "rejected"), (message.failed, 500, "engine_error")):
                    for request_id, error in errors.items():
                        subscriber = self._subscribers.pop(request_id, None)
                        state = self.outputs.abort(request_id, "error")
                        text = error if status == 400 else f"internal error in request {request_id}: {error}"
                        if subscriber is not None:
                            deliveries.append((subscriber.queue, self._error_delta(subscriber, text, status)))
                        if state is not None and self.observer is not None:
                            self.observer.finished(state)
                            self.observer.failed(reason)
                states, stopped = self.outputs.process(message.outputs)
                all_stopped += stopped
                for state in states:
                    advanced[state.request_id] = state
            for state in advanced.values():
                try:
                    delivery = self._publish(state)
                except Exception:
                    logger.exception("could not publish progress of request %s", state.request_id)
                    continue
                if delivery is not None:
                    deliveries.append(delivery)
        return deliveries, all_stopped

    def _publish(self, state: RequestOutputState) -> Delivery | None:
        subscriber = self._subscribers.get(state.request_id)
        if subscriber is None:
            return None
        if state.finish_reason == "error":
            self._subscribers.pop(state.request_id, None)
            client_error = state.error == NO_TOKEN_ALLOWED  # the request's own parameters
            if self.observer is not None:
                self.observer.finished(state)
                self.observer.failed("bad_request" if client_error else "engine_error")
            if client_error:
                return subscriber.queue, self._error_delta(subscriber, f"request {state.request_id}: {state.error}", 400)
            message = f"internal error in request {state.request_id}: {state.error}; the other requests go on"
            return subscriber.queue, self._error_delta(subscriber, message, 500)
        generated = len(state.output_token_ids)
        if self.observer is not None and generated > subscriber.observed_tokens:
            now = time.monotonic()
            if subscriber.observed_tokens == 0:
                self.observer.first_token(now - state.arrival_time, state.queued_seconds)
            else:
                self.observer.inter_token(now - subscriber.last_token_time)
            subscriber.observed_tokens, subscriber.last_token_time = generated, now
        # Hold back text that may be the start of a stop string until it is decided.
        holdback = max((len(stop) for stop in state.params.stop), default=1) - 1
        end = len(state.text) if state.finished else max(subscriber.published_chars, len(state.text) - holdback)
        if end == subscriber.published_chars and not state.finished and state.logprobs is None:
            return None  # nothing a client sees yet: these tokens go out with the next delta that has text
        tokens = state.output_token_ids[subscriber.published_tokens :]
        logprobs = state.logprobs[subscriber.published_tokens :] if state.logprobs is not None else None
        text = state.text[subscriber.published_chars : end]
        subscriber.published_tokens = generated
        subscriber.published_chars = end
        delta = Delta(
            index=subscriber.index, token_ids=list(tokens), text=text, logprobs=logprobs,
            finish_reason=state.finish_reason, stop_reason=state.stop_reason,
            num_prompt_tokens=state.num_prompt_tokens, num_output_tokens=generated,
            num_cached_tokens=state.num_cached_tokens,
        )
        if state.prompt_logprobs is not None and not subscriber.sent_prompt_logprobs:
            delta.prompt_logprobs, subscriber.sent_prompt_logprobs = state.prompt_logprobs, True
        if state.finished:
            self._subscribers.pop(state.request_id, None)
            if self.observer is not None:
                self.observer.finished(state)
        return subscriber.queue, delta

    @staticmethod
    def _error_delta(subscriber: _Subscriber, message: str, status: int) -> Delta:
        return Delta(
            index=subscriber.index, token_ids=[], text="", logprobs=None, finish_reason="error", stop_reason=None,
            num_prompt_tokens=0, num_output_tokens=0, num_cached_tokens=0, error=message, error_status=status,
        )

    def _fail_all(self, message: str, status: int, reason: str) -> None:
        with self._lock:
            ids = list(self._subscribers)
        self._end_with_error(ids, message, status, reason)
