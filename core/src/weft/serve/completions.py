"""The (legacy) Completions API (``POST /v1/completions``): prompts as text or token ids, echo, best_of,
prompt scoring and log-probabilities in OpenAI's legacy shape, streamed or whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from weft.engine.api.streams import Delta
from weft.outputs import Logprob
from weft.serve import fields, structured
from weft.serve import protocol as p
from weft.serve.body import HTTPError
from weft.serve.server import Server, field_of, request_id, server_of, start_constrained
from weft.serve.stream import finite, sse_stream


async def completions(request: Request) -> Response:
    server = server_of(request)
    body: p.CompletionRequest = await server.read(request, p.CompletionRequest, "completions")
    server.check_model(body.model)
    try:
        constraint, field = structured.from_sampling_fields(body)
    except ValueError as error:
        raise HTTPError(400, str(error), param=field_of(error)) from None
    prompts = await server.engine.off_loop(_completion_prompts, server, body.prompt)
    scores_only = body.max_tokens == 0
    if scores_only and not body.echo:
        raise HTTPError(
            400,
            "max_tokens: 0 generates nothing, which only echo (scoring the prompt) allows; set "
            "max_tokens to 1 or more, or echo to true",
            param="max_tokens",
        )
    max_tokens = 1 if scores_only else body.max_tokens  # the forward that scores the prompt samples a token, dropped
    for prompt in prompts:
        server.check_length(prompt, max_tokens)
    # echo with logprobs scores the prompt too: its logprobs come from the same forward as the output's.
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    n, best_of = _best_of(body)
    params = server.sampling_params(
        body,
        max_tokens,
        body.logprobs,
        unset_max_tokens=16,
        constraint=constraint,
        prompt_logprobs=prompt_logprobs,
        **fields.output_text(body),
    )
    if params.greedy:
        best_of = n  # greedy candidates are all alike: the first n are the best n
    if best_of != n:
        # Ranking the candidates needs each sampled token's log-probability: asked for even when the client did not.
        logprobs = body.logprobs if body.logprobs is not None else 0
        params = msgspec.structs.replace(params, n=best_of, logprobs=logprobs)
    output, ids = await start_constrained(
        server,
        request,
        prompts,
        params,
        field,
        body.kv_transfer_params,
        choices_field="best_of" if best_of != n else "n",
    )
    if scores_only:
        output = _PromptOnly(output)
    response_id, created = f"cmpl-{request_id(request)}", int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _completion_stream(server, output, ids, prompts, body, response_id, created, include_usage),
            media_type="text/event-stream",
        )
    deltas = await server.collect(request, output, ids)
    best = _best_candidates(deltas, n, best_of) if best_of != n else deltas
    choices = await server.engine.off_loop(
        _completion_choices, server, body, prompts, best
    )  # decoding the echoed prompts
    return JSONResponse(
        {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": server.model_name,
            # Usage counts every candidate: each was computed.
            "choices": choices,
            "usage": msgspec.to_builtins(fields.usage(prompts, deltas)),
        }
    )


class _PromptOnly:
    """The output queue of a completion scoring its prompt only (``echo`` with ``max_tokens`` 0): the engine samples
    one token (the prompt's logprobs come from that forward), which each delta here goes without."""

    def __init__(self, queue: asyncio.Queue) -> None:
        self.queue = queue

    async def get(self) -> Delta:
        return _without_output(await self.queue.get())

    def get_nowait(self) -> Delta:
        return _without_output(self.queue.get_nowait())

    def empty(self) -> bool:
        return self.queue.empty()


def _without_output(delta: Delta) -> Delta:
    if delta.error:
        return delta
    return msgspec.structs.replace(
        delta,
        token_ids=[],
        text="",
        logprobs=None if delta.logprobs is None else [],
        num_output_tokens=0,
        stop_reason=None,
        finish_reason=None if delta.finish_reason is None else "length",
    )


def _best_of(body: p.CompletionRequest) -> tuple[int, int]:
    """``(n, best_of)`` of a completions request, or a 400 naming the field."""
    n = body.n or 1
    best_of = body.best_of if body.best_of is not None else n
    if best_of < n:
        raise HTTPError(
            400,
            f"best_of ({best_of}) must be at least n ({n}): it is the number of candidates the n "
            f"choices are picked from; raise best_of or lower n",
            param="best_of",
        )
    if best_of > n and body.stream:
        raise HTTPError(
            400,
            f"best_of ({best_of}) above n ({n}) cannot be streamed: the best candidates are known only "
            f"when every one has finished; set stream to false or best_of to n",
            param="best_of",
        )
    return n, best_of


def _best_candidates(deltas: list[list[Delta]], n: int, best_of: int) -> list[list[Delta]]:
    """Of each prompt's ``best_of`` candidates (consecutive), the ``n`` whose sampled tokens have the highest
    log-probability per token (OpenAI's "best"; a sum would favour the shortest), best first (ties: the earlier
    candidate). Exactly ``n`` per prompt, so a choice's prompt is still its index over ``n``."""

    def score(choice: list[Delta]) -> float:
        values = [
            entry[token].logprob
            for delta in choice
            for token, entry in zip(delta.token_ids, delta.logprobs or (), strict=False)
        ]
        return sum(values) / max(len(values), 1)

    chosen = []
    for start in range(0, len(deltas), best_of):
        candidates = deltas[start : start + best_of]
        ranked = sorted(range(len(candidates)), key=lambda index: -score(candidates[index]))
        chosen.extend(candidates[index] for index in ranked[:n])
    return chosen


def _completion_choices(
    server: Server, body: p.CompletionRequest, prompts: list[list[int]], deltas: list[list[Delta]]
) -> list[dict[str, Any]]:
    echoed = [server.tokenizer.decode(prompt) for prompt in prompts] if body.echo else []
    choices = []
    for index, choice in enumerate(deltas):
        prompt = prompts[index // body.n]
        prefix = echoed[index // body.n] if body.echo else ""
        tokens = [token for delta in choice for token in delta.token_ids]
        entries = [entry for delta in choice for entry in (delta.logprobs or [])]
        logprobs = None
        if body.logprobs is not None:
            logprobs = _completion_logprobs(entries, tokens, body.logprobs, len(prefix))
            if body.echo:
                echoed_logprobs = _prompt_completion_logprobs(server, choice[0].prompt_logprobs, prompt, body.logprobs)
                logprobs = _join_logprobs(echoed_logprobs, logprobs)
        entry: dict[str, Any] = {
            "index": index,
            "text": prefix + "".join(delta.text for delta in choice),
            "logprobs": logprobs,
            "finish_reason": choice[-1].finish_reason,
            "stop_reason": choice[-1].stop_reason,
        }
        if body.prompt_logprobs is not None:
            entry["prompt_logprobs"] = _prompt_logprobs_json(choice[0].prompt_logprobs)
        choices.append(entry)
    return choices


def _prompt_completion_logprobs(
    server: Server, entries: list[dict[int, Logprob] | None] | None, prompt: list[int], top: int
) -> dict[str, list[Any]]:
    """The prompt's tokens in a completion's logprobs shape (the first token has none, as in OpenAI's API)."""
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, entry in zip(prompt, entries or [None] * len(prompt), strict=False):
        text = server.tokenizer.decode([token], skip_special_tokens=False)
        result["tokens"].append(text)
        result["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            continue
        result["token_logprobs"].append(finite(entry[token].logprob))
        result["top_logprobs"].append(_top_with_chosen(entry, token, top))
    return result


def _join_logprobs(first: dict[str, list[Any]], second: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: first[key] + second[key] for key in first}


def _prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None or ``{token id: {logprob, rank, decoded_token}}``."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {str(token): {**msgspec.to_builtins(lp), "logprob": finite(lp.logprob)} for token, lp in entry.items()}
        for entry in entries
    ]


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _completion_prompts(server: Server, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise HTTPError(400, "prompt: must not be empty", param="prompt")
    if _is_token_list(prompt):
        return [list(prompt)]
    if not all(isinstance(item, str) or _is_token_list(item) for item in prompt):
        raise HTTPError(
            400,
            "prompt: expected a string, a list of strings, a list of token ids or a list of token-id lists",
            param="prompt",
        )
    try:
        prompts = [
            server.engine.frontend.encode_prompt(item) if isinstance(item, str) else list(item) for item in prompt
        ]
    except ValueError as error:
        raise HTTPError(400, f"prompt: {error}", param="prompt") from None
    if any(not item for item in prompts):
        raise HTTPError(400, "prompt: every prompt needs at least one token", param="prompt")
    return prompts


def _completion_stream(
    server: Server,
    output: asyncio.Queue,
    ids: list[str],
    prompts: list[list[int]],
    body: Any,
    response_id: str,
    created: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    head = {"id": response_id, "object": "text_completion", "created": created, "model": server.model_name}
    offsets = [0] * len(ids)
    opening = []
    wants_logprobs = body.logprobs is not None
    # echo: the prompt opens each choice; with logprobs it goes out with the first delta, which brings its logprobs.
    echo_pending = [bool(body.echo and wants_logprobs)] * len(ids)
    if body.echo and not wants_logprobs:
        for index in range(len(ids)):
            prompt_text = server.tokenizer.decode(prompts[index // body.n])
            offsets[index] = len(prompt_text)
            opening.append({"index": index, "text": prompt_text, "logprobs": None, "finish_reason": None})

    def render(delta: Delta) -> dict[str, Any] | None:
        index = delta.index
        if (
            not delta.text
            and not delta.finish_reason
            and not (wants_logprobs and delta.token_ids)
            and not echo_pending[index]
        ):
            return None
        text, logprobs = delta.text, None
        if echo_pending[index]:
            echo_pending[index] = False
            prompt = prompts[index // body.n]
            prompt_text = server.tokenizer.decode(prompt)
            offsets[index] = len(prompt_text)
            text = prompt_text + text
            echoed = _prompt_completion_logprobs(server, delta.prompt_logprobs, prompt, body.logprobs)
            logprobs = _join_logprobs(
                echoed, _completion_logprobs(delta.logprobs or [], delta.token_ids, body.logprobs, offsets[index])
            )
        elif wants_logprobs:
            logprobs = _completion_logprobs(delta.logprobs or [], delta.token_ids, body.logprobs, offsets[index])
        offsets[index] += len(delta.text)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    return sse_stream(server, output, ids, prompts, head, include_usage, opening, render)


def _top_with_chosen(entry: dict[int, Logprob], token: int, top: int) -> dict[str, float]:
    """A completion's ``top_logprobs`` entry: the ``top`` most likely tokens and the chosen one (OpenAI's
    legacy API: up to ``logprobs + 1`` entries)."""
    ranked = sorted(entry.values(), key=lambda lp: lp.rank)[:top]
    chosen = entry[token]
    if all(lp is not chosen for lp in ranked):
        ranked.append(chosen)
    return {lp.decoded_token: finite(lp.logprob) for lp in ranked}


def _completion_logprobs(entries: list[dict[int, Logprob]], tokens: list[int], top: int, offset: int) -> dict[str, Any]:
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries, strict=False):
        chosen = entry[token]
        result["tokens"].append(chosen.decoded_token)
        result["token_logprobs"].append(finite(chosen.logprob))
        result["top_logprobs"].append(_top_with_chosen(entry, token, top))
        result["text_offset"].append(offset)
        offset += len(chosen.decoded_token)
    return result
