"""The engine on its own thread, fed and drained from asyncio.

:class:`AsyncEngine` owns an :class:`~weft.engine.llm_engine.LLMEngine`; only its
thread touches it. Coroutines submit requests and aborts as commands; the
thread steps the engine and hands each request's progress back to the
submitting event loop as :class:`Delta` items on an ``asyncio.Queue``. The
event loop therefore never waits on model compute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from weft.engine.llm_engine import LLMEngine
from weft.engine.request import Request
from weft.outputs import Logprob
from weft.sampling_params import SamplingParams

logger = logging.getLogger("weft.engine")


class QueueFullError(Exception):
    """Too many requests are waiting; retry later."""


class ShuttingDownError(Exception):
    """The engine is draining and takes no new requests."""


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


class _Subscriber(msgspec.Struct):
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    published_tokens: int = 0
    published_chars: int = 0
    last_token_time: float = 0.0


class AsyncEngine:
    """Runs an LLMEngine on a dedicated thread for asyncio callers."""

    def __init__(self, engine: LLMEngine, max_queued_requests: int = 1024, observer: Any = None) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.observer = observer
        """Optional object with ``first_token(seconds)``, ``inter_token(seconds)``, ``finished(request)``."""
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._subscribers: dict[str, _Subscriber] = {}
        self._accepting = True
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weft-engine", daemon=True)
        self._thread.start()

    # Called from the event loop.

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams, int]], output: asyncio.Queue) -> None:
        """Queue ``(request_id, prompt_token_ids, params, index)`` requests, all or none, deltas to ``output``.

        Raises ValueError (a bad request), QueueFullError or ShuttingDownError. If
        the caller is cancelled meanwhile, it must :meth:`abort` the ids it gave.
        """
        loop = asyncio.get_running_loop()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def add() -> None:
            added: list[str] = []
            try:
                if not self._accepting:
                    raise ShuttingDownError("the server is shutting down")
                if len(self.engine.scheduler.waiting) + len(requests) > self.max_queued_requests:
                    raise QueueFullError(f"{len(self.engine.scheduler.waiting)} requests are already waiting")
                for request_id, prompt_token_ids, params, index in requests:
                    self.engine.add_request(request_id, prompt_token_ids, params)
                    added.append(request_id)
                    self._subscribers[request_id] = _Subscriber(loop, output, index, last_token_time=time.monotonic())
            except Exception as error:
                for request_id in added:
                    self._subscribers.pop(request_id, None)
                    self.engine.abort(request_id)
                done.set_exception(error)
            else:
                done.set_result(None)

        self._command(add)
        await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (safe to call for finished or unknown ids)."""

        def abort() -> None:
            self._subscribers.pop(request_id, None)
            request = self.engine.requests.get(request_id)
            self.engine.abort(request_id)
            if request is not None and self.observer is not None:
                self.observer.finished(request)

        self._command(abort)

    def call(self, function: Callable[[LLMEngine], Any]) -> concurrent.futures.Future[Any]:
        """Run ``function(engine)`` on the engine thread; its result comes back as a future."""
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                result.set_result(function(self.engine))
            except Exception as error:
                result.set_exception(error)

        self._command(run)
        return result

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, wait up to ``timeout`` seconds for running ones, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and await asyncio.wrap_future(self.call(lambda e: e.has_unfinished)):
            await asyncio.sleep(0.05)
        self.stop()

    def stop(self) -> None:
        def abort_all() -> None:
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)
            self._subscribers.clear()
            self._stopped.set()

        self._command(abort_all)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.engine.close()

    @property
    def accepting(self) -> bool:
        return self._accepting

    def _command(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # The engine thread.

    def _run(self) -> None:
        while not self._stopped.is_set():
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    command()
                except Exception:
                    logger.exception("engine command failed")
            if self._stopped.is_set():
                return
            if not self.engine.has_unfinished:
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                advanced = self.engine.step()
            except Exception as error:
                logger.exception("engine step failed; failing its requests")
                self._fail_all(f"internal error: {type(error).__name__}: {error}")
                continue
            for request in advanced:
                try:
                    self._publish(request)
                except Exception:
                    logger.exception("could not publish progress of request %s", request.request_id)

    def _publish(self, request: Request) -> None:
        subscriber = self._subscribers.get(request.request_id)
        if subscriber is None:
            return
        now = time.monotonic()
        if self.observer is not None:
            if subscriber.published_tokens == 0:
                self.observer.first_token(now - request.arrival_time)
            else:
                self.observer.inter_token(now - subscriber.last_token_time)
        subscriber.last_token_time = now
        tokens = request.output_token_ids[subscriber.published_tokens :]
        logprobs = request.logprobs[subscriber.published_tokens :] if request.logprobs is not None else None
        # Hold back text that may be the start of a stop string until it is decided.
        holdback = max((len(stop) for stop in request.params.stop), default=1) - 1
        end = len(request.text) if request.finished else max(subscriber.published_chars, len(request.text) - holdback)
        text = request.text[subscriber.published_chars : end]
        subscriber.published_tokens = len(request.output_token_ids)
        subscriber.published_chars = end
        delta = Delta(
            index=subscriber.index, token_ids=list(tokens), text=text, logprobs=logprobs,
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=len(request.output_token_ids),
            num_cached_tokens=request.num_cached_tokens,
        )
        if request.finished:
            self._subscribers.pop(request.request_id, None)
            if self.observer is not None:
                self.observer.finished(request)
        subscriber.loop.call_soon_threadsafe(subscriber.queue.put_nowait, delta)

    def _fail_all(self, message: str) -> None:
        for request_id, subscriber in list(self._subscribers.items()):
            self.engine.abort(request_id)
            failure = Delta(
                index=subscriber.index, token_ids=[], text="", logprobs=None, finish_reason="error", stop_reason=None,
                num_prompt_tokens=0, num_output_tokens=0, num_cached_tokens=0, error=message,
            )
            subscriber.loop.call_soon_threadsafe(subscriber.queue.put_nowait, failure)
        self._subscribers.clear()
