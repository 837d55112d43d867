"""Turn the logits of one step into the next token of each request.

Order of processing, per request: penalties (repetition over prompt and
output, presence/frequency over output), the ``min_tokens`` ban on EOS and stop
ids, then greedy argmax, or temperature, top-k, top-p, min-p and a draw from the
request's own generator when it has a seed. Log-probabilities are those of
the model's raw distribution (before penalties and temperature), as vLLM
returns by default.

Everything but the plain greedy argmax runs on the host in float32. A row whose
logits are not finite, or whose sampling raises, gets an error instead of a
token: the scheduler fails that request alone and the step's others go on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec
import torch

if TYPE_CHECKING:
    from weft.runner.model_runner import RequestState as Request
    from weft.sampling_params import SamplingParams


NON_FINITE_LOGITS = "the model's logits for it are not finite (NaN or inf)"
SAMPLING_FAILED = "sampling its next token failed"

logger = logging.getLogger("weft.runner")


class SampledToken(msgspec.Struct):
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None
    """Why this row got no token (its logits are not finite, its draw failed): its request fails alone."""


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """Sample one token per row of ``logits`` (on the model's device).

        Rows of plain greedy requests (no logprobs, no penalties) take their
        argmax where the logits are; only the other rows are copied to the host.
        A row whose logits hold a NaN or +inf, or only -inf, gets an error instead of a token.
        """
        plain = [row for row, request in enumerate(requests) if plain_greedy(request)]
        if len(plain) == len(requests):
            return greedy_tokens(logits)
        sampled: list[SampledToken | None] = [None] * len(requests)
        if plain:
            for row, token in zip(plain, greedy_tokens(logits[plain])):
                sampled[row] = token
        others = [row for row in range(len(requests)) if sampled[row] is None]
        for row, token in zip(others, self._sample_on_host(logits[others].float().cpu(), [requests[row] for row in others])):
            sampled[row] = token
        return sampled  # type: ignore[return-value]

    def _sample_on_host(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        healthy = torch.isfinite(logits.max(dim=-1).values).tolist()
        raw_logprobs = None
        if any(request.params.logprobs is not None for request in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        sampled = []
        for row, request in enumerate(requests):
            if not healthy[row]:
                sampled.append(SampledToken(-1, error=NON_FINITE_LOGITS))
                continue
            try:
                sampled.append(self._sample_row(logits[row], None if raw_logprobs is None else raw_logprobs[row], request))
            except Exception:  # one request's failure must not end the step of the others
                logger.exception("sampling request %s failed", request.request_id)
                sampled.append(SampledToken(-1, error=SAMPLING_FAILED))
        return sampled

    def _sample_row(self, logits: torch.Tensor, raw_logprobs: torch.Tensor | None, request: Request) -> SampledToken:
        if _needs_processing(request):
            logits = logits.clone()
            _apply_penalties(logits, request)
        token = int(logits.argmax()) if request.params.greedy else self._draw(logits, request)
        if raw_logprobs is None or request.params.logprobs is None:
            return SampledToken(token)
        chosen = float(raw_logprobs[token])
        rank = int((raw_logprobs > chosen).sum()) + 1
        top = []
        if request.params.logprobs:
            values, indices = raw_logprobs.topk(request.params.logprobs)
            top = list(zip(indices.tolist(), values.tolist()))
        return SampledToken(token, chosen, rank, top)

    def _draw(self, logits: torch.Tensor, request: Request) -> int:
        probs = torch.softmax(filter_logits(logits, request.params), dim=-1)
        generator = request.generator or self.generator
        return int(torch.multinomial(probs, 1, generator=generator))


def greedy_maxima(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax, and whether the row is healthy: its maximum is finite (max propagates NaN,
    so a NaN anywhere, a +inf, or a row of -inf all fail), on the logits' device without a sync."""
    values, tokens = logits.max(dim=-1)
    return tokens, torch.isfinite(values)


def greedy_tokens(logits: torch.Tensor) -> list[SampledToken]:
    tokens, healthy = greedy_maxima(logits)
    return [SampledToken(token) if ok else SampledToken(-1, error=NON_FINITE_LOGITS)
            for token, ok in zip(tokens.tolist(), healthy.tolist(), strict=True)]


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on one row of logits; removed tokens become -inf."""
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        threshold = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        before = sorted_probs.cumsum(0) - sorted_probs
        remove = before >= params.top_p
        remove[0] = False
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(0, order, remove), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def plain_greedy(request: Request) -> bool:
    """Whether the request's next token is its raw argmax (no logprobs, penalties or bans to apply)."""
    return request.params.greedy and request.params.logprobs is None and not _needs_processing(request)


def _needs_processing(request: Request) -> bool:
    params = request.params
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or len(request.output_token_ids) < params.min_tokens
    )


def _apply_penalties(logits: torch.Tensor, request: Request) -> None:
    params = request.params
    output = torch.tensor(request.output_token_ids, dtype=torch.long)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.prompt_token_ids) | set(request.output_token_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output.numel() and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(output, minlength=logits.shape[-1])[: logits.shape[-1]].float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if len(request.output_token_ids) < params.min_tokens:
        banned = list(request.eos_token_ids | set(params.stop_token_ids))
        if banned:
            logits[banned] = float("-inf")
