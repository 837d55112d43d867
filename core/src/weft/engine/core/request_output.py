"""What a step's row gives a request: its tokens taken one by one under the stop rules, and what the caller gets.

:func:`take_tokens` appends a row's tokens (its sampled token, then the proposals it accepted under speculative
decoding) to the request, each through the stop rules (:func:`stop`: EOS, stop token ids, ``max_tokens``, the
context length), so a run of accepted proposals stops where plain decoding would; the tokens after the stop are
dropped. It is the own helper of
:meth:`SchedulerState.update_from_output <weft.engine.core.scheduler_state.SchedulerState.update_from_output>`,
and with it the one writer of a request's output tokens and of the ends outputs decide.

:func:`token_output` is what the caller gets of the tokens taken (their logprobs, the prompt's logprobs with the
first token); :func:`add_prompt_logprobs` keeps the prompt logprobs a step scored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weft.contracts.executor import TokenLogprobs
from weft.engine.core.request import Request, RequestStatus
from weft.engine.messages import EngineCoreOutput

if TYPE_CHECKING:
    from weft.engine.core.structured_output import StructuredOutputManager


def take_tokens(
    request: Request,
    tokens: list[int],
    logprobs: list[TokenLogprobs] | None,
    structured_outputs: StructuredOutputManager | None,
    max_model_len: int,
) -> EngineCoreOutput:
    """Append the step's ``tokens`` (``logprobs``: each one's) to ``request`` one by one under the stop rules (a
    run of accepted proposals stops where plain decoding would: the tokens after the stop are dropped); what the
    caller gets of them."""
    kept = 0
    for token in tokens:
        request.append_token(token)
        kept += 1
        if request.constraint is not None:
            structured_outputs.accept(request, token)  # type: ignore[union-attr]
        request.status, request.stop_reason = stop(request, token, max_model_len)
        if request.finished:
            break
    return token_output(request, tokens[:kept], logprobs[:kept] if logprobs else None)


def stop(request: Request, token_id: int, max_model_len: int) -> tuple[RequestStatus | None, int | None]:
    """How ``request`` ends with ``token_id``, just appended, and the stop token id that ended it
    (``(None, None)``: it goes on)."""
    params = request.params
    generated = len(request.output_token_ids)
    if generated >= params.min_tokens:
        if token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
    if generated >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None, None


def token_output(request: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None) -> EngineCoreOutput:
    """What the caller gets of the token ``request`` just took (and of its end, when it ended): with its
    logprobs, and the prompt's logprobs with its first token."""
    first = len(request.output_token_ids) == len(tokens)
    prompt_logprobs = None
    if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
        prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
    return EngineCoreOutput(
        request.request_id,
        tokens,
        logprobs,
        request.finish_reason,
        request.stop_reason,
        request.num_cached_tokens,
        queued_seconds=request.first_scheduled_time - request.arrival_time if first else None,
        prompt_logprobs=prompt_logprobs,
    )


def add_prompt_logprobs(request: Request, position: int, entries: list[TokenLogprobs]) -> None:
    """Keep the logprobs of prompt tokens not seen yet (a recomputation after a preemption repeats some)."""
    have = request.prompt_logprobs
    if have is None or request.prompt_logprobs_sent:
        return
    skip = len(have) + 1 - position  # the first entry scores prompt token ``position``; token 0 has none
    if skip >= 0:
        have.extend(entries[skip:])
