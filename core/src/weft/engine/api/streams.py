"""One request's stream of deltas: what its submitter has seen, and the next :class:`Delta` to hand it.

:class:`~weft.engine.api.async_engine.AsyncEngine` keeps an :class:`OutputStream` per engine
request, on the queue of the coroutine that submitted it. A delta carries the tokens and the
text produced since the last one; text that may still be the start of a stop string is held
back until it is decided (:attr:`~weft.engine.api.output_processor.RequestOutputState.settled_length`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import msgspec

from weft.outputs import NO_TOKEN_ALLOWED, Logprob

if TYPE_CHECKING:
    from weft.engine.api.output_processor import RequestOutputState


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


class DeltaQueue(asyncio.Queue):
    """The deltas of one API call's requests, in the order produced, and since when its reader is behind: the
    time of the last read, or of the put that found the queue empty, whichever is later (``server.write_timeout``
    counts from there while deltas wait)."""

    def __init__(self) -> None:
        super().__init__()
        self.behind_since = time.monotonic()

    def put_nowait(self, item: Any) -> None:
        if self.empty():
            self.behind_since = time.monotonic()
        super().put_nowait(item)

    def get_nowait(self) -> Any:  # asyncio.Queue.get ends in it
        item = super().get_nowait()
        self.behind_since = time.monotonic()
        return item

    def unread_for(self, now: float) -> float:
        """Seconds deltas have waited with no read (0 when none waits)."""
        return 0.0 if self.empty() else now - self.behind_since


class OutputStream(msgspec.Struct):
    """Where one engine request's deltas go, and what of it was published."""

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

    def error_delta(self, message: str, status: int) -> Delta:
        return Delta(
            index=self.index,
            token_ids=[],
            text="",
            logprobs=None,
            finish_reason="error",
            stop_reason=None,
            num_prompt_tokens=0,
            num_output_tokens=0,
            num_cached_tokens=0,
            error=message,
            error_status=status,
        )

    def publish(self, state: RequestOutputState, observer: Any) -> Delta | None:
        """The next delta of ``state`` (None: a client would see nothing yet, its tokens go out with the next delta
        that has text), telling ``observer`` (metrics, or None) of its tokens and its end. A request the core failed
        (finish reason ``error``) gets an error delta: a 400 when its own parameters were the cause, else a 500."""
        if state.finish_reason == "error":
            client_error = state.error == NO_TOKEN_ALLOWED
            if observer is not None:
                observer.finished(state)
                observer.failed("bad_request" if client_error else "engine_error")
            if client_error:
                return self.error_delta(f"request {state.request_id}: {state.error}", 400)
            message = f"internal error in request {state.request_id}: {state.error}; the other requests go on"
            return self.error_delta(message, 500)
        if observer is not None:
            self._observe(state, observer)
        delta = self.next_delta(state)
        if delta is not None and state.finished and observer is not None:
            observer.finished(state)
        return delta

    def _observe(self, state: RequestOutputState, observer: Any) -> None:
        """Tell ``observer`` of the request's first token or the time since its last one."""
        generated = len(state.output_token_ids)
        if generated <= self.observed_tokens:
            return
        now = time.monotonic()
        if self.observed_tokens == 0:
            observer.first_token(now - state.arrival_time, state.queued_seconds)
        else:
            observer.inter_token(now - self.last_token_time)
        self.observed_tokens, self.last_token_time = generated, now

    def next_delta(self, state: RequestOutputState) -> Delta | None:
        """What the request produced since the last delta; None when a client would see nothing yet (its tokens
        go out with the next delta that has text)."""
        generated = len(state.output_token_ids)
        end = state.settled_length if state.finished else max(self.published_chars, state.settled_length)
        if end == self.published_chars and not state.finished and state.logprobs is None:
            return None
        tokens = state.output_token_ids[self.published_tokens :]
        logprobs = state.logprobs[self.published_tokens :] if state.logprobs is not None else None
        text = state.text[self.published_chars : end]
        self.published_tokens = generated
        self.published_chars = end
        delta = Delta(
            index=self.index,
            token_ids=list(tokens),
            text=text,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            num_prompt_tokens=state.num_prompt_tokens,
            num_output_tokens=generated,
            num_cached_tokens=state.num_cached_tokens,
        )
        if state.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            delta.prompt_logprobs, self.sent_prompt_logprobs = state.prompt_logprobs, True
        return delta
