"""Turns the engine core's token ids into what callers read: text, stop strings, decoded logprobs.

Runs beside the API (in the API server's process under ``weft serve``, in the
caller's process for ``LLM``), never in the engine core. Per request it keeps an
incremental detokenizer and the text so far. The core ends a request on EOS,
a stop token id or its length; stop *strings* are found here, and a request that
hit one is reported back so the caller aborts it in the core. Text that may be the
start of a stop string is held back from streaming until it is decided
(:attr:`RequestOutputState.settled_length`). :meth:`OutputProcessor.apply` takes one
:class:`~weft.engine.messages.StepOutputs` whole: the requests the core refused or
failed end here too.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

from weft.outputs import CompletionOutput, Logprob

if TYPE_CHECKING:
    from weft.contracts.executor import TokenLogprobs
    from weft.contracts.tokenizer import Tokenizer
    from weft.engine.messages import EngineCoreOutput, StepOutputs
    from weft.sampling_params import SamplingParams


class RequestOutputState:
    """One request as its caller sees it."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        stream_text: bool,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = tokenizer.detokenizer(prompt_token_ids, params.skip_special_tokens)
        self.output_token_ids: list[int] = []
        self.text = ""
        """Output text with stop strings removed (when the request stopped on one)."""
        self.defer_text = not stream_text and not params.stop
        """Detokenize once when the request finishes instead of token by token: nobody reads the
        text before then (``stream_text`` False) and no stop string needs it."""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        """Per prompt token (None for the first, which nothing predicts), once the core sent them."""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        """Why the core failed the request (finish reason ``error``)."""
        self.queued_seconds: float | None = None
        """Time from its arrival in the core to its first scheduling (known with its first token)."""
        self.num_cached_tokens = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self._holdback = max((len(stop) for stop in params.stop), default=1) - 1
        """Characters at the end of the text that may be the start of a stop string."""

    @property
    def settled_length(self) -> int:
        """Characters of :attr:`text` that are final: all of it once finished, else all but the end that may be
        the start of a stop string (held back from streaming until it is decided)."""
        return len(self.text) if self.finished else len(self.text) - self._holdback

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def completion(self, index: int) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
        )


class StepResult(NamedTuple):
    """What one :class:`~weft.engine.messages.StepOutputs` did to the requests (:meth:`OutputProcessor.apply`)."""

    advanced: list[RequestOutputState]
    """Requests that produced a token or finished."""
    stopped: list[str]
    """Requests that hit a stop string, finished here: the caller aborts them in the core."""
    refused: dict[str, str]
    """Requests the core would not take (a bad request), with the reason; gone from the core and from here."""
    failed: dict[str, str]
    """Requests a failed step ended (an internal error), with the reason; gone from the core and from here."""
    ended: dict[str, RequestOutputState]
    """The states of the refused and failed requests that were still here (finished with ``error``)."""


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestOutputState] = {}

    def add(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream_text: bool = True
    ) -> RequestOutputState:
        state = RequestOutputState(request_id, prompt_token_ids, params, self.tokenizer, stream_text)
        self.requests[request_id] = state
        return state

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutputState | None:
        """Forget a request; one still running finishes with ``reason`` (``abort``, ``timeout``, ``error``)."""
        state = self.requests.pop(request_id, None)
        if state is not None and not state.finished:
            state.finish_reason = reason
        return state

    def apply(self, message: StepOutputs) -> StepResult:
        """Apply one message of the core: its refused and failed requests end with ``error``, then its outputs."""
        ended: dict[str, RequestOutputState] = {}
        for request_id in (*message.refused, *message.failed):
            state = self.abort(request_id, "error")
            if state is not None:
                ended[request_id] = state
        advanced, stopped = self.process(message.outputs)
        return StepResult(advanced, stopped, message.refused, message.failed, ended)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutputState], list[str]]:
        """Apply the core's outputs; returns the requests that advanced, and those that hit a stop
        string (finished here: the caller aborts them in the core)."""
        advanced, stopped = [], []
        now = time.monotonic()
        for output in outputs:
            state = self.requests.get(output.request_id)
            if state is None:
                continue  # aborted meanwhile
            if output.error is not None:
                state.finish_reason, state.error = output.finish_reason or "error", output.error
                advanced.append(state)
                self.requests.pop(state.request_id, None)
                continue
            if state.first_token_time is None:
                state.first_token_time = now
            if output.queued_seconds is not None:
                state.queued_seconds = output.queued_seconds
            state.num_cached_tokens = output.num_cached_tokens
            if output.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = [None] + [
                    self._decoded(entry, token)
                    for entry, token in zip(output.prompt_logprobs, state.prompt_token_ids[1:], strict=False)
                ]
            for position in range(len(output.new_token_ids)):
                if self._append(state, output, position):
                    stopped.append(state.request_id)
                    break
            advanced.append(state)
            if state.finished:
                self.requests.pop(state.request_id, None)
        return advanced, stopped

    def _append(self, state: RequestOutputState, output: EngineCoreOutput, position: int) -> bool:
        """Add the output's token at ``position``; True when it completed a stop string."""
        token_id = output.new_token_ids[position]
        last = position == len(output.new_token_ids) - 1
        state.output_token_ids.append(token_id)
        if state.logprobs is not None and output.new_logprobs:
            state.logprobs.append(self._decoded(output.new_logprobs[position], token_id))
        finish_reason = output.finish_reason if last else None
        # The token that ended the request (EOS, a stop id) is not part of the text.
        stopped_by_token = finish_reason == "stop"
        if not state.defer_text and not stopped_by_token:
            piece = state.detokenizer.push(token_id)
            if piece:
                previous = len(state.text)
                state.text += piece
                may_stop = len(state.output_token_ids) >= state.params.min_tokens
                if may_stop and state.params.stop and self._check_stop_strings(state, previous):
                    return True
        if finish_reason is not None:
            state.finish_reason = finish_reason
            state.stop_reason = output.stop_reason
            if state.defer_text:
                text_ids = state.output_token_ids[:-1] if stopped_by_token else state.output_token_ids
                state.text += state.detokenizer.push_all(text_ids)
            else:
                state.text += state.detokenizer.flush()
        return False

    def _decoded(self, entry: TokenLogprobs, token_id: int) -> dict[int, Logprob]:
        """A token's logprob and its top candidates, each with its text."""
        decode = self.tokenizer.decode
        entries = {token_id: Logprob(entry.logprob, entry.rank, decode([token_id], False))}
        for rank, (candidate, value) in enumerate(entry.top, start=1):
            entries.setdefault(candidate, Logprob(value, rank, decode([candidate], False)))
        return entries

    def _check_stop_strings(self, state: RequestOutputState, previous_length: int) -> bool:
        params = state.params
        longest = max(len(stop) for stop in params.stop)
        search_from = max(0, previous_length - longest + 1)
        found = None
        for stop in params.stop:
            index = state.text.find(stop, search_from)
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return False
        index, stop = found
        state.text = state.text[: index + len(stop)] if params.include_stop_str_in_output else state.text[:index]
        state.stop_reason = stop
        state.finish_reason = "stop"
        return True
