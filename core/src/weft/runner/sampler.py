"""Turn the logits of one step into the next token of each request.

Order of processing, per request: allowed tokens, bad words and logit bias
(:mod:`weft.runner.logits_processors`), penalties (repetition over prompt and
output, presence/frequency over output), the ``min_tokens`` ban on EOS and stop
ids, then greedy argmax, or temperature, top-k, top-p, min-p and a draw from the
request's own generator when it has a seed. Log-probabilities are those of
the model's raw distribution (before penalties and temperature), as vLLM
returns by default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import torch

from weft.runner.logits_processors import apply_request_processors, needs_request_processors

if TYPE_CHECKING:
    from weft.runner.model_runner import RequestState as Request
    from weft.sampling_params import SamplingParams


class SampledToken(msgspec.Struct):
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """Sample one token per row of ``logits`` (on the model's device).

        Rows of plain greedy requests (no logprobs, no penalties) take their
        argmax where the logits are; only the other rows are copied to the host.
        """
        plain = [row for row, request in enumerate(requests) if plain_greedy(request)]
        if len(plain) == len(requests):
            return [SampledToken(token) for token in logits.argmax(dim=-1).tolist()]
        sampled: list[SampledToken | None] = [None] * len(requests)
        if plain:
            for row, token in zip(plain, logits[plain].argmax(dim=-1).tolist()):
                sampled[row] = SampledToken(token)
        others = [row for row in range(len(requests)) if sampled[row] is None]
        for row, token in zip(others, self._sample_on_host(logits[others].float().cpu(), [requests[row] for row in others])):
            sampled[row] = token
        return sampled  # type: ignore[return-value]

    def _sample_on_host(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        raw_logprobs = None
        if any(request.params.logprobs is not None for request in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if any(_needs_processing(request) for request in requests):
            logits = logits.clone()
            for row, request in enumerate(requests):
                if _needs_processing(request):
                    apply_request_processors(logits[row], request)
                    _apply_penalties(logits[row], request)
        greedy = [row for row, request in enumerate(requests) if request.params.greedy]
        tokens = torch.empty(len(requests), dtype=torch.long)
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        for row, request in enumerate(requests):
            if not request.params.greedy:
                tokens[row] = self._draw(logits[row], request)
        sampled = []
        for row, request in enumerate(requests):
            token = int(tokens[row])
            if raw_logprobs is None or request.params.logprobs is None:
                sampled.append(SampledToken(token))
                continue
            row_logprobs = raw_logprobs[row]
            chosen = float(row_logprobs[token])
            rank = int((row_logprobs > chosen).sum()) + 1
            top = []
            if request.params.logprobs:
                values, indices = row_logprobs.topk(request.params.logprobs)
                top = list(zip(indices.tolist(), values.tolist()))
            sampled.append(SampledToken(token, chosen, rank, top))
        return sampled

    def _draw(self, logits: torch.Tensor, request: Request) -> int:
        filtered = filter_logits(logits, request.params)
        if torch.isneginf(filtered).all():  # every token banned (say a constraint's end under min_tokens)
            return int(logits.argmax())
        probs = torch.softmax(filtered, dim=-1)
        generator = request.generator or self.generator
        return int(torch.multinomial(probs, 1, generator=generator))


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
        or needs_request_processors(params)
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
