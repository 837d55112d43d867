"""The API process's engine: the engine core in its own process, fed and drained from asyncio.

:class:`AsyncEngine` starts the core (:mod:`weft.engine.core_process`), sends
it tokenized requests and aborts over ZMQ, and turns the token ids it streams
back into text with the output processor, on the event loop. Each request's
progress goes to the submitting coroutine's ``asyncio.Queue`` as :class:`Delta`
items. HTTP, tokenization and detokenization share this process; the
scheduler and the model run in the core's, so neither waits on the other's GIL.

If the core process dies, every open request ends with a 503 error delta, new
requests are refused, and ``on_core_death`` is called (``weft serve`` exits
non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
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
from weft.engine.engine_core import CoreStats
from weft.engine.frontend import Frontend
from weft.engine.output_processor import OutputProcessor, RequestOutputState
from weft.outputs import Logprob
from weft.plugins import PluginRegistry
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


class _Subscriber(msgspec.Struct):
    queue: asyncio.Queue
    index: int
    published_tokens: int = 0
    published_chars: int = 0
    observed_tokens: int = 0
    """Tokens the observer (metrics) has seen."""
    last_token_time: float = 0.0


class AsyncEngine:
    """Starts the engine core process; call :meth:`start` on the event loop before submitting."""

    def __init__(self, config: WeftConfig, registry: PluginRegistry | None = None, max_queued_requests: int = 1024,
                 startup_timeout: float = 3600.0) -> None:
        self.config = config
        self.registry = registry or PluginRegistry()
        self.frontend = Frontend(config, self.registry)
        self.tokenizer = self.frontend.tokenizer
        self.model_name = self.frontend.model_name
        self.max_model_len = self.frontend.max_model_len
        self.max_queued_requests = max_queued_requests
        self.observer: Any = None
        """Optional object with ``first_token(seconds)``, ``inter_token(seconds)``, ``finished(state)``."""
        self.on_core_death: Callable[[], None] | None = None
        self.outputs = OutputProcessor(self.tokenizer)
        self.stats = CoreStats()
        self._subscribers: dict[str, _Subscriber] = {}
        self._accepting = True
        self.dead = False
        self.death_reason = ""
        """Why the core stopped, when it said (its workers failed)."""
        self._stopping = False
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
        """Start reading the core's outputs and watching the process (on the serving event loop)."""
        self._tasks = [asyncio.create_task(self._read_outputs()), asyncio.create_task(self._watch_core())]

    async def _read_outputs(self) -> None:
        import zmq

        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        fd = self._output.getsockopt(zmq.FD)
        loop.add_reader(fd, readable.set)
        try:
            while True:
                # Everything that arrived, then one delta per request: when this process falls behind
                # the core, a request's tokens of several steps go out as one chunk.
                advanced: dict[str, RequestOutputState] = {}
                while self._output.poll(0):
                    message = self._decoder.decode(self._output.recv())
                    if isinstance(message, StepOutputs):
                        for state in self._handle(message):
                            advanced[state.request_id] = state
                    elif isinstance(message, Failed):
                        self.death_reason = message.message
                for state in advanced.values():
                    try:
                        self._publish(state)
                    except Exception:
                        logger.exception("could not publish progress of request %s", state.request_id)
                readable.clear()
                if self._output.poll(0):
                    continue
                await readable.wait()
        finally:
            loop.remove_reader(fd)

    async def _watch_core(self) -> None:
        while self.process.is_alive() or self._stopping:
            if self._stopping:
                return
            await asyncio.sleep(0.2)
        self._core_died()

    def _core_died(self) -> None:
        self.dead = True
        self._accepting = False
        reason = f": {self.death_reason}" if self.death_reason else ""
        message = f"the engine core process died (exit code {self.process.exitcode}){reason}; the server is shutting down"
        logger.error(message)
        self._fail_all(message, 503)
        if self.on_core_death is not None:
            self.on_core_death()

    # Called from the event loop.

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams, int]], output: asyncio.Queue) -> None:
        """Queue ``(request_id, prompt_token_ids, params, index)`` requests, all or none, deltas to ``output``.

        Raises ValueError (a bad request), QueueFullError or ShuttingDownError.
        """
        if not self._accepting:
            raise ShuttingDownError("the server is shutting down" if not self.dead else "the engine core is gone")
        if self.stats.waiting + len(requests) > self.max_queued_requests:
            raise QueueFullError(f"{self.stats.waiting} requests are already waiting")
        core_requests = [self.frontend.core_request(request_id, prompt, params) for request_id, prompt, params, _ in requests]
        now = time.monotonic()
        for (request_id, _, params, index), core_request in zip(requests, core_requests):
            self.outputs.add(request_id, core_request.prompt_token_ids, params)
            self._subscribers[request_id] = _Subscriber(output, index, last_token_time=now)
        self.stats.waiting += len(requests)
        if not self._send(AddRequests(core_requests)):
            for request_id, *_ in requests:
                self._subscribers.pop(request_id, None)
                self.outputs.abort(request_id)
            raise ShuttingDownError("the engine core is gone")

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (safe to call for finished or unknown ids)."""
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
        return self._accepting

    @property
    def has_unfinished(self) -> bool:
        return bool(self.outputs.requests)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, wait up to ``timeout`` seconds for running ones, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self.outputs.requests and time.monotonic() < deadline and not self.dead:
            await asyncio.sleep(0.05)
        for request_id in list(self.outputs.requests):
            subscriber = self._subscribers.get(request_id)
            self.abort(request_id)
            if subscriber is not None:
                subscriber.queue.put_nowait(self._error_delta(subscriber, "the server is shutting down", 503))
        self.stop()

    def stop(self) -> None:
        """Stop the core process (it finishes its KV connector's saves first). Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._accepting = False
        for task in self._tasks:
            task.cancel()
        if self.process.is_alive():
            self._send(Shutdown())
            self.process.join(timeout=60)
            if self.process.is_alive():
                logger.warning("the engine core did not stop within 60 s; killing it")
                self.process.kill()
                self.process.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._folder, ignore_errors=True)

    # Outputs.

    def _handle(self, message: StepOutputs) -> list[RequestOutputState]:
        """Apply one message of the core; returns the requests that advanced."""
        self.stats = message.stats
        for errors, status in ((message.refused, 400), (message.failed, 500)):
            for request_id, error in errors.items():
                subscriber = self._subscribers.pop(request_id, None)
                state = self.outputs.abort(request_id)
                if subscriber is not None:
                    subscriber.queue.put_nowait(self._error_delta(subscriber, error, status))
                if state is not None and self.observer is not None:
                    self.observer.finished(state)
        advanced, stopped = self.outputs.process(message.outputs)
        if stopped:
            self._send(Abort(stopped))
        return advanced

    def _publish(self, state: RequestOutputState) -> None:
        subscriber = self._subscribers.get(state.request_id)
        if subscriber is None:
            return
        generated = len(state.output_token_ids)
        if self.observer is not None and generated > subscriber.observed_tokens:
            now = time.monotonic()
            if subscriber.observed_tokens == 0:
                self.observer.first_token(now - state.arrival_time)
            else:
                self.observer.inter_token(now - subscriber.last_token_time)
            subscriber.observed_tokens, subscriber.last_token_time = generated, now
        # Hold back text that may be the start of a stop string until it is decided.
        holdback = max((len(stop) for stop in state.params.stop), default=1) - 1
        end = len(state.text) if state.finished else max(subscriber.published_chars, len(state.text) - holdback)
        if end == subscriber.published_chars and not state.finished and state.logprobs is None:
            return  # nothing a client sees yet: these tokens go out with the next delta that has text
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
        if state.finished:
            self._subscribers.pop(state.request_id, None)
            if self.observer is not None:
                self.observer.finished(state)
        subscriber.queue.put_nowait(delta)

    @staticmethod
    def _error_delta(subscriber: _Subscriber, message: str, status: int) -> Delta:
        return Delta(
            index=subscriber.index, token_ids=[], text="", logprobs=None, finish_reason="error", stop_reason=None,
            num_prompt_tokens=0, num_output_tokens=0, num_cached_tokens=0, error=message, error_status=status,
        )

    def _fail_all(self, message: str, status: int) -> None:
        for request_id, subscriber in list(self._subscribers.items()):
            self.outputs.abort(request_id)
            subscriber.queue.put_nowait(self._error_delta(subscriber, message, status))
        self._subscribers.clear()
